"""Progress lines for anything that can run long: reading and splitting a large source, tokenising, training
(steps), scoring (responses).

A stage counts what it has done with `Progress.update`; a line goes to the `anchor_rm` log every `every_s`
seconds (default: $ANCHOR_RM_PROGRESS_SECONDS, else 10), and `Progress.close` writes the stage's total. With a
`total`, a line also gives the share done, the rate and the time left:

    training: 40/120 steps (33%), 5.3 pairs/s, about 2 min 10 s left; epoch 1/3, loss 0.6120

A stage that ends within `every_s` writes nothing but its closing line (or nothing at all with quiet_when_quick),
so small runs stay readable. Lines, not a redrawn bar: they read the same on a terminal, in a log file and in
a Ray worker's output.
"""

from __future__ import annotations

import logging
import math
import os
import time

log = logging.getLogger("anchor_rm")

INTERVAL_VARIABLE = "ANCHOR_RM_PROGRESS_SECONDS"


def default_interval() -> float:
    """$ANCHOR_RM_PROGRESS_SECONDS (seconds between progress lines), else 10."""
    raw = os.environ.get(INTERVAL_VARIABLE, "").strip()
    if not raw:
        return 10.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"${INTERVAL_VARIABLE}={raw!r}: not a number of seconds >= 0")
    return value


def duration(seconds: float) -> str:
    """12 s, 3 min 5 s, 2 h 10 min."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


class Progress:
    def __init__(self, stage: str, unit: str = "pairs", every_s: float | None = None, quiet_when_quick: bool = False,
                 total: int | None = None, rate_unit: str | None = None):
        self.stage, self.unit, self.quiet_when_quick, self.total = stage, unit, quiet_when_quick, total
        self.every_s = default_interval() if every_s is None else every_s
        self.rate_unit = rate_unit or unit  # training counts steps but reports pairs/s
        self.count = 0
        self.rated = 0  # what the rate counts (rate_unit), when it differs from count
        self.started = self.last = time.monotonic()
        self.lines = 0  # progress lines written so far

    def update(self, n: int = 1, *, rated: int | None = None, note: str = "") -> None:
        """`n` more done (`rated` more of rate_unit, default n); `note` ends the line when one is written."""
        self.count += n
        self.rated += n if rated is None else rated
        now = time.monotonic()
        if now - self.last < self.every_s:
            return
        self.last = now
        self.lines += 1
        elapsed = now - self.started
        if self.total:
            rate = self.rated / elapsed if elapsed > 0 else 0.0
            left = elapsed * (self.total - self.count) / self.count if self.count else math.nan
            eta = f", about {duration(left)} left" if math.isfinite(left) and self.count < self.total else ""
            log.info("%s: %s/%s %s (%.0f%%), %.1f %s/s%s%s", self.stage, f"{self.count:,}", f"{self.total:,}",
                     self.unit, 100 * self.count / self.total, rate, self.rate_unit, eta, f"; {note}" if note else "")
        else:
            log.info("%s: %s %s so far (%.0f s)%s", self.stage, f"{self.count:,}", self.unit, elapsed,
                     f"; {note}" if note else "")

    def close(self, summary: str = "") -> float:
        """Writes the total (and `summary`); returns the stage's seconds."""
        seconds = time.monotonic() - self.started
        if not (self.quiet_when_quick and self.lines == 0):
            log.info("%s: %s %s in %.1f s%s", self.stage, f"{self.count:,}", self.unit, seconds,
                     f"; {summary}" if summary else "")
        return seconds
