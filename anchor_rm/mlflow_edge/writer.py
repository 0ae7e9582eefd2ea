"""The metric writer a Ray trial's rank-0 worker logs through: batched (a remote tracking server sees few
requests), tolerant of a tracking outage while training goes on, and loud when an outage outlasts what is
allowed. Every value is delivered exactly once or the trial fails naming what was not delivered."""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

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


@contextmanager
def _one_bounded_attempt():
    """MLflow's REST client reads its retry count and timeout from the environment on every request."""
    names = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(ATTEMPT_TIMEOUT_S)})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class BufferedRunWriter:
    """Rank 0's writer to the trial's run: batched, so a remote tracking server sees few requests.

    The server may be unreachable for a while. Each attempt to send is one request of at most
    ATTEMPT_TIMEOUT_S (MLflow's own retries are off for it), so a flush never holds training for long. A
    batch the server did not take stays pending, at most `max_pending` values, and is sent again after a
    backoff while training goes on. Before each checkpoint `deliver` insists: it retries for up to
    `outage_seconds` (OUTAGE_ENV, default 600) and then raises TrackingUnavailable,
    naming the run and how many values are undelivered. The trial then fails loudly (Ray Train retries it
    from its last checkpoint; Tune marks its run FAILED) instead of checkpointing past metrics that never
    arrived: no value is dropped silently.
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
        self.next_attempt = 0.0  # time.monotonic() before which add() does not try again
        self.last_error = ""

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        """The metric sink interface (training.MetricSink)."""
        self.add(metrics, 0 if step is None else step)

    def add(self, metrics: dict[str, float], step: int) -> None:
        if self.client is None:
            return
        now = int(time.time() * 1000)
        self.pending += [Metric(key, float(value), now, step) for key, value in metrics.items()]
        if len(self.pending) >= self.max_pending:
            self.deliver()  # the buffer is full: wait for the server (or fail) rather than drop values
        elif len(self.pending) >= self.FLUSH_AT and time.monotonic() >= self.next_attempt:
            self.flush()

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
                self.last_error = str(exc).splitlines()[0][:300]
                delay = min(60.0, 2.0 ** self.failures)
                self.next_attempt = time.monotonic() + delay
                log.warning("MLflow run %s: %d metric values not delivered yet (%s); next attempt in %.0f s",
                            self.run_id, len(self.pending), self.last_error, delay)
                return False
            del self.pending[: len(batch)]
        self.failures, self.next_attempt = 0, 0.0
        return True

    # While deliver insists (training waits anyway), it tries at least this often: a server back after a long
    # outage is found within seconds, not after add()'s backoff of up to a minute.
    DELIVER_RETRY_S = 5.0

    def deliver(self) -> None:
        """Send everything pending, retrying for up to outage_seconds; raise if that fails."""
        deadline = time.monotonic() + self.outage_seconds
        while not self.flush():
            if time.monotonic() >= deadline:
                raise TrackingUnavailable(
                    f"MLflow tracking server {self.tracking_uri} unreachable for over {self.outage_seconds:.0f} s: "
                    f"{len(self.pending)} metric values of run {self.run_id} not delivered ({self.last_error})")
            wake = min(self.next_attempt, time.monotonic() + self.DELIVER_RETRY_S, deadline)
            time.sleep(max(0.0, wake - time.monotonic()))
