"""A small client for the reward service (service/service.py), sync and async, and a TRL reward function
built on it.

    from anchor_rm.client import RewardClient
    client = RewardClient("http://127.0.0.1:3000", api_key="...")
    client.score([("How do I boil an egg?", "Boil it for 8 to 10 minutes.")])   # -> [rewards]
    client.score_details(pairs)   # -> Scores: rewards, ood_score, in_domain, truncated, model
    client.best_of_n("How do I boil an egg?", ["Microwave it.", "Boil it."])    # -> BestOfN
    client.compare(prompt, response_a, response_b)                                # -> P(a preferred)

    from anchor_rm.client import TRLRewardFunction
    GRPOTrainer(..., reward_funcs=TRLRewardFunction(client))
    TRLRewardFunction(client, on_scores=lambda s: log({"rm/in_domain": mean(s.in_domain)}))  # the OOD flag

Retries: a 503 (the model is loading, or the service is overloaded; its Retry-After is honoured, within
`max_backoff`), a connection error and a timeout (httpx's TransportError: scoring is safe to repeat) are tried
again, up to `retries` times with exponential backoff. Any other status is final: a 4xx will not change on a
retry, and its message names the field and the limit.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import httpx

from anchor_rm.model.scoring import conversation_to_pair, message_text

RETRY_STATUSES = frozenset({503})


class RewardServiceError(RuntimeError):
    """The service refused the request (4xx or 5xx other than a retried 503), or stayed unavailable."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class BestOfN:
    rewards: list[float]
    ranking: list[int]  # candidate indices, best first
    best_index: int
    model: dict  # {"name", "version"} of the model that scored
    # The OOD flag per candidate (anchor_rm/model/ood_flag.py); None entries where the service serves without one.
    ood_score: list[float | None] | None = None
    in_domain: list[bool | None] | None = None


@dataclass(frozen=True)
class Scores:
    """/score's whole answer: per pair the reward, the OOD flag (ood_score, and in_domain: false where the pair
    is unlike the model's training data; None where the service serves without a flag) and whether it was
    truncated, and the version that scored."""

    rewards: list[float]
    ood_score: list[float | None]
    in_domain: list[bool | None]
    truncated: list[bool]
    model: dict


def _scores(answer: dict) -> Scores:
    n = len(answer["rewards"])
    return Scores(answer["rewards"], answer.get("ood_score", [None] * n), answer.get("in_domain", [None] * n),
                  answer["truncated"], answer["model"])


def _best_of_n(answer: dict) -> BestOfN:
    return BestOfN(answer["rewards"], answer["ranking"], answer["best_index"], answer["model"],
                   answer.get("ood_score"), answer.get("in_domain"))


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _delay(attempt: int, response: httpx.Response | None, backoff: float, max_backoff: float) -> float:
    """The server's Retry-After when it sent a usable one (seconds, clamped to 0..max_backoff: a negative, NaN or
    HTTP-date value falls back to backoff), else exponential backoff; plus up to 10% jitter, so that clients
    refused together do not all come back in the same instant."""
    delay = min(max_backoff, backoff * 2 ** attempt)
    if response is not None:
        try:
            asked = float(response.headers.get("retry-after", ""))
        except ValueError:
            asked = math.nan
        if math.isfinite(asked):
            delay = min(max_backoff, max(0.0, asked))
    return delay * (1.0 + 0.1 * random.random())


def _retry_delay(path: str, attempt: int, retries: int, response: httpx.Response | None, error: Exception | None,
                 backoff: float, max_backoff: float) -> float | None:
    """Seconds to wait before the next attempt; None when this attempt's response is the answer (or the
    final error, which _answer raises). A connection error on the last attempt raises here."""
    if error is not None:
        if attempt == retries:
            raise RewardServiceError(f"POST {path}: {type(error).__name__}: {error}") from error
        return _delay(attempt, None, backoff, max_backoff)
    if response.status_code not in RETRY_STATUSES or attempt == retries:
        return None
    return _delay(attempt, response, backoff, max_backoff)


def _answer(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            detail = response.json().get("error", response.text)
        except ValueError:
            detail = response.text
        raise RewardServiceError(f"{response.request.method} {response.request.url.path}: HTTP {response.status_code}: "
                                 f"{str(detail)[:500]}", response.status_code)
    return response.json()


def _pairs_body(pairs: Sequence[tuple[str, str]]) -> dict:
    return {"items": [{"prompt": p, "response": r} for p, r in pairs]}


class RewardClient:
    """Synchronous client. `timeout` is per attempt, in seconds."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 60.0, retries: int = 5,
                 backoff: float = 0.5, max_backoff: float = 30.0):
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self._http = httpx.Client(base_url=url, headers=_headers(api_key), timeout=timeout)

    def _post(self, path: str, body: dict) -> Any:
        for attempt in range(self.retries + 1):
            response, error = None, None
            try:
                response = self._http.post(path, json=body)
            except httpx.TransportError as exc:
                error = exc
            delay = _retry_delay(path, attempt, self.retries, response, error, self.backoff, self.max_backoff)
            if delay is None:
                return _answer(response)
            time.sleep(delay)

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """One reward per (prompt, response) pair, in order."""
        return self._post("/score", _pairs_body(pairs))["rewards"]

    def score_details(self, pairs: Sequence[tuple[str, str]]) -> Scores:
        """Rewards with the OOD flag, truncation and the scoring version, one entry per pair."""
        return _scores(self._post("/score", _pairs_body(pairs)))

    def best_of_n(self, prompt: str, candidates: Sequence[str]) -> BestOfN:
        return _best_of_n(self._post("/best_of_n", {"prompt": prompt, "candidates": list(candidates)}))

    def compare(self, prompt: str, response_a: str, response_b: str) -> float:
        """P(response_a preferred over response_b)."""
        return self._post("/compare", {"prompt": prompt, "response_a": response_a,
                                       "response_b": response_b})["p_a_preferred"]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "RewardClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncRewardClient:
    """The same as RewardClient, for asyncio."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 60.0, retries: int = 5,
                 backoff: float = 0.5, max_backoff: float = 30.0):
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self._http = httpx.AsyncClient(base_url=url, headers=_headers(api_key), timeout=timeout)

    async def _post(self, path: str, body: dict) -> Any:
        for attempt in range(self.retries + 1):
            response, error = None, None
            try:
                response = await self._http.post(path, json=body)
            except httpx.TransportError as exc:
                error = exc
            delay = _retry_delay(path, attempt, self.retries, response, error, self.backoff, self.max_backoff)
            if delay is None:
                return _answer(response)
            await asyncio.sleep(delay)

    async def score(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        return (await self._post("/score", _pairs_body(pairs)))["rewards"]

    async def score_details(self, pairs: Sequence[tuple[str, str]]) -> Scores:
        return _scores(await self._post("/score", _pairs_body(pairs)))

    async def best_of_n(self, prompt: str, candidates: Sequence[str]) -> BestOfN:
        return _best_of_n(await self._post("/best_of_n", {"prompt": prompt, "candidates": list(candidates)}))

    async def compare(self, prompt: str, response_a: str, response_b: str) -> float:
        return (await self._post("/compare", {"prompt": prompt, "response_a": response_a,
                                              "response_b": response_b}))["p_a_preferred"]

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncRewardClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class TRLRewardFunction:
    """A `reward_funcs` entry for TRL's GRPOTrainer (and any trainer that calls reward functions as
    `f(prompts=..., completions=..., **columns) -> list[float]`), scoring through the service.

    Plain text: each (prompt, completion) is one pair. Conversational data (lists of {"role", "content"}
    messages): the prompt's messages plus the completion's assistant message are turned into a pair as
    the service's /classify does (anchor_rm.model.scoring.conversation_to_pair).

    The OOD flag comes through `on_scores`, called once per call with the `Scores` of every completion (rewards,
    ood_score, in_domain, ...), and `last_scores`: e.g. log the share of completions the reward model calls
    out of domain, and watch it grow as the policy drifts from what the reward model knows."""

    def __init__(self, client: RewardClient, batch_size: int = 64, on_scores: Callable[[Scores], None] | None = None):
        self.client = client
        self.batch_size = batch_size
        self.on_scores = on_scores
        self.last_scores: Scores | None = None
        self.__name__ = "anchor_rm_reward"  # TRL names the reward's logged metrics after the function

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **_columns) -> list[float]:
        pairs = [_pair(p, c) for p, c in zip(prompts, completions)]
        parts = [self.client.score_details(pairs[start:start + self.batch_size])
                 for start in range(0, len(pairs), self.batch_size)]
        self.last_scores = Scores([r for p in parts for r in p.rewards], [s for p in parts for s in p.ood_score],
                                  [d for p in parts for d in p.in_domain], [t for p in parts for t in p.truncated],
                                  parts[-1].model if parts else {})
        if self.on_scores is not None:
            self.on_scores(self.last_scores)
        return self.last_scores.rewards


def _pair(prompt: Any, completion: Any) -> tuple[str, str]:
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt, completion
    if isinstance(completion, list):  # conversational: the completion is [{"role": "assistant", ...}]
        response = "".join(message_text(m.get("content", "")) for m in completion)
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        return conversation_to_pair([*messages, {"role": "assistant", "content": response}])
    raise TypeError(f"prompts and completions must be text or message lists, got {type(prompt).__name__} and "
                    f"{type(completion).__name__}")
