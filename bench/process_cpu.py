"""Where a command's CPU went, by kind of process (not a test): every process on the machine is read from
/proc every 2 s while the command runs, and the CPU time each used during the run (user + system; processes
alive before it count only what they used after it started) is summed per kind: a pipeline (tune.py,
train.py ...), a Ray actor (ray::RayTrainWorker ...), a server (mlflow server, bentoml, uvicorn), MLflow's
job processes, a pytest worker. Standard library only, so it can wrap a fresh clone's `.ci/run`:

    CI=true python3 bench/process_cpu.py -- bash .ci/run      # in a fresh clone

A process that starts and ends between two reads is missed, and one that ends counts what it had used at its
last read: the totals are lower bounds, good for comparing kinds and runs, not for adding up to the wall time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict

INTERVAL_S = 2
TICKS = os.sysconf("SC_CLK_TCK")
# The first that occurs in a process's command line names its kind; Ray actors are named by Ray (ray::Name).
KINDS = ("tune.py", "train.py", "study.py", "evaluate.py", "promote.py", "mlflow server", "bentoml", "uvicorn",
         "raylet", "gcs_server", "dashboard", "log_monitor", "ray start", "pytest")


def kind_of(command: str, name: str) -> str:
    if "huey" in command or "mlflow.server.jobs" in command:
        return "MLflow job runner and consumers"
    if "sys.stdin.readline" in command:  # how pytest-xdist starts its workers
        return "pytest worker"
    if command.startswith("ray::"):
        return command.split()[0].split(".")[0]  # ray::RayTrainWorker.run -> ray::RayTrainWorker
    return next((kind for kind in KINDS if kind in command), name)


def read_processes() -> dict[tuple[int, int], tuple[str, str, float]]:
    """{(pid, start time): (command line, name, CPU seconds so far)} for every process that can be read."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2:].split()
        found[(int(pid), int(fields[19]))] = (command, name, (int(fields[11]) + int(fields[12])) / TICKS)
    return found


def main() -> int:
    command = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    if not command:
        print(f"process_cpu.py: no command to run; give one after --\n{__doc__}", file=sys.stderr)
        return 2
    before = {key: cpu for key, (_, _, cpu) in read_processes().items()}
    last: dict[tuple[int, int], tuple[str, str, float]] = {}
    started = time.time()
    try:
        proc = subprocess.Popen(command)
    except OSError as exc:
        print(f"process_cpu.py: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 2
    def read() -> None:
        for key, (line, name, cpu) in read_processes().items():
            if not line and key in last:  # an exited process not yet reaped has no command line: keep the one seen
                line = last[key][0]
            last[key] = (line, name, cpu)

    while proc.poll() is None:
        read()
        time.sleep(INTERVAL_S)
    read()
    wall = time.time() - started
    per_kind: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for key, (line, name, cpu) in last.items():
        used = cpu - before.get(key, 0.0)
        if used > 0 and key[0] != os.getpid():
            per_kind[kind_of(line, name)][0] += used
            per_kind[kind_of(line, name)][1] += 1
    total = sum(cpu for cpu, _ in per_kind.values())
    print(f"\n{' '.join(command)}: exit {proc.returncode}, {wall / 60:.1f} min; CPU seen {total:.0f} s "
          f"({total / wall:.2f} cores on average)")
    print(f"{'CPU s':>7} {'processes':>9}  kind")
    for kind, (cpu, count) in sorted(per_kind.items(), key=lambda item: -item[1][0]):
        if cpu >= 1:
            print(f"{cpu:7.0f} {count:9d}  {kind}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
