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
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import add_precision_argument, clean_errors, setup_logging  # noqa: E402

log = logging.getLogger("anchor_rm")
NAME_TAG = "anchor_rm.tune_name"
REGISTERED_TAG = "anchor_rm.registered_version"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["default", "smoke"], default="default",
                   help="default: the embedded default (15 min on 2 cores with native bf16, about 42 estimated "
                        "on AVX2-only ones: README, Precision and speed); smoke: tiny, a few minutes")
    p.add_argument("--category", choices=["helpful", "harmless"], default="helpful")
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

    cfg = tune_preset(args.preset, args.category)
    if args.student:
        cfg.student = args.student
    if args.teacher:
        cfg.teacher = args.teacher
    cfg.seed = cfg.teacher_train.seed = cfg.student_train.seed = args.seed
    if args.epochs is not None:
        cfg.student_train.epochs = args.epochs
    if args.min_gap is not None:
        cfg.min_gap = args.min_gap
    cfg.student_train.__post_init__()
    cfg.resolve_precision(args.precision)
    return cfg


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
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    if resume:
        runs = client.search_runs([experiment_id], filter_string=f"tags.`{NAME_TAG}` = '{name}'", max_results=1)
        if runs:
            return runs[0].info.run_id
    run = client.create_run(experiment_id, run_name=f"tune {name}", tags={NAME_TAG: name, "anchor_rm.stage": "tune"})
    return run.info.run_id


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
    import mlflow
    import ray

    from anchor_rm.experiment import log_report, prepare_shared
    from anchor_rm.registry import default_model_name, log_and_register
    from anchor_rm.report_files import report_to_markdown
    from anchor_rm.tracking import configure, resolve_tracking_uri
    from tuning.final import checkpoint_folder, comparison_table, evaluate_outcome, nts_lambda_chart, outcomes_json
    from tuning.search import best_trial, init_ray, run_search
    from tuning.trainable import SharedPayload, outage_seconds_from_env, worker_resources

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
    with mlflow.start_run(run_id=parent_id):
        mlflow.set_tags(shared.tags())
        if not args.resume:
            mlflow.log_params({"preset": args.preset, "category": cfg.category, "student": cfg.student,
                               "teacher": cfg.teacher, "num_samples": args.num_samples or cfg_num_samples(args),
                               "concurrency": args.concurrency, "workers_per_trial": args.workers_per_trial,
                               "epochs": cfg.student_train.epochs, "seed": args.seed, "precision": cfg.precision})
        existing = mlflow.get_run(parent_id).data.tags.get(REGISTERED_TAG)
        init_ray(args.ray_address)
        total_cpus = ray.cluster_resources().get("CPU", 1)
        gpus = ray.cluster_resources().get("GPU", 0)
        use_gpu = args.use_gpu == "yes" or (args.use_gpu == "auto" and gpus > 0)
        cpus_per_worker, threads_per_worker = worker_resources(total_cpus, args.concurrency, args.workers_per_trial)
        payload = SharedPayload(
            cfg=cfg, splits=shared.splits, soft_labels=shared.soft_labels,
            teacher_val=shared.teacher.outputs["scores"]["val"], headline_targets=shared.headline_targets,
            tracking_uri=tracking_uri,
            experiment_id=experiment_id, parent_run_id=parent_id, storage_path=str(storage / name),
            num_workers=args.workers_per_trial,
            cpus_per_worker=cpus_per_worker, threads_per_worker=threads_per_worker,
            use_gpu=use_gpu, tags=shared.tags(),
        )
        payload.reference_states = shared_reference_states(cfg, shared)
        search_started = time.perf_counter()
        baselines, anchor = run_search(payload, num_samples=args.num_samples or cfg_num_samples(args),
                                       concurrency=args.concurrency, resume=args.resume, seed=args.seed)
        search_seconds = time.perf_counter() - search_started
        if existing:
            log.info("this experiment already registered %s; nothing more to do", existing)
            print(f"registered model version: {existing}")
            return 0
        selected = best_trial(anchor)
        log.info("selected %s (val mean NTS %+.2f)", selected.config, selected.val_mean_nts)

        with mlflow.start_run(run_name="final-evaluation", nested=True) as final_run, \
                tempfile.TemporaryDirectory() as tmp:
            mlflow.set_tags({"anchor_rm.stage": "final", **shared.tags()})
            train_dict = cfg.student_train.to_dict()
            reports, folders = {}, {}
            for label, outcome in [("selected", selected)] + [(f"{b.config['method']} W2S", b) for b in baselines if b.checkpoint_path]:
                folders[label] = checkpoint_folder(outcome, Path(tmp) / label.replace(" ", "_"))
                reports[label] = evaluate_outcome(shared, outcome, folders[label], cfg.student, cfg.teacher,
                                                  cfg.eval_batch_size, train_dict, cfg.precision)
            selected_label = f"ANCHOR {selected.config['anchor_layers']} lambda={selected.config['anchor_lambda']:.2g} (selected)"
            reports = {selected_label if k == "selected" else k: v for k, v in reports.items()}
            report = reports[selected_label]
            report.model["run_id"] = final_run.info.run_id
            comparison = Path(tmp) / "comparison.md"
            comparison.write_text(comparison_table(reports) + "\n")
            chart = nts_lambda_chart(anchor, baselines, Path(tmp) / "nts_vs_lambda.png")
            trials = outcomes_json(baselines, anchor, Path(tmp) / "trials.json")
            log_report(report)
            version = log_and_register(folders["selected"], report, registered_name,
                                       extra_artifacts={"comparison.md": str(comparison), "nts_vs_lambda.png": str(chart),
                                                        "trials.json": str(trials)})
        mlflow.set_tag(REGISTERED_TAG, f"{version.name}/{version.version}")

    print(report_to_markdown(report))
    print("\nTest-split comparison (selection used validation splits only):\n")
    print(comparison_table(reports))
    total = time.perf_counter() - started
    print(f"\nregistered: {version.model_uri} (alias challenger), run {version.run_id}")
    print(f"report:     runs:/{version.run_id}/report/report.md (and report.json, report.png, comparison.md, "
          f"nts_vs_lambda.png)")
    print(f"wall time {total:.0f} s: shared stages {shared_seconds:.0f} s, search {search_seconds:.0f} s "
          f"({len(baselines) + len(anchor)} trials), final evaluation and registration {total - shared_seconds - search_seconds:.0f} s")
    print(f"promote: python pipelines/promote.py --name {version.name} --version {version.version}")
    print(f"browse:  mlflow ui --backend-store-uri {tracking_uri}")
    return 0


def shared_reference_states(cfg, shared):
    """The frozen reference's states for every layer choice the search may pick, put in Ray's object store."""
    import ray

    from anchor_rm.workflow import load_pretrained, reference_states
    from tuning.space import LAYER_CHOICES

    started = time.perf_counter()
    train_cfg = cfg.student_train
    rm = load_pretrained(cfg.student, train_cfg.max_length, train_cfg.seed)
    states = reference_states(cfg.student, rm, shared.splits.student_train, LAYER_CHOICES, precision=train_cfg.precision,
                              batch_size=cfg.eval_batch_size)
    log.info("reference states for layers %s: %.0f MB in %.0f s", states.layers, states.nbytes() / 1e6,
             time.perf_counter() - started)
    return ray.put(states)


def cfg_num_samples(args) -> int:
    from anchor_rm.config import TUNE_SAMPLES

    return TUNE_SAMPLES[args.preset]


if __name__ == "__main__":
    sys.exit(main())
