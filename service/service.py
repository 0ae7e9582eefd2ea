"""The reward-scoring HTTP service (BentoML 1.4):

    bentoml serve service.service:RewardService --timeout-keep-alive 75 --host 127.0.0.1 --port 3000

(75 s keep-alive: see service/config.py, `serve_command`.)

It serves the model ANCHOR_RM_MODEL_URI names (default models:/anchor-rm-harmless@champion) with that
version's report, and follows the alias when it moves. Settings: service/config.py. The logic lives in
framework-free modules beside it (schemas.py: requests, responses and their limits; holder.py: the served
model and its reloads; guard.py: the ASGI guard; batching.py: the request batcher) and in anchor_rm (the one
scoring path); this file is the BentoML wiring.

Public endpoints validate a request, then score its pairs through one `ScoreBatcher` (service/batching.py):
the requests that arrive while a batch is being scored share the next batch, in this process, without a
second HTTP hop. /metrics counts them: `anchor_rm_scored_pairs_total`, and `anchor_rm_batch_requests` (a
histogram of requests per batch).

Every scored pair carries the version's OOD flag (anchor_rm/model/ood_flag.py): `ood_score` and `in_domain`, in
each endpoint's own shape, from the same forward pass (ANCHOR_RM_OOD_FLAG=0 turns it off). /metrics exports
`anchor_rm_ood_flagged_pairs_total`, `anchor_rm_ood_checked_pairs_total` and
`anchor_rm_ood_flagged_fraction` (over the last 1,000 judged pairs): drift as a trainer's dashboard sees it.

Besides its own API (/score, /best_of_n, /compare), the service speaks the protocols RLHF trainers use
(service/protocols.py): OpenRLHF's /get_reward, vLLM's /classify, /pooling and GET /v1/models (verl),
slime's /reward, and rerank (/v1/rerank, /v2/rerank, /rerank). The model loads in the background: until it
serves, every model endpoint answers 503 with Retry-After and the reason, and /readyz says why.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
import shutil
import time
from pathlib import Path
from typing import Any

import anyio.to_thread
import bentoml
import torch
from bentoml.exceptions import ServiceUnavailable
from starlette.responses import JSONResponse

from anchor_rm.model import scoring
from anchor_rm.model.ood_flag import RECENT_PAIRS, RecentShare
from service import guard, holder, protocols, schemas
from service.batching import QueueTimeout, ScoreBatcher
from service.config import gpu_resources, load_settings
from service.get_routes import GetRoutes
from service.protocols import ClassifyRequest, RerankRequest, SampleRequest
from service.schemas import (BestOfNRequest, BestOfNResponse, CompareRequest, CompareResponse, GetRewardRequest,
                             GetRewardResponse, ModelInfo, ModelRef, ReloadResponse, RequestError, ScoreRequest,
                             ScoreResponse)

logger = logging.getLogger("anchor_rm.service")
SETTINGS = load_settings()
SCORED_PAIRS = bentoml.metrics.Counter(name="anchor_rm_scored_pairs", documentation="pairs scored by the model")
BATCH_REQUESTS = bentoml.metrics.Histogram(name="anchor_rm_batch_requests", documentation="requests per scored batch",
                                           buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
OOD_FLAGGED = bentoml.metrics.Counter(name="anchor_rm_ood_flagged_pairs",
                                      documentation="scored pairs the OOD flag marked out of domain (in_domain false)")
OOD_CHECKED = bentoml.metrics.Counter(name="anchor_rm_ood_checked_pairs",
                                      documentation="scored pairs the OOD flag judged (flag on, version has a fit)")
OOD_RECENT = bentoml.metrics.Gauge(name="anchor_rm_ood_flagged_fraction",
                                   documentation=f"share of the last {RECENT_PAIRS} judged pairs marked out of domain")


def _count_batch(requests: int, pairs: int) -> None:
    BATCH_REQUESTS.observe(requests)
    SCORED_PAIRS.inc(pairs)


@dataclass(frozen=True)
class Scored:
    """One request's answer from its batch: per pair the reward, truncation and the OOD flag (None where the
    flag is off or the version has no fit), and the version that scored it."""

    rewards: list[float]
    truncated: list[bool]
    ood_score: list[float | None]
    in_domain: list[bool | None]
    model: ModelRef


def _bad_request(exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=400)


class _Live:
    """The running service's model holder, for the ASGI layers in front of it (created before it)."""

    holder: holder.ModelHolder | None = None
    started = int(time.time())


LIVE = _Live()


def _not_ready() -> str | None:
    return "the service is starting" if LIVE.holder is None else LIVE.holder.not_ready_reason()


def _models() -> tuple[int, dict]:
    """GET /v1/models (vLLM's and OpenAI's model list): the one model served."""
    model = LIVE.holder.current
    return 200, protocols.models_response(_model_id(model), model.resolved, model.max_length, LIVE.started)


def _model_id(model: holder.ServedModel) -> str:
    return model.registered_name or model.resolved


# Paths that need the model: while it loads they answer 503 (guard.ApiGuard).
MODEL_PATHS = ("/score", "/best_of_n", "/compare", "/get_reward", "/classify", "/pooling", "/reward", "/v1/rerank",
               "/v2/rerank", "/rerank", "/v1/models", "/model", "/report", "/reload")


@bentoml.service(
    name="anchor_rm_reward",
    http={"host": SETTINGS.host, "port": SETTINGS.port},
    traffic={"timeout": SETTINGS.timeout_seconds},
    workers=1,
    # Where it scores on a GPU, it declares one (ANCHOR_RM_GPUS, config.declared_gpus): `bentoml serve` confines
    # the worker to a GPU no other service of it holds, through the worker's CUDA_VISIBLE_DEVICES.
    resources=gpu_resources(SETTINGS, torch.cuda.is_available()),
)
class RewardService:
    def __init__(self) -> None:
        holder.configure_mlflow()
        self._own_root = not SETTINGS.download_dir
        self._root = Path(SETTINGS.download_dir) if SETTINGS.download_dir else holder.default_download_root()
        self.limits = SETTINGS.limits()
        loader = functools.partial(holder.load_served_model, batch_size=SETTINGS.forward_batch_size,
                                   precision=SETTINGS.precision, device=SETTINGS.device,
                                   max_tokens=SETTINGS.forward_max_tokens or None, ood_flag=SETTINGS.ood_flag)
        self.holder = holder.ModelHolder(SETTINGS.model_uri, self._root, loader=loader)
        LIVE.holder = self.holder
        self.holder.load_in_background(retry_seconds=SETTINGS.poll_seconds or 10.0)
        self.holder.start_polling(SETTINGS.poll_seconds)
        self.batcher = ScoreBatcher(self._score_batch, max_batch_size=SETTINGS.max_batch_size,
                                    batching=SETTINGS.batching, max_wait_seconds=SETTINGS.max_latency_ms / 1000,
                                    on_batch=_count_batch)
        self.recent_flags = RecentShare()  # touched by the scoring thread only

    @bentoml.on_shutdown
    def _close(self) -> None:
        self.batcher.close()
        self.holder.close()
        if self._own_root:
            shutil.rmtree(self._root, ignore_errors=True)

    def __is_ready__(self) -> bool:
        return self.holder.loaded

    def _score_batch(self, prompts: list[str], responses: list[str]) -> tuple:
        """One batch, in the batcher's worker thread: one model object for all of it, even if a reload swaps
        the served model meanwhile. Per-pair columns for the batcher to slice, and the version."""
        model = self.holder.current
        scored = model.score(prompts, responses)
        ood, inside = [None] * len(prompts), [None] * len(prompts)
        if scored.in_domain is not None:
            ood, inside = [float(x) for x in scored.ood_scores], [bool(x) for x in scored.in_domain]
            flagged = inside.count(False)
            OOD_CHECKED.inc(len(inside))
            OOD_FLAGGED.inc(flagged)
            OOD_RECENT.set(self.recent_flags.add([not d for d in inside]))
        return [float(r) for r in scored.rewards], [bool(t) for t in scored.truncated], ood, inside, model.ref

    async def _score(self, prompts: list[str], responses: list[str]) -> Scored:
        try:
            return Scored(*await self.batcher.score(prompts, responses))
        except QueueTimeout as exc:
            raise ServiceUnavailable(str(exc)) from None

    async def _score_with_tokens(self, prompts: list[str], responses: list[str]) -> tuple[Scored, list[int], str]:
        """The pairs scored, the tokens each was scored on (for usage), and the id of the model that scored them:
        a reload while they were scored must not give the rewards of one version the tokens and id of the next."""
        before = self.holder.current
        scored = await self._score(prompts, responses)
        model = before if before.ref == scored.model else self.holder.current
        tokens = await anyio.to_thread.run_sync(model.token_counts, prompts, responses)
        return scored, tokens, scored.model.name

    @bentoml.api(route="/score")
    async def score(self, request: ScoreRequest, /) -> ScoreResponse:
        """Rewards for prompt-response pairs: {"items": [{"prompt": ..., "response": ...}, ...]}."""
        prompts = [item.prompt for item in request.items]
        responses = [item.response for item in request.items]
        try:
            schemas.check_pairs(prompts, responses, self.limits)
        except RequestError as exc:
            return _bad_request(exc)
        scored = await self._score(prompts, responses)
        return ScoreResponse(rewards=scored.rewards, truncated=scored.truncated, ood_score=scored.ood_score,
                             in_domain=scored.in_domain, model=scored.model)

    @bentoml.api(route="/best_of_n")
    async def best_of_n(self, request: BestOfNRequest, /) -> BestOfNResponse:
        """Rank candidate responses to one prompt: rewards, the ranking (best first) and the best index."""
        try:
            schemas.check_best_of_n(request.prompt, request.candidates, self.limits)
        except RequestError as exc:
            return _bad_request(exc)
        scored = await self._score([request.prompt] * len(request.candidates), request.candidates)
        ranking = scoring.rank(scored.rewards)
        return BestOfNResponse(rewards=scored.rewards, ranking=ranking, best_index=ranking[0], truncated=scored.truncated,
                               ood_score=scored.ood_score, in_domain=scored.in_domain, model=scored.model)

    @bentoml.api(route="/compare")
    async def compare(self, request: CompareRequest, /) -> CompareResponse:
        """P(response_a preferred over response_b) = sigmoid(r_a - r_b), with both rewards."""
        try:
            schemas.check_compare(request.prompt, request.response_a, request.response_b, self.limits)
        except RequestError as exc:
            return _bad_request(exc)
        scored = await self._score([request.prompt] * 2, [request.response_a, request.response_b])
        (r_a, r_b), (t_a, t_b) = scored.rewards, scored.truncated
        return CompareResponse(p_a_preferred=scoring.preference_probability(r_a, r_b), reward_a=r_a, reward_b=r_b,
                               truncated_a=t_a, truncated_b=t_b, ood_score_a=scored.ood_score[0],
                               ood_score_b=scored.ood_score[1], in_domain_a=scored.in_domain[0],
                               in_domain_b=scored.in_domain[1], model=scored.model)

    @bentoml.api(route="/get_reward")
    async def get_reward(self, request: GetRewardRequest, /) -> GetRewardResponse:
        """OpenRLHF's remote reward model: {"query": [...], "prompts": [...], "labels": [...]} ->
        {"rewards": [...], "scores": [...], "extra_logs": {...}}. Point --remote_rm_url at this route."""
        try:
            split = schemas.split_queries(request.query, request.prompts, self.limits, request.labels)
        except RequestError as exc:
            return _bad_request(exc)
        if not split.prompts:  # OpenRLHF sends every reward server after the first empty lists
            return GetRewardResponse(rewards=[], scores=[], extra_logs={"truncated": [], "prompt_found": []},
                                     ood_score=[], in_domain=[], model=self.holder.current.ref)
        scored = await self._score(split.prompts, split.responses)
        logs = {"truncated": [float(t) for t in scored.truncated], "prompt_found": [float(f) for f in split.prompt_found]}
        if None not in scored.in_domain:  # OpenRLHF averages each list into its logs: the share in domain
            logs.update(ood_score=list(scored.ood_score), in_domain=[float(d) for d in scored.in_domain])
        return GetRewardResponse(rewards=scored.rewards, scores=scored.rewards, extra_logs=logs,
                                 ood_score=scored.ood_score, in_domain=scored.in_domain, model=scored.model)

    @bentoml.api(route="/classify")
    async def classify(self, request: ClassifyRequest, /) -> dict[str, Any]:
        """vLLM's classification API (verl's reward loop): {"model", "input": text or [texts]} or {"messages"}
        -> {"data": [{"index", "label", "probs": [score], "num_classes": 1}], "usage", ...}. score is
        sigmoid(reward), or the reward itself with "use_activation": false (older clients: "activation")."""
        try:
            pairs = protocols.classify_pairs(request, self.limits)
        except RequestError as exc:
            return _bad_request(exc)
        scored, tokens, model_id = await self._score_with_tokens(pairs.prompts, pairs.responses)
        return protocols.classify_response(model_id, scored.rewards, tokens, protocols.use_activation(request),
                                           scored.ood_score, scored.in_domain)

    @bentoml.api(route="/pooling")
    async def pooling(self, request: ClassifyRequest, /) -> dict[str, Any]:
        """vLLM's pooling API: the same inputs as /classify -> {"data": [{"index", "object": "pooling",
        "data": [reward]}], "usage", ...}; the raw reward unless "use_activation": true."""
        try:
            pairs = protocols.classify_pairs(request, self.limits)
        except RequestError as exc:
            return _bad_request(exc)
        scored, tokens, model_id = await self._score_with_tokens(pairs.prompts, pairs.responses)
        return protocols.pooling_response(model_id, scored.rewards, tokens, protocols.use_activation(request, default=False),
                                          scored.ood_score, scored.in_domain)

    @bentoml.api(route="/reward")
    async def reward(self, request: SampleRequest, /) -> dict[str, Any]:
        """slime's remote reward (--rm-url .../reward --reward-key reward): {"prompt", "response", "label"}
        -> {"reward": r, "score": r, "ood_score": s, "in_domain": b}."""
        try:
            prompt, response = protocols.sample_pair(request, self.limits)
        except RequestError as exc:
            return _bad_request(exc)
        scored = await self._score([prompt], [response])
        return {"reward": scored.rewards[0], "score": scored.rewards[0], "ood_score": scored.ood_score[0],
                "in_domain": scored.in_domain[0]}

    async def _rerank(self, request: RerankRequest) -> Any:
        try:
            candidates = protocols.rerank_candidates(request, self.limits)
        except RequestError as exc:
            return _bad_request(exc)
        scored, tokens, model_id = await self._score_with_tokens([candidates.query] * len(candidates.documents),
                                                                 candidates.documents)
        answer = protocols.rerank_response(request, candidates, scored.rewards, model_id, tokens, scored.ood_score,
                                           scored.in_domain)
        return JSONResponse(answer) if isinstance(answer, list) else answer

    @bentoml.api(route="/v1/rerank")
    async def rerank_v1(self, request: RerankRequest, /) -> Any:
        """Rerank (Cohere's shape, LiteLLM's rerank): {"query", "documents", "top_n"} -> {"results": [{"index",
        "relevance_score", "document": {"text"}}]}, best first; relevance_score = sigmoid(reward). With
        TEI's "texts" instead of "documents", TEI's answer: a list of {"index", "score"}."""
        return await self._rerank(request)

    @bentoml.api(route="/v2/rerank")
    async def rerank_v2(self, request: RerankRequest, /) -> Any:
        """The same as /v1/rerank (LiteLLM's cohere/ provider posts here by default)."""
        return await self._rerank(request)

    @bentoml.api(route="/rerank")
    async def rerank(self, request: RerankRequest, /) -> Any:
        """The same as /v1/rerank (TEI's and vLLM's path)."""
        return await self._rerank(request)

    @bentoml.api(route="/model")
    async def model_info(self) -> ModelInfo:
        """The model being served: registered name, version, alias, run id, headline metrics, max length."""
        return ModelInfo(**self.holder.current.describe(), poll_seconds=SETTINGS.poll_seconds,
                         last_reload_check=self.holder.last_check, last_reload_error=self.holder.last_error)

    @bentoml.api(route="/report")
    async def report(self) -> dict[str, Any]:
        """The served version's OOD evaluation report (report.json; layout in docs/report-schema.md)."""
        model = self.holder.current
        if model.report is None:
            return JSONResponse({"error": f"no report for {model.resolved}: {model.report_error}"}, status_code=404)
        return model.report

    @bentoml.api(route="/reload")
    async def reload(self) -> ReloadResponse:
        """Check the model URI now and load the version it names if that changed (needs the API key)."""
        if SETTINGS.api_key is None:
            return JSONResponse({"error": "reload needs an API key: start the service with ANCHOR_RM_API_KEY set"},
                                status_code=403)
        result = await anyio.to_thread.run_sync(self.holder.refresh)  # not the scoring thread: keep serving
        return ReloadResponse(**result.to_dict())


# Starlette runs the first middleware added outermost: the guard (key, body size, 503 while loading) sees
# every request before the GET routes do.
RewardService.add_asgi_middleware(
    guard.ApiGuard, api_key=SETTINGS.api_key, max_body_bytes=SETTINGS.max_body_bytes, not_ready=_not_ready,
    model_paths=MODEL_PATHS,
)
RewardService.add_asgi_middleware(GetRoutes, routes={"/v1/models": _models})
