"""Real tokens over padded tokens in the training batches, length-grouped against random order (not a test).

What our trainer's length grouping saves over a random order, the part of `bench_trl.py`'s speed-up that
comes from padding: the student-train pairs of each seed encoded as the trainer gets them, batched by
`anchor_rm.method.training.epoch_batches` with `grouped` on and off, every batch padded to its longest sequence
(chosen and rejected go through one forward pass). Counts only; nothing is trained.

    .venv/bin/python bench/padding.py                      # bench_trl.py's defaults: 320 pairs, batch 16, 192 tokens
    .venv/bin/python bench/padding.py --seeds 0,1,2 --epochs 2
"""

from __future__ import annotations

import argparse
import sys

from bench_common import markdown_table, positive_int, source_splits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--source", default="hh-helpful-base")
    parser.add_argument("--train-pairs", type=positive_int, default=320)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--max-length", type=positive_int, default=192)
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not seeds:
        parser.error("--seeds is empty")

    from anchor_rm.data.records import DataError
    from anchor_rm.method.training import epoch_batches
    from anchor_rm.model.loading import ModelError
    from anchor_rm.model.reward_model import load_pretrained

    rows = []
    for seed in seeds:
        try:
            splits = source_splits(args.source, seed, {"student_train": args.train_pairs})
            encoded = load_pretrained(args.model, args.max_length, seed).encode(splits.student_train)
        except (DataError, ModelError) as exc:
            parser.error(str(exc))
        chosen = [len(c.input_ids) for c in encoded.chosen]
        rejected = [len(r.input_ids) for r in encoded.rejected]
        lengths = [max(c, r) for c, r in zip(chosen, rejected)]
        real = args.epochs * (sum(chosen) + sum(rejected))
        shares = []
        for grouped in (True, False):
            padded = sum(2 * len(batch) * max(lengths[i] for i in batch)
                         for epoch in range(args.epochs)
                         for batch in epoch_batches(lengths, args.batch_size, seed, epoch, grouped))
            shares.append(real / padded)
        rows.append([str(seed), str(len(encoded)), f"{sum(lengths) / len(lengths):.1f}", f"{100 * shares[0]:.1f}",
                     f"{100 * shares[1]:.1f}", f"{shares[0] / shares[1]:.2f}"])
    print(markdown_table(["seed", "pairs", "mean pair length (longer side)", "real tokens %, grouped",
                          "real tokens %, random order", "grouped over random"], rows))
    print(f"\n{args.model}, {args.source}, batch {args.batch_size}, max length {args.max_length}, {args.epochs} epochs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
