"""The reward-scoring HTTP service (BentoML 1.4):

    bentoml serve service.service:RewardService --timeout-keep-alive 75 --host 127.0.0.1 --port 3000

(75 s keep-alive: see service/config.py, `serve_command`.)

It serves the model ANCHOR_RM_MODEL_URI names (default models:/anchor-rm-helpful@champion) with that
version's report, and follows the alias when it moves. Settings: service/config.py. The logic lives in
anchor_rm/serving.py; this file is the BentoML wiring.

Public endpoints validate a request, then score its pairs through `score_batch`, a batchable method they call
through the server itself (BentoML's self proxy), so that pairs of concurrent requests share adaptive batches.
That route answers only calls carrying this process's internal token.
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import anyio.to_thread
import bentoml
from bentoml.exceptions import ServiceUnavailable
from pydantic import BaseModel
from starlette.responses import JSONResponse

from anchor_rm import serving
from anchor_rm.serving import (BestOfNRequest, BestOfNResponse, CompareRequest, CompareResponse, GetRewardRequest,
                               GetRewardResponse, ModelInfo, ModelRef, ReloadResponse, RequestError, ScoreRequest,
                               ScoreResponse)
from service.config import load_settings

logger = logging.getLogger("anchor_rm.service")
SETTINGS = load_settings()
BATCH_ROUTE = "/internal/score_batch"
INTERNAL_TOKEN = secrets.token_urlsafe(32)  # per process: the guard and the self proxy live in the same worker


class ScorePair(BaseModel):
    prompt: str
    response: str


class ScoredPair(BaseModel):
    reward: float
    truncated: bool
    name: str  # the model that scored it
    version: str | None


def _bad_request(exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=400)


@bentoml.service(
    name="anchor_rm_reward",
    http={"host": SETTINGS.host, "port": SETTINGS.port},
    traffic={"timeout": SETTINGS.timeout_seconds},
    workers=1,
)
class RewardService:
    def __init__(self) -> None:
        serving.configure_mlflow()
        self._own_root = not SETTINGS.download_dir
        self._root = Path(SETTINGS.download_dir) if SETTINGS.download_dir else serving.default_download_root()
        self.limits = SETTINGS.limits()
        self.holder = serving.ModelHolder(SETTINGS.model_uri, self._root,
                                          loader=functools.partial(serving.load_served_model, precision=SETTINGS.precision))
        self.holder.load()
        self.holder.start_polling(SETTINGS.poll_seconds)

    @bentoml.on_shutdown
    def _close(self) -> None:
        self.holder.close()
        if self._own_root:
            shutil.rmtree(self._root, ignore_errors=True)

    def __is_ready__(self) -> bool:
        return self.holder.loaded

    @bentoml.api(route=BATCH_ROUTE, batchable=SETTINGS.batching, max_batch_size=max(2, SETTINGS.max_batch_size),
                 max_latency_ms=SETTINGS.max_latency_ms)
    def score_batch(self, pairs: list[ScorePair]) -> list[ScoredPair]:
        """Internal: the batched scoring method behind every scoring endpoint (refuses outside callers)."""
        model = self.holder.current  # one model object for the whole batch, even if a reload swaps meanwhile
        scored = model.score([p.prompt for p in pairs], [p.response for p in pairs])
        ref = model.ref
        return [ScoredPair(reward=float(r), truncated=bool(t), name=ref.name, version=ref.version)
                for r, t in zip(scored.rewards, scored.truncated)]

    def _internal_client(self):
        client = self.to_async  # set by BentoML when serving: the service's client to itself
        # Its sessions are built from this dict: every internal call carries the token.
        client.default_headers[serving.INTERNAL_HEADER] = INTERNAL_TOKEN
        manager = getattr(client, "_session_manager", None)
        if manager is not None:
            # BentoML >= 1.4.30 replaces the client session every 100 calls or 5 minutes and closes the old one
            # under the calls still in flight on it (bentoml/BentoML#5540): under concurrency those fail. Keep one.
            manager.max_requests = manager.max_age = math.inf
        return client

    @staticmethod
    async def _call_batch(client, pairs: list[ScorePair]) -> list:
        """The internal call, retried on a dropped in-process connection (scoring is idempotent)."""
        for attempt in range(3):
            try:
                return await client.score_batch(pairs)
            except aiohttp.ClientConnectionError:
                if attempt == 2:
                    raise
                logger.warning("internal scoring call lost its connection; retrying")
        raise AssertionError("unreachable")

    async def _score(self, prompts: list[str], responses: list[str]) -> tuple[list[float], list[bool], ModelRef]:
        """Score through the batching path; every reward of one response comes from one model version (a
        request split across batches while the alias moved is scored again)."""
        client = self._internal_client()
        pairs = [ScorePair(prompt=p, response=r) for p, r in zip(prompts, responses)]
        for _ in range(3):
            out = [o if isinstance(o, ScoredPair) else ScoredPair.model_validate(o)
                   for o in await self._call_batch(client, pairs)]
            versions = {(o.name, o.version) for o in out}
            if len(versions) == 1:
                name, version = versions.pop()
                return [o.reward for o in out], [o.truncated for o in out], ModelRef(name=name, version=version)
        raise ServiceUnavailable("the model changed while scoring this request; retry")

    @bentoml.api(route="/score")
    async def score(self, request: ScoreRequest, /) -> ScoreResponse:
        """Rewards for prompt-response pairs: {"items": [{"prompt": ..., "response": ...}, ...]}."""
        prompts = [item.prompt for item in request.items]
        responses = [item.response for item in request.items]
        try:
            serving.check_pairs(prompts, responses, self.limits)
        except RequestError as exc:
            return _bad_request(exc)
        rewards, truncated, ref = await self._score(prompts, responses)
        return ScoreResponse(rewards=rewards, truncated=truncated, model=ref)

    @bentoml.api(route="/best_of_n")
    async def best_of_n(self, request: BestOfNRequest, /) -> BestOfNResponse:
        """Rank candidate responses to one prompt: rewards, the ranking (best first) and the best index."""
        try:
            serving.check_best_of_n(request.prompt, request.candidates, self.limits)
        except RequestError as exc:
            return _bad_request(exc)
        rewards, truncated, ref = await self._score([request.prompt] * len(request.candidates), request.candidates)
        ranking = serving.rank(rewards)
        return BestOfNResponse(rewards=rewards, ranking=ranking, best_index=ranking[0], truncated=truncated, model=ref)

    @bentoml.api(route="/compare")
    async def compare(self, request: CompareRequest, /) -> CompareResponse:
        """P(response_a preferred over response_b) = sigmoid(r_a - r_b), with both rewards."""
        try:
            serving.check_compare(request.prompt, request.response_a, request.response_b, self.limits)
        except RequestError as exc:
            return _bad_request(exc)
        (r_a, r_b), (t_a, t_b), ref = await self._score([request.prompt] * 2, [request.response_a, request.response_b])
        return CompareResponse(p_a_preferred=serving.preference_probability(r_a, r_b), reward_a=r_a, reward_b=r_b,
                               truncated_a=t_a, truncated_b=t_b, model=ref)

    @bentoml.api(route="/get_reward")
    async def get_reward(self, request: GetRewardRequest, /) -> GetRewardResponse:
        """OpenRLHF's remote reward model: {"query": [...], "prompts": [...], "labels": [...]} ->
        {"rewards": [...], "scores": [...], "extra_logs": {...}}. Point --remote_rm_url at this route."""
        try:
            split = serving.split_queries(request.query, request.prompts, self.limits, request.labels)
        except RequestError as exc:
            return _bad_request(exc)
        rewards, truncated, ref = await self._score(split.prompts, split.responses)
        logs = {"truncated": [float(t) for t in truncated], "prompt_found": [float(f) for f in split.prompt_found]}
        return GetRewardResponse(rewards=rewards, scores=rewards, extra_logs=logs, model=ref)

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


RewardService.add_asgi_middleware(
    serving.ApiGuard, api_key=SETTINGS.api_key, internal_token=INTERNAL_TOKEN, internal_paths=(BATCH_ROUTE,),
    max_body_bytes=SETTINGS.max_body_bytes,
)
