"""Is there a weak-to-strong gap? Candidate weak teachers against the strong ceiling, per seed (not a test).

For each seed: the source's prompt-disjoint splits as the default preset makes them (its fractions, and its
caps on ID val and ID test), each candidate teacher trained on gold labels of teacher-train capped at its
pair count, and the strong ceiling (the student on gold labels of student-train, capped at each
--student-pairs); a cap is the same seeded subsample the protocol takes (splits.subsample). Prints ID validation accuracy (what a
choice may look at) and ID test accuracy (what the report shows) for every model, and ceiling minus
teacher on both. Choose on validation; the test column is there to show that the choice holds.

    .venv/bin/python bench/protocol_gap.py --category helpful --seeds 0
    .venv/bin/python bench/protocol_gap.py --source hh-helpful --teachers minilm-l6-first1:200,minilm-l6-first2:400 \
        --student-pairs 640,1280 --max-length 128 --seeds 0,1
    .venv/bin/python bench/protocol_gap.py --category helpful --teachers minilm-l6-first1:150:2:5e-4 \
        --student smollm2-135m --lora-rank 16 --lora-learning-rate 1e-3 --seeds 0     # a LoRA ceiling

Each teacher's soft labels on student-train are measured as a student would read them: what they say (mean nats
per pair, ln 2 - H(q); 0.693 for hard labels, 0 when every label is 0.5), raw and scaled by the temperature fitted
on the gold teacher_calibration split, and how often they are right (q > 0.5 on gold pairs). Each model's line
also gives its training time per optimizer step and the process's peak resident memory so far.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench_common import machine, markdown_table


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--category", choices=["helpful", "harmless"], default="helpful")
    parser.add_argument("--source", help="source dataset (default: the default preset's for the category)")
    parser.add_argument("--teachers", default="minilm-l6-first1:200,minilm-l6-first2:400",
                        help="comma-separated NAME:GOLD_PAIRS[:EPOCHS[:LEARNING_RATE]] candidate teachers")
    parser.add_argument("--student", default="minilm-l6")
    parser.add_argument("--student-pairs", default="640", help="comma-separated caps on student-train for the ceiling")
    parser.add_argument("--epochs", type=int, default=2, help="ceiling epochs")
    parser.add_argument("--frozen-layers", type=int, default=0, metavar="K",
                        help="the ceiling's embeddings and lowest K layers keep their pretrained weights (default 0)")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--lora-rank", type=int, default=0, metavar="R",
                        help="the ceiling trains LoRA adapters of rank R (and its head) instead of every weight")
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--lora-learning-rate", type=float, help="the adapters' learning rate (default: --learning-rate)")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--out", help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    try:
        args.teacher_list = []
        for item in args.teachers.split(","):
            name, pairs, *rest = item.split(":")
            args.teacher_list.append((name, int(pairs), int(rest[0]) if rest else 1,
                                      float(rest[1]) if len(rest) > 1 else args.learning_rate))
        args.student_pair_list = [int(n) for n in args.student_pairs.split(",")]
        args.seed_list = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error("--teachers NAME:PAIRS[:EPOCHS],...; --student-pairs and --seeds comma-separated integers")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from anchor_rm.data.splits import build_protocol_splits, subsample
    from anchor_rm.evaluation.metrics import apply_temperature, fit_temperature, label_information
    from anchor_rm.method.training import TrainConfig
    from anchor_rm.model.precision import resolve_precision
    from anchor_rm.pipeline.config import preset
    import numpy as np

    import resource

    from anchor_rm.evaluation.scores import evaluate_pairs
    from anchor_rm.method.stages import soft_labels, train_on_pairs
    from anchor_rm.model.reward_model import load_pretrained

    precision = resolve_precision(args.precision)
    cfg = preset("default", args.category)
    source = args.source or cfg.source
    fractions = tuple(cfg.source_fractions.items())
    rows, record = [], []
    for seed in args.seed_list:
        caps = {k: v for k, v in cfg.max_pairs.items() if k in ("id_val", "id_test")}
        splits = build_protocol_splits(source, [], seed, source_fractions=fractions, max_pairs=caps)

        def capped(pairs, n: int, key: str):
            return subsample(pairs, n, seed, f"{source}/{key}")
        print(f"seed {seed}: {source} splits {splits.counts[source]['splits']}", flush=True)

        def train_and_score(name: str, pairs, epochs: int, label_pairs=None, lr: float = args.learning_rate,
                            frozen_layers: int = 0, lora_rank: int = 0) -> dict:
            started = time.perf_counter()
            config = TrainConfig(method="gold", epochs=epochs, batch_size=16, seed=seed, learning_rate=lr,
                                 max_length=args.max_length, precision=precision, frozen_layers=frozen_layers,
                                 lora_rank=lora_rank, lora_alpha=args.lora_alpha,
                                 lora_learning_rate=args.lora_learning_rate if lora_rank else None)
            rm = load_pretrained(name, args.max_length, seed, lora_rank=lora_rank, lora_alpha=args.lora_alpha)
            trained_at = time.perf_counter()
            result, _ = train_on_pairs(rm, pairs, None, config)
            steps, train_seconds = result.steps, time.perf_counter() - trained_at
            val = evaluate_pairs(rm, splits.id_val, 64, precision=precision)
            test = evaluate_pairs(rm, splits.id_test, 64, precision=precision)
            out = {"val": val.accuracy, "test": test.accuracy, "n_val": val.n_pairs, "n_test": test.n_pairs}
            if label_pairs is not None:  # how much a student can learn from it: what its soft labels say, and how right
                q = soft_labels(rm, label_pairs, 64, precision)
                temperature = fit_temperature(soft_labels(rm, splits.teacher_calibration, 64, precision))["temperature"]
                scaled = apply_temperature(q, temperature)
                out.update(q_mean_abs_dev=float(np.mean(np.abs(q - 0.5))), information_nats=label_information(q),
                           calibrated_information_nats=label_information(scaled), temperature=temperature,
                           label_accuracy=float(100 * np.mean(q > 0.5)))
            out.update(train_seconds=train_seconds, steps=steps,
                       seconds_per_step=None if not steps else train_seconds / steps,
                       peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20)
            return {**out, "seconds": time.perf_counter() - started}

        teachers = {}
        for name, n, epochs, lr in args.teacher_list:
            label_pairs = capped(splits.student_train, max(args.student_pair_list), "student_train")
            label = f"{name} ({n} pairs x {epochs}, lr {lr:g})"
            teachers[label] = train_and_score(name, capped(splits.teacher_train, n, "teacher_train"), epochs,
                                              label_pairs, lr)
            print(f"  teacher {label}: {teachers[label]}", flush=True)
        for n in args.student_pair_list:
            ceiling = train_and_score(args.student, capped(splits.student_train, n, "student_train"), args.epochs,
                                      frozen_layers=args.frozen_layers, lora_rank=args.lora_rank)
            print(f"  ceiling {args.student} on {n} pairs x {args.epochs}"
                  f"{f', lowest {args.frozen_layers} layers frozen' if args.frozen_layers else ''}: {ceiling}", flush=True)
            for label, teacher in teachers.items():
                rows.append([str(seed), label, f"{teacher['information_nats']:.4f}",
                             f"{teacher['calibrated_information_nats']:.4f}", f"{teacher['label_accuracy']:.1f}", str(n),
                             f"{teacher['val']:.1f}", f"{ceiling['val']:.1f}",
                             f"{ceiling['val'] - teacher['val']:+.1f}", f"{teacher['test']:.1f}", f"{ceiling['test']:.1f}",
                             f"{ceiling['test'] - teacher['test']:+.1f}"])
                record.append({"seed": seed, "teacher": label, "student_pairs": n,
                               "teacher_scores": teacher, "ceiling_scores": ceiling})
    n_val, n_test = record[0]["ceiling_scores"]["n_val"], record[0]["ceiling_scores"]["n_test"]
    table = markdown_table(["seed", "teacher (gold pairs x epochs, lr)", "label nats (raw)", "label nats (calibrated)",
                            "label accuracy on student-train", "ceiling pairs", "teacher val",
                            "ceiling val", "gap val",
                            "teacher test", "ceiling test", "gap test"], rows)
    frozen = f" (embeddings and lowest {args.frozen_layers} layers frozen)" if args.frozen_layers else ""
    if args.lora_rank:
        frozen += (f" (LoRA rank {args.lora_rank}, alpha {args.lora_alpha:g}, adapter lr "
                   f"{args.lora_learning_rate or args.learning_rate:g})")
    note = (f"{source}, ID val n={n_val}, ID test n={n_test}; ceiling {args.student}{frozen}, max length "
            f"{args.max_length}, {args.epochs} epochs, lr {args.learning_rate}, {precision}; {machine()}")
    print("\n" + table + "\n\n" + note)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "records": record,
                                              "table": table, "note": note}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
