"""The metric writer a Ray trial's rank-0 worker logs through: batched (a remote tracking server sees few
requests), tolerant of a tracking outage while training goes on, and loud when an outage outlasts what is
allowed. Every value is delivered exactly once or the trial fails naming what was not delivered."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from mlflow.entities import Metric

from anchor_rm.mlflow_edge import store

log = logging.getLogger("anchor_rm")


class TrackingUnavailable(RuntimeError):
    """Metric values could not be delivered to the tracking server within the allowed outage."""


OUTAGE_ENV = "ANCHOR_RM_MLFLOW_OUTAGE_SECONDS"


def outage_seconds_from_env(environ=os.environ) -> float:
    """How long a trial waits for an unreachable tracking server before it fails (default 600 s)."""
    raw = environ.get(OUTAGE_ENV, "600")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{OUTAGE_ENV} must be a number of seconds above 0, not {raw!r}")
    return seconds


# One attempt to send a batch: no retries inside MLflow's client (by default 7, with backoff: minutes) and
# at most this long waiting for the server, so that a flush during an outage holds training for seconds at
# most. The writer retries on its own schedule instead (2, 4, ... 60 s, training going on meanwhile).
ATTEMPT_TIMEOUT_S = 5


def _one_bounded_attempt():
    return store.bounded_requests(0, ATTEMPT_TIMEOUT_S)


PENDING_FILE = "pending_metrics.json"  # in a checkpoint: the values the server had not taken yet


class BufferedRunWriter:
    """Rank 0's writer to the trial's run: batched, so a remote tracking server sees few requests.

    The server may be unreachable for a while; training does not wait for it. Each attempt to send is one
    request of at most ATTEMPT_TIMEOUT_S (MLflow's own retries are off for it), made only when `max_pending`
    values or FLUSH_AT values are waiting or a checkpoint is being written, and after a failed attempt not
    again before a backoff (2, 4, ... 60 s). Values the server has not taken stay pending, and `checkpoint`
    writes them into the checkpoint folder: a worker restarted from it sends them again (`restore`), and MLflow's
    SQL store keeps one copy of a value sent twice (same key, value, step and timestamp), so each value arrives
    once. Two limits make an outage loud instead of silent: a checkpoint after the server has been unreachable
    for over `outage_seconds` (OUTAGE_ENV, default 600), and `deliver` at the end of training, which insists
    for up to that long, raise TrackingUnavailable naming the run and how many values are undelivered (Ray
    Train retries the trial from its last checkpoint; Tune marks its run FAILED). `blocked_s` is the time the
    training thread spent in attempts to send (deliver at the end excluded).
    """

    BATCH_LIMIT = 1000  # MLflow's log_batch limit
    FLUSH_AT = 200

    def __init__(self, tracking_uri: str, run_id: str, active: bool, outage_seconds: float | None = None,
                 max_pending: int = 100_000):
        self.client = store.client(tracking_uri) if active else None
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.pending = []
        self.outage_seconds = outage_seconds_from_env() if outage_seconds is None else outage_seconds
        self.max_pending = max_pending
        self.failures = 0  # consecutive failed attempts
        self.failing_since: float | None = None  # time.monotonic() of the first of them
        self.next_attempt = 0.0  # time.monotonic() before which add() does not try again
        self.last_error = ""
        self.blocked_s = 0.0

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        """The metric sink interface (training.MetricSink)."""
        self.add(metrics, 0 if step is None else step)

    def add(self, metrics: dict[str, float], step: int) -> None:
        if self.client is None:
            return
        now = int(time.time() * 1000)
        self.pending += [Metric(key, float(value), now, step) for key, value in metrics.items()]
        if len(self.pending) >= self.max_pending:  # the buffer is full: wait for the server (or fail), not drop
            started = time.monotonic()
            self.deliver()
            self.blocked_s += time.monotonic() - started
        elif len(self.pending) >= self.FLUSH_AT and time.monotonic() >= self.next_attempt:
            self._timed_flush()

    def _timed_flush(self) -> bool:
        started = time.monotonic()
        try:
            return self.flush()
        finally:
            self.blocked_s += time.monotonic() - started

    def flush(self) -> bool:
        """One attempt to send everything pending. A batch the server did not take stays pending (and the
        next attempt waits 2, 4, ... 60 s); returns whether nothing is pending any more."""
        while self.client is not None and self.pending:
            batch = self.pending[: self.BATCH_LIMIT]
            try:
                with _one_bounded_attempt():
                    self.client.log_batch(self.run_id, metrics=batch)
            except store.TrackingError as exc:
                status = exc.get_http_status_code()
                if 400 <= status < 500 and status != 429:  # the request itself is wrong: retrying cannot help
                    raise
                self.failures += 1
                self.failing_since = self.failing_since or time.monotonic()
                self.last_error = str(exc).splitlines()[0][:300]
                delay = min(60.0, 2.0 ** self.failures)
                self.next_attempt = time.monotonic() + delay
                log.warning("MLflow run %s: %d metric values not delivered yet (%s); next attempt in %.0f s",
                            self.run_id, len(self.pending), self.last_error, delay)
                return False
            del self.pending[: len(batch)]
        self.failures, self.failing_since, self.next_attempt = 0, None, 0.0
        return True

    def _unavailable(self, waited_s: float) -> TrackingUnavailable:
        return TrackingUnavailable(
            f"MLflow tracking server {self.tracking_uri} unreachable for over {waited_s:.0f} s (limit "
            f"{self.outage_seconds:.0f} s, {OUTAGE_ENV}): {len(self.pending)} metric values of run {self.run_id} "
            f"not delivered ({self.last_error})")

    def checkpoint(self, folder: str | Path) -> None:
        """Before a checkpoint of `folder`: one attempt to send (unless backing off), and what is still pending
        written into the folder; training goes on. Raises TrackingUnavailable once the server has been
        unreachable for longer than outage_seconds."""
        if self.client is None:
            return
        if self.pending and time.monotonic() >= self.next_attempt:
            self._timed_flush()
        if not self.pending:
            return
        down_s = time.monotonic() - (self.failing_since or time.monotonic())
        if down_s > self.outage_seconds:
            raise self._unavailable(down_s)
        rows = [[m.key, m.value, m.timestamp, m.step] for m in self.pending]
        (Path(folder) / PENDING_FILE).write_text(json.dumps({"run_id": self.run_id, "metrics": rows}))

    @staticmethod
    def read_pending(folder: str | Path) -> list:
        """The values a checkpoint holds that had not reached the server when it was written."""
        path = Path(folder) / PENDING_FILE
        if not path.exists():
            return []
        return [Metric(key, value, timestamp, step) for key, value, timestamp, step in json.loads(path.read_text())["metrics"]]

    def restore(self, metrics: list) -> None:
        """Send again, before anything newer, the values a checkpoint held (read_pending)."""
        self.pending[:0] = metrics

    # While deliver insists (training waits anyway), it tries at least this often: a server back after a long
    # outage is found within seconds, not after add()'s backoff of up to a minute.
    DELIVER_RETRY_S = 5.0

    def deliver(self) -> None:
        """Send everything pending, retrying for up to outage_seconds; raise if that fails."""
        started = time.monotonic()
        deadline = started + self.outage_seconds
        while not self.flush():
            if time.monotonic() >= deadline:
                raise self._unavailable(time.monotonic() - started)
            wake = min(self.next_attempt, time.monotonic() + self.DELIVER_RETRY_S, deadline)
            time.sleep(max(0.0, wake - time.monotonic()))
