"""Progress lines for stages that can run long on a large source (reading, cleaning, splitting, tokenising).

A stage counts what it has done with `Progress.update`; a line goes to the `anchor_rm` log every `every_s`
seconds, and `Progress.close` writes the stage's total. A stage that ends within `every_s` writes nothing
but its closing line (or nothing at all with quiet_when_quick), so small runs stay readable.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("anchor_rm")


class Progress:
    def __init__(self, stage: str, unit: str = "pairs", every_s: float = 10.0, quiet_when_quick: bool = False):
        self.stage, self.unit, self.every_s, self.quiet_when_quick = stage, unit, every_s, quiet_when_quick
        self.count = 0
        self.started = self.last = time.monotonic()
        self.lines = 0  # progress lines written so far

    def update(self, n: int = 1) -> None:
        self.count += n
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.lines += 1
            log.info("%s: %s %s so far (%.0f s)", self.stage, f"{self.count:,}", self.unit, now - self.started)

    def close(self, summary: str = "") -> float:
        """Writes the total (and `summary`); returns the stage's seconds."""
        seconds = time.monotonic() - self.started
        if not (self.quiet_when_quick and self.lines == 0):
            log.info("%s: %s %s in %.1f s%s", self.stage, f"{self.count:,}", self.unit, seconds,
                     f"; {summary}" if summary else "")
        return seconds
