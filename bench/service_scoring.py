"""Two choices of the service's scoring path, measured in one process (not a test).

    threads   a short pair scored by `RewardScorer` from the thread that loaded the model, from another
              long-lived thread (the service's scoring thread) while the loading thread lives on, and from
              another thread after the model was loaded in a thread that has ended
              (`service/holder.py: in_fresh_thread`, what the service does). Each variant in a fresh subprocess, since
              which threads have run torch is process state. Median ms over --calls.
    forward   batches of 32 mixed-length HH pairs (as concurrent requests make them), scored with forward
              passes of 32, 16, 8, 4 and 1 length-sorted sequences: pairs/s (ANCHOR_RM_FORWARD_BATCH_SIZE)

MiniLM-L6 with a fresh reward head, max length 192, in the precision `--precision` resolves to.

    .venv/bin/python bench/service_scoring.py                  # about a minute
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_common import ROOT, Disturbance, machine, markdown_table

VARIANTS = {
    "loading thread": "scored on the thread that loaded the model",
    "other thread": "scored on another thread; the loading thread (here: main) lives on",
    "after a fresh loading thread": "loaded in a thread that ended; scored on another thread",
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="threads,forward")
    parser.add_argument("--calls", type=int, default=200, help="threads: timed calls per variant")
    parser.add_argument("--batches", type=int, default=12, help="forward: 32-pair batches per setting")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one threads variant, print its ms
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write the figures as JSON here")
    return parser.parse_args(argv)


def _timed(function, calls: int) -> float:
    for _ in range(10):
        function()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def one_variant(variant: str, folder: str, calls: int, requested: str) -> float:
    from anchor_rm.model.precision import resolve_precision
    from anchor_rm.model.reward_model import load_saved
    from service.holder import in_fresh_thread

    def load():  # resolving the precision runs a matmul: part of loading, on the loading thread
        precision = resolve_precision(requested)
        rm = load_saved(folder)
        rm.scorer(8, precision).score(["warm"], ["up"])  # the loading thread has run a forward pass too
        return rm, precision

    scoring_thread = ThreadPoolExecutor(1)
    rm, precision = in_fresh_thread(load) if variant == "after a fresh loading thread" else load()
    scorer = rm.scorer(8, precision)
    if variant == "loading thread":
        return _timed(lambda: scorer.score(["How do I boil an egg?"], ["Boil it for 8 minutes."]), calls)
    return _timed(lambda: scoring_thread.submit(scorer.score, ["How do I boil an egg?"],
                                                ["Boil it for 8 minutes."]).result(), calls)


def threads(folder: str, calls: int, precision: str) -> list[list[str]]:
    rows = []
    for variant, what in VARIANTS.items():
        with Disturbance() as d:
            done = subprocess.run([sys.executable, __file__, "--one", variant, "--folder", folder, "--calls", str(calls),
                                   "--precision", precision], capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"variant {variant!r} failed:\n{done.stderr[-2000:]}")
        ms = float(done.stdout.strip().splitlines()[-1])
        rows.append([variant, what, f"{ms:.2f}", f"{d.fraction:.0%}" + (" disturbed" if d.disturbed else "")])
        print(f"threads: {variant}: {ms:.2f} ms", flush=True)
    return rows


def forward(folder: str, batches: int, precision: str) -> list[list[str]]:
    from bench_common import load_pairs

    from anchor_rm.model.reward_model import load_saved

    rm = load_saved(folder)
    pairs = load_pairs()
    rng = random.Random(0)
    batch_list = [rng.sample(pairs, 32) for _ in range(batches)]
    rows = []
    for size in (32, 16, 8, 4, 1):
        scorer = rm.scorer(size, precision)
        for prompt, response in pairs:  # every shape once before timing
            scorer.score([prompt], [response])
        with Disturbance() as d:
            started = time.perf_counter()
            for batch in batch_list:
                scorer.score([p for p, _ in batch], [r for _, r in batch])
            rate = len(batch_list) * 32 / (time.perf_counter() - started)
        rows.append([str(size), f"{rate:.1f}", f"{d.fraction:.0%}" + (" disturbed" if d.disturbed else "")])
        print(f"forward passes of {size}: {rate:.1f} pairs/s", flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.one:
        print(one_variant(args.one, args.folder, args.calls, args.precision))
        return 0
    from anchor_rm.model.precision import resolve_precision

    precision = resolve_precision(args.precision)
    from anchor_rm.model.reward_model import load_pretrained, save_reward_model

    record = {"machine": machine(), "precision": precision}
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(save_reward_model(load_pretrained("minilm-l6", 192, seed=0), Path(tmp) / "model"))
        parts = args.parts.split(",")
        print(f"{machine()}; precision {precision}\n")
        if "threads" in parts:
            rows = threads(folder, args.calls, precision)
            record["threads"] = rows
            print("\n" + markdown_table(["variant", "what", "ms per short pair (median)", "other processes"], rows) + "\n")
        if "forward" in parts:
            rows = forward(folder, args.batches, precision)
            record["forward"] = rows
            print("\n" + markdown_table(["sequences per forward pass", "pairs/s (32-pair mixed batches)",
                                         "other processes"], rows))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
