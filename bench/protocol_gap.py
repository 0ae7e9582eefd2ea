"""Is there a weak-to-strong gap? Candidate weak teachers against the strong ceiling, per seed (not a test).

For each seed: the source's prompt-disjoint splits (as the protocol makes them), each candidate teacher
trained on gold labels of teacher-train (capped at its pair count), and the strong ceiling (the student on
gold labels of student-train, capped at each --student-pairs). Prints ID validation accuracy (what a
choice may look at) and ID test accuracy (what the report shows) for every model, and ceiling minus
teacher on both. Choose on validation; the test column is there to show that the choice holds.

    .venv/bin/python bench/protocol_gap.py --category helpful --seeds 0
    .venv/bin/python bench/protocol_gap.py --source hh-helpful --teachers minilm-l6-first1:200,minilm-l6-first2:400 \
        --student-pairs 640,1280 --max-length 128 --seeds 0,1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from _common import machine, markdown_table


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--category", choices=["helpful", "harmless"], default="helpful")
    parser.add_argument("--source", help="source dataset (default: the default preset's for the category)")
    parser.add_argument("--teachers", default="minilm-l6-first1:200,minilm-l6-first2:400",
                        help="comma-separated NAME:GOLD_PAIRS[:EPOCHS] candidate teachers")
    parser.add_argument("--student", default="minilm-l6")
    parser.add_argument("--student-pairs", default="640", help="comma-separated caps on student-train for the ceiling")
    parser.add_argument("--epochs", type=int, default=2, help="ceiling epochs")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--out", help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    try:
        args.teacher_list = []
        for item in args.teachers.split(","):
            name, pairs, *epochs = item.split(":")
            args.teacher_list.append((name, int(pairs), int(epochs[0]) if epochs else 1))
        args.student_pair_list = [int(n) for n in args.student_pairs.split(",")]
        args.seed_list = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error("--teachers NAME:PAIRS[:EPOCHS],...; --student-pairs and --seeds comma-separated integers")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from anchor_rm.config import preset
    from anchor_rm.precision import resolve_precision
    from anchor_rm.splits import build_protocol_splits
    from anchor_rm.training import TrainConfig
    from anchor_rm.workflow import evaluate_pairs, load_pretrained, train_on_pairs

    precision = resolve_precision(args.precision)
    cfg = preset("default", args.category)
    source = args.source or cfg.source
    fractions = tuple(cfg.source_fractions.items())
    rows, record = [], []
    for seed in args.seed_list:
        splits = build_protocol_splits(source, [], seed, source_fractions=fractions)
        print(f"seed {seed}: {source} splits {splits.counts[source]['splits']}", flush=True)

        def train_and_score(name: str, pairs, epochs: int) -> dict:
            started = time.perf_counter()
            rm = load_pretrained(name, args.max_length, seed)
            train_on_pairs(rm, pairs, None, TrainConfig(method="gold", epochs=epochs, batch_size=16, seed=seed,
                                                        learning_rate=args.learning_rate, max_length=args.max_length,
                                                        precision=precision))
            val = evaluate_pairs(rm, splits.id_val, 64, precision=precision)
            test = evaluate_pairs(rm, splits.id_test, 64, precision=precision)
            return {"val": val.accuracy, "test": test.accuracy, "n_val": val.n_pairs, "n_test": test.n_pairs,
                    "seconds": time.perf_counter() - started}

        teachers = {}
        for name, n, epochs in args.teacher_list:
            teachers[(name, n)] = train_and_score(name, splits.teacher_train[:n], epochs)
            print(f"  teacher {name} on {n} pairs x {epochs}: {teachers[(name, n)]}", flush=True)
        for n in args.student_pair_list:
            ceiling = train_and_score(args.student, splits.student_train[:n], args.epochs)
            print(f"  ceiling {args.student} on {n} pairs x {args.epochs}: {ceiling}", flush=True)
            for (name, tn), teacher in teachers.items():
                rows.append([str(seed), f"{name} ({tn})", str(n), f"{teacher['val']:.1f}", f"{ceiling['val']:.1f}",
                             f"{ceiling['val'] - teacher['val']:+.1f}", f"{teacher['test']:.1f}", f"{ceiling['test']:.1f}",
                             f"{ceiling['test'] - teacher['test']:+.1f}"])
                record.append({"seed": seed, "teacher": name, "teacher_pairs": tn, "student_pairs": n,
                               "teacher_scores": teacher, "ceiling_scores": ceiling})
    n_val, n_test = record[0]["ceiling_scores"]["n_val"], record[0]["ceiling_scores"]["n_test"]
    table = markdown_table(["seed", "teacher (gold pairs)", "ceiling pairs", "teacher val", "ceiling val", "gap val",
                            "teacher test", "ceiling test", "gap test"], rows)
    note = (f"{source}, ID val n={n_val}, ID test n={n_test}; max length {args.max_length}, ceiling {args.epochs} "
            f"epochs, lr {args.learning_rate}, {precision}; {machine()}")
    print("\n" + table + "\n\n" + note)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "records": record,
                                              "table": table, "note": note}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
