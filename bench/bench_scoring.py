"""Evaluation throughput of the one scoring path (RewardScorer: tokenise, truncate, length-sorted batches,
score), in pairs per second, fp32 against bf16 autocast (with the reward head in fp32), the two precisions
`auto` chooses between (not a test).

Both figures are `scores.evaluate_pairs` itself (encode + score + accuracy) with `precision="fp32"` and
`precision="bf16"`; on a CPU without native bf16 the bf16 column shows what emulation costs. A pair is two scored sequences (chosen and rejected). The
model is first trained briefly on gold labels so that its rewards separate pairs, then the two precisions
are compared on what they decide: accuracy, pairs whose verdict flips, largest reward difference.

    .venv/bin/python bench/bench_scoring.py                              # MiniLM-L6, HH helpful-base ID test, 192 tokens
    .venv/bin/python bench/bench_scoring.py --test-pairs 64 --train-pairs 16 --repeats 1 --batch-sizes 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench_common import machine, markdown_table, median, positive_int, source_splits


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minilm-l6", help="reward model (short name, folder or hub id)")
    parser.add_argument("--source", default="hh-helpful-base", help="the pairs scored: this source's ID test split")
    parser.add_argument("--test-pairs", type=positive_int, default=10_000, help="cap on the ID test split")
    parser.add_argument("--train-pairs", type=int, default=160, help="gold pairs to train on first (0: fresh head)")
    parser.add_argument("--max-length", type=positive_int, default=192)
    parser.add_argument("--batch-sizes", default="8,32,64", help="comma-separated scorer batch sizes (32: evaluation's)")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    try:
        args.batch_size_list = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batch-sizes must be comma-separated positive integers, got {args.batch_sizes!r}")
    if not args.batch_size_list or min(args.batch_size_list) < 1:
        parser.error(f"--batch-sizes must be comma-separated positive integers, got {args.batch_sizes!r}")
    if args.train_pairs < 0:
        parser.error(f"--train-pairs must be >= 0, got {args.train_pairs}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np

    from anchor_rm.evaluation.metrics import pairwise_accuracy
    from anchor_rm.evaluation.scores import evaluate_pairs
    from anchor_rm.method.stages import train_on_pairs
    from anchor_rm.method.training import TrainConfig
    from anchor_rm.model.reward_model import load_pretrained
    from anchor_rm.model.scoring import RewardScorer, encode_pairs

    caps = {"id_test": args.test_pairs, **({"student_train": args.train_pairs} if args.train_pairs else {})}
    splits = source_splits(args.source, args.seed, caps)
    rm = load_pretrained(args.model, args.max_length, args.seed)
    if args.train_pairs:
        train_on_pairs(rm, splits.student_train, None,
                       TrainConfig(method="gold", epochs=1, learning_rate=1e-4, max_length=args.max_length, seed=args.seed,
                                   precision="fp32"))
    pairs = splits.id_test

    started = time.perf_counter()
    encoded = encode_pairs(rm.encoder, pairs)
    encode_seconds = time.perf_counter() - started
    tokens = sum(len(e.input_ids) for e in encoded.chosen + encoded.rejected)

    def timed(precision: str):
        def run(batch_size: int) -> float:
            started = time.perf_counter()
            evaluate_pairs(rm, pairs, batch_size, precision=precision)  # the evaluation code path
            return time.perf_counter() - started
        return run

    timed_fp32, timed_bf16 = timed("fp32"), timed("bf16")

    timed_bf16(args.batch_size_list[0])  # warm-up: the first autocast call pays one-off costs
    seconds: dict[tuple[str, int], list[float]] = {}
    for repeat in range(args.repeats):
        for batch_size in args.batch_size_list:
            for precision, fn in (("fp32", timed_fp32), ("bf16", timed_bf16))[:: 1 if repeat % 2 == 0 else -1]:
                seconds.setdefault((precision, batch_size), []).append(fn(batch_size))
                print(f"repeat {repeat + 1} {precision} batch {batch_size}: {seconds[(precision, batch_size)][-1]:.2f} s",
                      flush=True)

    reference = args.batch_size_list[0] if 32 not in args.batch_size_list else 32
    fp32_c, fp32_r = RewardScorer(rm.model, rm.encoder, reference, "fp32").score_pairs(encoded)
    bf16_c, bf16_r = RewardScorer(rm.model, rm.encoder, reference, "bf16").score_pairs(encoded)
    flips = int(np.sum((fp32_c > fp32_r) != (bf16_c > bf16_r)))
    max_diff = float(np.max(np.abs(np.concatenate([fp32_c - bf16_c, fp32_r - bf16_r]))))

    rows = []
    for batch_size in args.batch_size_list:
        fp32_s, bf16_s = median(seconds[("fp32", batch_size)]), median(seconds[("bf16", batch_size)])
        rows.append([str(batch_size), f"{len(encoded) / fp32_s:.1f}", f"{len(encoded) / bf16_s:.1f}", f"{fp32_s / bf16_s:.2f}"])
    table = markdown_table(["batch size", "fp32 pairs/s", "bf16 pairs/s", "bf16 speed-up"], rows)
    note = (f"{args.model} ({'trained 1 epoch on ' + str(len(splits.student_train)) + ' gold pairs' if args.train_pairs else 'fresh head'}), "
            f"{len(encoded)} {args.source} ID test pairs, max length {args.max_length}, {tokens / (2 * len(encoded)):.0f} tokens "
            f"per sequence on average; tokenising them takes {encode_seconds:.2f} s (included above); {args.repeats} repeats, "
            f"medians; {machine()}\n"
            f"fp32 vs bf16 at batch {reference}: accuracy {pairwise_accuracy(fp32_c, fp32_r):.1f} vs "
            f"{pairwise_accuracy(bf16_c, bf16_r):.1f}, {flips} of {len(encoded)} verdicts flip, largest reward difference "
            f"{max_diff:.3g} (reward spread: std {np.std(np.concatenate([fp32_c, fp32_r])):.3g})")
    print("\n" + table + "\n\n" + note)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "seconds": {f"{p}/{b}": v for (p, b), v in seconds.items()},
                                              "table": table, "note": note}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
