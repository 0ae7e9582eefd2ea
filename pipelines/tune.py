"""The main job: the whole weak-to-strong protocol on Ray, tracked in MLflow, ending in a registered model.

    python pipelines/tune.py                       # helpful, embedded default (15 min on 2 native-bf16 cores; README)
    python pipelines/tune.py --category harmless   # the harmless protocol
    python pipelines/tune.py --preset smoke        # a few minutes; what the tests use
    python pipelines/tune.py --resume              # continue the latest interrupted experiment
    python pipelines/tune.py --ray-address 10.0.0.5:6379 --tracking-uri http://mlflow:5000

Steps: data splits, weak teacher and strong ceiling (MLflow stage runs, reused when unchanged); then on
Ray, the naive and confidence baselines and an Optuna + ASHA search over the anchor lambda and layer
choice, maximising mean OOD NTS on the validation splits; each trial a Ray Train TorchTrainer and an MLflow
child run. The selected model is evaluated once on the test splits and registered as a new version of
`anchor-rm-<category>` with its report, under the alias `challenger`. Promote it with pipelines/promote.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import add_precision_argument, apply_shared_flags, clean_errors, protocol_parser, setup_logging  # noqa: E402

log = logging.getLogger("anchor_rm")


def build_parser() -> argparse.ArgumentParser:
    p = protocol_parser(__doc__, "default: the embedded default (15 min on 2 cores with native bf16, about 42 "
                                 "estimated on AVX2-only ones: README, Precision and speed); smoke: tiny, a few minutes")
    p.add_argument("--num-samples", type=int, help="ANCHOR configurations Optuna tries (default: preset's)")
    p.add_argument("--concurrency", type=int, default=1, help="trials running at once (default 1)")
    p.add_argument("--workers-per-trial", type=int, default=1, help="Ray Train workers (DDP processes) per trial")
    p.add_argument("--epochs", type=int, help="epochs per trial (ASHA may stop a trial after any epoch)")
    p.add_argument("--student", help="student model: short name, folder or hub id")
    p.add_argument("--teacher", help="weak teacher: short name, folder or hub id")
    p.add_argument("--seed", type=int, default=0, help="seed of the splits, the models and the search")
    add_precision_argument(p)
    p.add_argument("--min-gap", type=float, metavar="POINTS",
                   help="stop before the search unless the strong ceiling beats the weak teacher on ID validation by "
                        "this much (default: the preset's, 1 point; the smoke preset does not check)")
    p.add_argument("--use-gpu", choices=["auto", "yes", "no"], default="auto", help="auto: when the Ray cluster has GPUs")
    p.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)")
    p.add_argument("--registered-name", help="registered model name (default: anchor-rm-<category>)")
    p.add_argument("--storage-path", default="ray_results",
                   help="where Ray keeps trials and checkpoints; shared storage when trials run on several nodes")
    p.add_argument("--name", help="experiment name under the storage path (default: <category>-<preset>-<time>)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted experiment (--name, else the latest of this category and preset)")
    p.add_argument("--verbose", action="store_true")
    return p


def tune_config(args):
    from anchor_rm.config import tune_preset

    return apply_shared_flags(tune_preset(args.preset, args.category), args, {"epochs": args.epochs})


def experiment_name(args, storage: Path) -> str:
    prefix = f"{args.category}-{args.preset}"
    if args.name:
        return args.name
    if args.resume:
        existing = sorted(p.name for p in storage.glob(f"{prefix}-*") if p.is_dir())
        if not existing:
            raise ValueError(f"--resume: no experiment named {prefix}-* under {storage}; pass --name")
        return existing[-1]
    return f"{prefix}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def parent_run(experiment_id: str, name: str, resume: bool) -> str:
    from anchor_rm.mlflow_edge import keys, runs

    if resume:
        run_id = runs.find_run(experiment_id, {keys.TUNE_NAME_TAG: name})
        if run_id is not None:
            return run_id
    return runs.create_run(experiment_id, {keys.TUNE_NAME_TAG: name, keys.STAGE_TAG: "tune"}, run_name=f"tune {name}")


def use_cluster_token(address: str | None) -> None:
    """`ray start` clusters use token authentication (Ray >= 2.59), and a client sends its token only in
    token mode, which Ray reads when it is imported. Where a token is at hand (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, which `ray start` writes), use it."""
    import os

    at_hand = ("RAY_AUTH_TOKEN" in os.environ or "RAY_AUTH_TOKEN_PATH" in os.environ
               or Path("~/.ray/auth_token").expanduser().exists())
    if address and at_hand and "RAY_AUTH_MODE" not in os.environ and "ray" not in sys.modules:
        os.environ["RAY_AUTH_MODE"] = "token"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    use_cluster_token(args.ray_address)
    with clean_errors():
        return run(args)


def run(args) -> int:
    from anchor_rm.experiment import prepare_shared
    from anchor_rm.mlflow_edge import keys, runs
    from anchor_rm.mlflow_edge.registry import default_model_name
    from anchor_rm.mlflow_edge.store import configure, resolve_tracking_uri
    from anchor_rm.mlflow_edge.writer import outage_seconds_from_env
    from anchor_rm.report_files import report_to_markdown
    from tuning.final import register_selected
    from tuning.search import init_ray, run_search
    from tuning.trainable import make_payload

    outage_seconds_from_env()  # a bad value fails here, before any stage runs, not later in every trial
    started = time.perf_counter()
    cfg = tune_config(args)
    storage = Path(args.storage_path).resolve()
    name = experiment_name(args, storage)
    tracking_uri = resolve_tracking_uri(args.tracking_uri)
    experiment_id = configure(tracking_uri, f"anchor-rm-{cfg.category}")
    registered_name = args.registered_name or default_model_name(cfg.category)

    log.info("experiment %s: student %s, teacher %s, source %s, targets %s", name, cfg.student, cfg.teacher,
             cfg.source, ", ".join(cfg.targets))
    shared = prepare_shared(cfg, experiment_id)
    shared_seconds = time.perf_counter() - started
    log.info("shared stages (data, teacher, ceiling) ready after %.0f s; ceiling - teacher on ID val %s",
             shared_seconds, "n/a" if shared.gap() is None else f"{shared.gap():+.1f} points")
    if cfg.min_gap is not None:
        shared.check_gap(cfg.min_gap)

    parent_id = parent_run(experiment_id, name, args.resume)
    with runs.start_run(run_id=parent_id):
        runs.set_tags(shared.tags())
        if not args.resume:
            runs.log_params({"preset": args.preset, "category": cfg.category, "student": cfg.student,
                               "teacher": cfg.teacher, "num_samples": args.num_samples or cfg_num_samples(args),
                               "concurrency": args.concurrency, "workers_per_trial": args.workers_per_trial,
                               "epochs": cfg.student_train.epochs, "seed": args.seed, "precision": cfg.precision})
        existing = runs.run_tag(parent_id, keys.REGISTERED_TAG)
        init_ray(args.ray_address)
        payload = make_payload(cfg, shared, tracking_uri=tracking_uri, experiment_id=experiment_id,
                               parent_run_id=parent_id, storage_path=str(storage / name),
                               workers_per_trial=args.workers_per_trial, concurrency=args.concurrency,
                               use_gpu=args.use_gpu)
        search_started = time.perf_counter()
        baselines, anchor = run_search(payload, num_samples=args.num_samples or cfg_num_samples(args),
                                       concurrency=args.concurrency, resume=args.resume, seed=args.seed)
        search_seconds = time.perf_counter() - search_started
        if existing:
            log.info("this experiment already registered %s; nothing more to do", existing)
            print(f"registered model version: {existing}")
            return 0
        final = register_selected(shared, cfg, baselines, anchor, registered_name, parent_id)
        runs.set_tags({keys.REGISTERED_TAG: f"{final.version.name}/{final.version.version}"})
    report, version = final.report, final.version

    print(report_to_markdown(report))
    print("\nTest-split comparison (selection used validation splits only):\n")
    print(final.comparison)
    total = time.perf_counter() - started
    print(f"\nregistered: {version.model_uri} (alias challenger), run {version.run_id}")
    print(f"report:     runs:/{version.run_id}/report/report.md (and report.json, report.png, comparison.md, "
          f"nts_vs_lambda.png)")
    print(f"wall time {total:.0f} s: shared stages {shared_seconds:.0f} s, search {search_seconds:.0f} s "
          f"({len(baselines) + len(anchor)} trials), final evaluation and registration {total - shared_seconds - search_seconds:.0f} s")
    print(f"promote: python pipelines/promote.py --name {version.name} --version {version.version}")
    print(f"browse:  mlflow ui --backend-store-uri {tracking_uri}")
    return 0


def cfg_num_samples(args) -> int:
    from anchor_rm.config import TUNE_SAMPLES

    return TUNE_SAMPLES[args.preset]


if __name__ == "__main__":
    sys.exit(main())
