"""How busy the whole machine was while a command ran (not a test): the share of all cores' time that was not
idle, from /proc/stat every 10 s, overall and per 5-minute window. It counts every process, the Ray daemons
and servers a test suite starts included, which `/usr/bin/time` (only the processes it waits for) does not.

    CI=true .venv/bin/python bench/cpu_busy.py -- bash .ci/run      # in a fresh clone

Near 1.0 for a whole suite run means the suite is CPU-bound: only less work, or less wasted work, makes it
faster, not more parallelism.
"""

from __future__ import annotations

import subprocess
import sys
import time

INTERVAL_S = 10
WINDOW_S = 300


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over all cores since boot."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal, sum(fields)


def main() -> int:
    command = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    if not command:
        print(f"cpu_busy.py: no command to run; give one after --\n{__doc__}", file=sys.stderr)
        return 2
    samples = [(time.time(), *cpu_jiffies())]
    try:
        proc = subprocess.Popen(command)
    except OSError as exc:
        print(f"cpu_busy.py: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 2
    while proc.poll() is None:
        time.sleep(INTERVAL_S)
        samples.append((time.time(), *cpu_jiffies()))
    samples.append((time.time(), *cpu_jiffies()))
    start = samples[0][0]
    print(f"\n{' '.join(command)}: exit {proc.returncode}, {(samples[-1][0] - start) / 60:.1f} min")
    window_start = samples[0]
    for sample in samples[1:]:
        if sample[0] - window_start[0] >= WINDOW_S or sample is samples[-1]:
            busy = (sample[1] - window_start[1]) / max(1, sample[2] - window_start[2])
            print(f"  {(window_start[0] - start) / 60:5.1f} min on: {busy:.2f} of all cores busy")
            window_start = sample
    overall = (samples[-1][1] - samples[0][1]) / max(1, samples[-1][2] - samples[0][2])
    print(f"overall: {overall:.2f} of all cores busy")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
