"""Train one weak-to-strong reward model and evaluate it ID and OOD, recorded in MLflow.

    python pipelines/train.py                                  # ANCHOR, last layer, default preset
    python pipelines/train.py --method naive --preset smoke    # a one-minute check
    python pipelines/train.py --method anchor --anchor-lambda 1e-3 --anchor-layers middle

Data preparation, the weak teacher and the strong ceiling are MLflow runs of their own, reused when their
inputs are unchanged; the student run holds params, per-step losses, per-epoch validation metrics, test
metrics, the model and the report (report/report.{json,md,png}).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from anchor_rm.cli.common import (SCALE_FIELDS, add_dry_run_argument, add_frozen_layers_argument,
    add_precision_argument, add_scale_arguments, add_teacher_labels_argument, apply_shared_flags, category_of,
    clean_errors, memory_plan_or_dry_run, protocol_parser, seed_number, setup_logging)

log = logging.getLogger("anchor_rm")


def build_parser() -> argparse.ArgumentParser:
    p = protocol_parser(__doc__, "default: MiniLM-L6 student, the default protocol; smoke: tiny, under a minute on "
                                 "2 cores with native bf16 (README, Precision and speed)")
    p.add_argument("--method", choices=["naive", "confidence", "anchor", "gold"], default="anchor",
                   help="naive W2S, confidence W2S (Burns et al.), ANCHOR, or gold labels (the strong ceiling)")
    p.add_argument("--anchor-lambda", type=float, help="weight of the anchor term (default 1e-2)")
    p.add_argument("--anchor-layers", help="'last', 'middle' (50%% and 75%% of depth) or a list like '2,4'")
    p.add_argument("--confidence-alpha", type=float, help="final weight of the student's own hardened labels (0.75)")
    p.add_argument("--student", help="student model: short name (minilm-l6, smollm2-135m), folder or hub id")
    p.add_argument("--teacher", help="weak teacher: short name (minilm-l6-first2, ...), folder or hub id")
    p.add_argument("--source", help="source dataset: a catalog name, a file (JSONL/JSON/parquet/CSV) or a hub name")
    p.add_argument("--targets", help="comma-separated OOD targets (catalog names, files or hub names)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int, help="pairs per optimiser step")
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--max-length", type=int, help="tokens per (prompt, response); the prompt is cut from the left")
    add_frozen_layers_argument(p)
    add_teacher_labels_argument(p)
    add_scale_arguments(p)
    add_dry_run_argument(p)
    p.add_argument("--seed", type=seed_number)
    add_precision_argument(p)
    p.add_argument("--min-gap", type=float, metavar="POINTS",
                   help="stop before training the student unless the strong ceiling beats the weak teacher on ID "
                        "validation by this much (default: the preset's, 1 point; smoke: no check)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the strong ceiling (no PGR in the report)")
    p.add_argument("--no-premise", action="store_true",
                   help="with a method other than naive, do not train naive W2S beside it for the report's premise "
                        "check (does the failure ANCHOR targets happen here?); by default it trains once per inputs "
                        "and is read back after")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)")
    p.add_argument("--experiment", help="MLflow experiment name (default: anchor-rm-<category>)")
    p.add_argument("--verbose", action="store_true")
    return p


def config_from_args(args):
    from anchor_rm.pipeline.config import preset

    cfg = preset(args.preset, category_of(args))
    if args.source:
        cfg.source = args.source
    if args.targets:
        cfg.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    cfg.train_ceiling = not args.no_ceiling
    student_flags = ("method", "anchor_lambda", "anchor_layers", "confidence_alpha", "epochs", "batch_size",
                     "learning_rate", "max_length", "frozen_layers", "teacher_labels", *SCALE_FIELDS)
    from anchor_rm.model.precision import driver_device_type

    # train.py trains in this process: on its first GPU where it has one, else its CPU; the precision is for that
    return apply_shared_flags(cfg, args, {name: getattr(args, name) for name in student_flags}, driver_device_type())


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    with clean_errors():
        from anchor_rm.evaluation.report_files import report_to_markdown
        from anchor_rm.mlflow_edge.store import configure, resolve_tracking_uri
        from anchor_rm.model.reward_model import training_device
        from anchor_rm.pipeline.experiment import prepare_shared, run_student

        cfg = config_from_args(args)
        # train.py trains in this process: on its first GPU where it has one (reward_model.training_device), else its CPU
        if memory_plan_or_dry_run(cfg, args, device=training_device()):
            return 0
        started = time.perf_counter()
        experiment_id = configure(args.tracking_uri, args.experiment or f"anchor-rm-{cfg.category}")
        shared = prepare_shared(cfg, experiment_id)
        log.info("shared stages ready after %.0f s", time.perf_counter() - started)
        if cfg.min_gap is not None:
            shared.check_gap(cfg.min_gap)
        run_id, report = run_student(cfg, shared, cfg.student_train,
                                     experiment_id=None if args.no_premise else experiment_id)
        print(report_to_markdown(report))
        print(f"\nstudent run: {run_id}   (wall time {time.perf_counter() - started:.0f} s)")
        print(f"report: runs:/{run_id}/report/report.md")
        print(f"browse: mlflow ui --backend-store-uri {resolve_tracking_uri(args.tracking_uri)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
