"""Small helpers shared by the training and scoring benchmarks (not a library module)."""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def machine() -> str:
    import torch

    from anchor_rm.precision import describe_hardware

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} cores ({describe_hardware('cpu')}), {gpu}, Python {platform.python_version()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def source_splits(source: str, seed: int, max_pairs: dict[str, int]):
    """The source dataset's prompt-disjoint splits (no OOD targets), capped as the presets cap them."""
    from anchor_rm.splits import build_protocol_splits

    return build_protocol_splits(source, [], seed, max_pairs=max_pairs)


def median(values) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def positive_int(text: str) -> int:
    """argparse type: a clear message instead of a traceback for 0, negatives and non-numbers."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _busy_seconds() -> float:
    """CPU seconds all processes on the machine have spent busy since boot (/proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def process_tree(root: int) -> set[int]:
    """`root` and its live descendants (from /proc/<pid>/stat)."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent_of[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parent_of.items() if parent == pid and child not in tree]
        tree.update(children)
        frontier += children
    return tree


def _tree_seconds(root: int) -> float:
    """CPU seconds the live process `root` and its live descendants have spent (/proc/<pid>/stat)."""
    total = 0.0
    for pid in process_tree(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


class Disturbance:
    """How much CPU other processes took while a measurement ran, as a fraction of the machine's capacity
    over that time. The rule the benchmarks state before they run: a repeat with more than
    DISTURBED (10%) is disturbed; it is reported, marked, and left out of the medians.

        with Disturbance() as d:
            ...
        d.fraction, d.disturbed

    `others_than`: running processes (e.g. servers this benchmark started) whose trees count as its own.
    """

    DISTURBED = 0.10

    def __init__(self, others_than: Sequence[int] = ()):
        self._servers = list(others_than)

    def _own(self) -> float:
        return _own_seconds() + sum(_tree_seconds(pid) for pid in self._servers)

    def __enter__(self):
        self._busy, self._own_start, self._wall = _busy_seconds(), self._own(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self._wall
        others = (_busy_seconds() - self._busy) - (self._own() - self._own_start)
        self.fraction = max(0.0, others) / max(wall * (os.cpu_count() or 1), 1e-9)
        self.disturbed = self.fraction > self.DISTURBED
        return False
