"""Scoring requests that arrive together in one forward pass: the service's batcher (plain asyncio).

One batch is scored at a time, in one dedicated thread, so the event loop keeps accepting requests. Always
the same thread: torch's OpenMP pool belongs to the thread that runs an operation, and every long-lived
thread that has run one keeps its pool; on a small machine, scoring beside another thread's pool was about
2x slower (docs/benchmarks.md, *Service*). While a batch is being scored, the requests that arrive queue;
when it is done, the queued requests go together into the next batch, whole, up to `max_batch_size` pairs
(a larger request goes alone). There is no timer: an idle model scores a lone request at once, so one
client pays no batching delay, and under load batches grow to what arrived during the previous one. A
request is never split, so all its rewards come from one model version even while a reload swaps the model.

A request that waited longer than `max_wait_seconds` before its batch began gets `QueueTimeout` (the
service answers 503): under overload, clients learn it rather than waiting on a queue that only grows.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Generic, Sequence, TypeVar

Result = TypeVar("Result")

# score(prompts, responses) -> (per-pair columns..., what scored them): each column (rewards, truncated flags,
# the service's OOD flag) has one entry per pair and each request gets its slice of every column; the last
# value (the model's reference) is handed to every request of the batch.
ScoreFunction = Callable[[list[str], list[str]], tuple]


class QueueTimeout(RuntimeError):
    """A request waited longer than the batcher's limit before its batch began."""


@dataclass
class BatchStats:
    batches: int = 0
    pairs: int = 0
    requests: int = 0
    timed_out: int = 0
    largest_batch: int = 0


@dataclass
class _Job:
    prompts: list[str]
    responses: list[str]
    future: asyncio.Future
    queued_at: float = field(default_factory=time.monotonic)


class ScoreBatcher(Generic[Result]):
    def __init__(self, score: ScoreFunction, *, max_batch_size: int = 32, batching: bool = True,
                 max_wait_seconds: float = 60.0,
                 on_batch: Callable[[int, int], None] | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: expected at least 1")
        self._score = score
        self.max_batch_size = max_batch_size
        self.batching = batching  # False: one request per batch, in arrival order
        self.max_wait_seconds = max_wait_seconds
        self._on_batch = on_batch  # (requests, pairs) after each batch: for the service's metrics
        self._queue: deque[_Job] = deque()
        self._worker: asyncio.Task | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="anchor-rm-score")
        self.stats = BatchStats()

    def close(self) -> None:
        """Stop the scoring thread once the batch in hand is done."""
        self._thread.shutdown(wait=True, cancel_futures=True)

    async def score(self, prompts: Sequence[str], responses: Sequence[str]) -> tuple:
        """(each column's entries for these pairs (rewards, truncated flags, ...), what scored them); waits for
        its batch."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        loop = asyncio.get_running_loop()
        job = _Job(list(prompts), list(responses), loop.create_future())
        self._queue.append(job)
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        return await job.future

    @property
    def queued(self) -> int:
        return len(self._queue)

    def _next_batch(self) -> list[_Job]:
        jobs: list[_Job] = []
        size = 0
        now = time.monotonic()
        while self._queue:
            job = self._queue[0]
            if job.future.done():  # its client went away (cancelled): nothing to score
                self._queue.popleft()
                continue
            if now - job.queued_at > self.max_wait_seconds:
                self._queue.popleft()
                self.stats.timed_out += 1
                job.future.set_exception(QueueTimeout(
                    f"waited {now - job.queued_at:.1f} s for the model, more than the limit of "
                    f"{self.max_wait_seconds:g} s: the service is overloaded; retry later"))
                continue
            if jobs and (not self.batching or size + len(job.prompts) > self.max_batch_size):
                break
            jobs.append(self._queue.popleft())
            size += len(job.prompts)
        return jobs

    async def _drain(self) -> None:
        while True:
            jobs = self._next_batch()
            if not jobs:
                return
            prompts = [p for job in jobs for p in job.prompts]
            responses = [r for job in jobs for r in job.responses]
            try:
                *columns, scored_by = await asyncio.get_running_loop().run_in_executor(
                    self._thread, self._score, prompts, responses)
            except Exception as exc:  # every request of the batch gets the error; the batcher goes on
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            self.stats.batches += 1
            self.stats.requests += len(jobs)
            self.stats.pairs += len(prompts)
            self.stats.largest_batch = max(self.stats.largest_batch, len(prompts))
            if self._on_batch is not None:
                self._on_batch(len(jobs), len(prompts))
            start = 0
            for job in jobs:
                end = start + len(job.prompts)
                if not job.future.done():
                    job.future.set_result((*[list(column[start:end]) for column in columns], scored_by))
                start = end
