"""What the OOD flag costs in scoring time (anchor_rm/model/ood_flag.py), measured in one process (not a test).

The same `RewardScorer` with and without the version's fitted density (what ANCHOR_RM_OOD_FLAG=1 / 0 serve),
on the service's scoring shapes: one pair per call (one client) and 32 mixed-length HH pairs per call (a batch
of concurrent requests), forward passes of 8 sequences (the service's default). Each repeat times both
settings back to back, in alternating order; the figure is the ratio with / without per repeat (every repeat
shown) and its median. The target (issue 28): at most 1.10.

MiniLM-L6 with a fresh reward head, max length 192, in the precision `--precision` resolves to; the density
is fitted on 400 PKU-SafeRLHF responses and thresholded on 200 others, as a registered version's is on
student-train and ID validation.

    .venv/bin/python bench/ood_flag_overhead.py                  # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from bench_common import Disturbance, load_pairs, machine, markdown_table, positive_int

SHAPES = {"1 pair per call": 1, "32 pairs per call": 32}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--calls", type=positive_int, default=60, help="1-pair calls per setting per repeat")
    parser.add_argument("--batches", type=positive_int, default=6, help="32-pair calls per setting per repeat")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--out", help="also write the figures as JSON here")
    return parser.parse_args(argv)


def fitted_model(precision: str):
    from anchor_rm.data.catalog import load_dataset_pairs
    from anchor_rm.data.splits import clean_pairs
    from anchor_rm.evaluation.scores import fit_ood_flag
    from anchor_rm.model.reward_model import load_pretrained

    rm = load_pretrained("minilm-l6", 192, seed=0)
    pairs = clean_pairs(load_dataset_pairs("pku-saferlhf"))[0]
    fit_ood_flag(rm, pairs[:200], pairs[200:300], fit_split="pku-saferlhf[:200]", threshold_split="pku-saferlhf[200:300]",
                 precision=precision)
    return rm


def timed(scorer, calls: list[list[tuple[str, str]]]) -> float:
    """Seconds per call."""
    started = time.perf_counter()
    for call in calls:
        scorer.score([p for p, _ in call], [r for _, r in call])
    return (time.perf_counter() - started) / len(calls)


def main(argv=None) -> int:
    args = parse_args(argv)
    from anchor_rm.model.precision import resolve_precision

    precision = resolve_precision(args.precision)
    rm = fitted_model(precision)
    scorers = {"with": rm.scorer(8, precision), "without": rm.scorer(8, precision, ood_flag=False)}
    pairs = load_pairs()
    rng = random.Random(0)
    work = {"1 pair per call": [[pair] for pair in rng.sample(pairs, args.calls)],
            "32 pairs per call": [rng.sample(pairs, 32) for _ in range(args.batches)]}
    for scorer in scorers.values():  # every shape once before timing
        for prompt, response in pairs:
            scorer.score([prompt], [response])
    print(f"{machine()}; precision {precision}\n", flush=True)
    rows, record = [], {"machine": machine(), "precision": precision, "repeats": {}}
    for shape, calls in work.items():
        ratios, seconds = [], {"with": [], "without": []}
        for repeat in range(args.repeats):
            order = ["with", "without"] if repeat % 2 == 0 else ["without", "with"]
            with Disturbance() as d:
                took = {setting: timed(scorers[setting], calls) for setting in order}
            for setting, value in took.items():
                seconds[setting].append(value)
            ratio = took["with"] / took["without"]
            ratios.append((ratio, d.disturbed))
            print(f"{shape}, repeat {repeat + 1}: {1000 * took['without']:.2f} ms without, "
                  f"{1000 * took['with']:.2f} ms with: {ratio:.3f}x (other processes {d.fraction:.0%})", flush=True)
        kept = [r for r, disturbed in ratios if not disturbed]
        rows.append([shape, f"{1000 * statistics.median(seconds['without']):.2f}",
                     f"{1000 * statistics.median(seconds['with']):.2f}",
                     ", ".join(f"{r:.3f}" + ("*" if disturbed else "") for r, disturbed in ratios),
                     f"{statistics.median(kept):.3f}" if kept else "all disturbed"])
        record["repeats"][shape] = {"ratios": [r for r, _ in ratios], "disturbed": [d for _, d in ratios],
                                    "seconds": seconds}
    print("\n" + markdown_table(["call", "ms without flag (median)", "ms with flag (median)",
                                 "with / without, each repeat (* disturbed)", "median of undisturbed"], rows))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
