"""Evaluate a reward model on preference data and write the report (JSON, Markdown, PNG).

    python pipelines/evaluate.py --model models:/anchor-rm-helpful@champion --data ultrafeedback --data pandalm
    python pipelines/evaluate.py --model models:/anchor-rm-helpful/3 --data my_pairs.jsonl
    python pipelines/evaluate.py --model runs:/0123abcd/model --data hh-helpful-base --data ultrafeedback --id hh-helpful-base
    python pipelines/evaluate.py --model ./my-reward-model --data pairs.jsonl --no-log

--model is a registered version (models:/NAME@ALIAS or models:/NAME/VERSION), a run's model
(runs:/RUN_ID/PATH), or a local folder: one saved by anchor-rm (it has anchor_rm.json) or any
transformers reward-model checkpoint (a sequence classifier with one output).

--data, repeatable, is a shipped data set by name (hh-helpful-base, hh-helpful-online, hh-harmless-base,
ultrafeedback, pandalm, llmbar, pku-saferlhf, hhh-harmless, hhh-helpful, ...), a file (JSONL, JSON list,
parquet or CSV with prompt / chosen / rejected fields; other field names with --prompt-column etc.) or a
hub name org/name (needs a network). Each set is cleaned first (ties, empty, identical, contradicting and
repeated pairs are dropped; the counts are printed) and scored whole: these are not held-out splits, so a
set the model was trained on is scored on its training pairs too.

Teacher columns: when the model was logged by an anchor-rm training run, that run names its weak teacher
(tag anchor_rm.teacher_run) and the teacher is scored on the same data, giving AOG per set; --teacher
names one explicitly. WRG and NTS also need an in-distribution set: mark it with --id NAME.

A model with an out-of-distribution flag (registered by tune.py or train.py) is measured on every set too: the
share of responses it flags, the AUROC of its score against the ID validation responses stored with its fit,
and the model's accuracy on flagged and unflagged pairs (the report's ood_flag, a table in the Markdown).

The report goes to --out (default ./evaluation-<timestamp>/report.{json,md,png}), the Markdown is printed,
and the whole evaluation is recorded as an MLflow run in the experiment anchor-rm-evaluations (unless
--no-log). Bad input stops with one line starting with "error:" and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime
from pathlib import Path

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per download drowns the log
from anchor_rm.cli.common import add_precision_argument, clean_errors, seed_number, setup_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="URI_OR_FOLDER",
                   help="models:/NAME@ALIAS, models:/NAME/VERSION (or /latest), runs:/RUN_ID/PATH, or a local model folder")
    p.add_argument("--data", required=True, action="append", metavar="NAME_OR_FILE",
                   help="a data set to score on: catalog name, file or hub name; repeat for several")
    p.add_argument("--id", "--id-data", dest="id_data", metavar="NAME",
                   help="which --data entry is in-distribution (the model's training source): enables WRG and NTS")
    p.add_argument("--teacher", metavar="URI_OR_FOLDER",
                   help="score this teacher beside the model (same forms as --model); default: the teacher "
                        "the model's training run names, if any")
    p.add_argument("--no-teacher", action="store_true", help="do not look for or score a teacher")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="where report.json/.md/.png go (default: ./evaluation-<timestamp>)")
    p.add_argument("--prompt-column", default="prompt", help="prompt field of a data file (default: prompt)")
    p.add_argument("--chosen-column", default="chosen", help="preferred-response field (default: chosen)")
    p.add_argument("--rejected-column", default="rejected", help="other-response field (default: rejected)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="skip (and count) invalid records instead of stopping at the first one")
    p.add_argument("--hub-split", default="train", help="split of a hub data set (default: train)")
    p.add_argument("--max-pairs", type=int, metavar="N",
                   help="score a seeded sample of at most N pairs per data set (default: all)")
    p.add_argument("--seed", type=seed_number, default=0, help="seed of the --max-pairs sample (default: 0)")
    p.add_argument("--max-length", type=int,
                   help="tokens per (prompt, response) (default: what the model was trained with)")
    p.add_argument("--batch-size", type=int, default=32, help="pairs per scoring batch (default: 32)")
    add_precision_argument(p)
    p.add_argument("--tracking-uri",
                   help="MLflow tracking URI, for models:/ and runs:/ and for logging "
                        "(default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)")
    p.add_argument("--no-log", action="store_true", help="do not record the evaluation as an MLflow run")
    p.add_argument("--verbose", action="store_true", help="debug logging")
    return p


def _check_args(args) -> None:
    repeated = sorted({d for d in args.data if args.data.count(d) > 1})
    if repeated:
        raise ValueError(f"--data: each data set once, repeated: {repeated}")
    if args.id_data is not None and args.id_data not in args.data:
        raise ValueError(f"--id {args.id_data!r} is not one of the --data entries {args.data}")
    if args.teacher and args.no_teacher:
        raise ValueError("--teacher and --no-teacher contradict each other")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out}: is a file, not a folder")
    for flag in ("max_pairs", "batch_size", "max_length"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")


def _uses_mlflow(args) -> bool:
    return not args.no_log or any(str(u or "").startswith(("models:/", "runs:/")) for u in (args.model, args.teacher))


def evaluate(args) -> int:
    from anchor_rm.evaluation.report_files import report_to_markdown
    from anchor_rm.mlflow_edge import store
    from anchor_rm.model.precision import driver_device_type, resolve_precision
    from anchor_rm.pipeline import evaluate_any as ev

    _check_args(args)
    precision = resolve_precision(args.precision, driver_device_type())  # for the device it scores on
    sets = [ev.load_evaluation_set(name, prompt_column=args.prompt_column, chosen_column=args.chosen_column,
                                   rejected_column=args.rejected_column, hub_split=args.hub_split,
                                   skip_invalid=args.skip_invalid, max_pairs=args.max_pairs, seed=args.seed)
            for name in args.data]
    for s in sets:
        print(s.summary())

    tracking_uri = store.resolve_tracking_uri(args.tracking_uri)
    out = args.out or Path.cwd() / f"evaluation-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    report, run_id = ev.evaluate_and_record(
        sets, args.model, teacher_uri=args.teacher, look_for_teacher=not args.no_teacher, id_name=args.id_data,
        max_length=args.max_length, batch_size=args.batch_size, precision=precision, tracking_uri=tracking_uri,
        log_run=not args.no_log, connect=_uses_mlflow(args), out=out)
    print()
    print(report_to_markdown(report))
    print(f"report: {out}/report.md (and report.json, report.png)")
    if run_id:
        print(f"evaluation run: {run_id} in experiment {ev.EVALUATION_EXPERIMENT}")
        print(f"browse: mlflow ui --backend-store-uri {tracking_uri}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    with clean_errors():
        return evaluate(args)


if __name__ == "__main__":
    sys.exit(main())
