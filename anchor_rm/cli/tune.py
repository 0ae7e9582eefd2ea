"""The main job: the whole weak-to-strong protocol on Ray, tracked in MLflow, ending in a registered model.

    python pipelines/tune.py                       # harmless, the embedded default (wall times per CPU: README)
    python pipelines/tune.py --category helpful    # the helpful protocol (its gap gate may stop it: README)
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
import sys
from pathlib import Path

from anchor_rm.cli.common import (SCALE_FIELDS, add_dry_run_argument, add_frozen_layers_argument,
    add_precision_argument, add_scale_arguments, add_teacher_labels_argument, apply_shared_flags, byte_size,
    category_of, clean_errors, lambda_range, memory_plan_or_dry_run, protocol_parser, seed_number, setup_logging)



def build_parser() -> argparse.ArgumentParser:
    p = protocol_parser(__doc__, "default: the embedded default (wall times per CPU: README); smoke: tiny, a few "
                                 "minutes")
    p.add_argument("--num-samples", type=int, help="ANCHOR configurations Optuna tries (default: preset's)")
    p.add_argument("--concurrency", type=int, default=1, help="trials running at once (default 1)")
    p.add_argument("--workers-per-trial", type=int, default=1, help="Ray Train workers (DDP processes) per trial")
    p.add_argument("--epochs", type=int, help="epochs per trial (ASHA may stop a trial after any epoch)")
    add_frozen_layers_argument(p)
    add_teacher_labels_argument(p)
    add_scale_arguments(p)
    p.add_argument("--strategy", choices=["ddp", "fsdp2"],
                   help="how a trial's workers share the student: ddp (a whole copy each) or fsdp2 (parameters, "
                        "gradients and optimiser state sharded; what a full fine-tune of a 7-8B student needs on 8 "
                        "GPUs, docs/scaling.md); default ddp")
    p.add_argument("--worker-memory", type=byte_size, metavar="SIZE",
                   help="memory each worker has, for the memory plan (e.g. 80GB); default: this machine's first "
                        "GPU, or its RAM shared by the workers running at once")
    add_dry_run_argument(p)
    p.add_argument("--max-failures", type=int, default=2, metavar="N",
                   help="times Ray Train restarts a trial's workers from its last checkpoint after a worker fails "
                        "(default 2); Tune then retries the whole trial once more")
    p.add_argument("--student", help="student model: short name, folder or hub id")
    p.add_argument("--teacher", help="weak teacher: short name, folder or hub id")
    p.add_argument("--seed", type=seed_number, default=0, help="seed of the splits, the models and the search")
    add_precision_argument(p)
    p.add_argument("--lambda-range", type=lambda_range, metavar="LOW,HIGH",
                   help="the anchor search's lambda range for both layer choices, e.g. 1e-3,1e2 (default: calibrated "
                        "for the student after a few naive W2S steps, lambda_grad x 1e-4..1: lambda does not "
                        "carry across models or loss definitions)")
    p.add_argument("--min-gap", type=float, metavar="POINTS",
                   help="stop before the search unless the strong ceiling beats the weak teacher on ID validation by "
                        "this much (default: the preset's, 1 point; the smoke preset does not check)")
    p.add_argument("--reference-cache", choices=["auto", "ram", "disk", "live"], default="auto",
                   help="where the frozen reference's states live for ANCHOR trials: ram (Ray's object store), disk "
                        "(memory-mapped under the storage path), live (no cache: one more forward pass per step); "
                        "auto: ram within --reference-cache-budget, else disk if it has room, else live")
    p.add_argument("--reference-cache-budget", type=byte_size, metavar="SIZE",
                   help="largest RAM cache for auto, e.g. 2GB (default: a quarter of this machine's memory)")
    p.add_argument("--use-gpu", choices=["auto", "yes", "no"], default="auto", help="auto: when the Ray cluster has GPUs")
    p.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one)")
    p.add_argument("--num-cpus", type=int, metavar="N",
                   help="CPUs of the local Ray cluster (default: all of this machine's); trials' workers are sized "
                        "on it. Not with --ray-address")
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
    from anchor_rm.pipeline.config import tune_preset

    student_train = {"epochs": args.epochs, "frozen_layers": args.frozen_layers, "teacher_labels": args.teacher_labels,
                     "strategy": args.strategy, **{name: getattr(args, name) for name in SCALE_FIELDS}}
    from anchor_rm.model.precision import driver_device_type

    # The precision of the driver's own stages, for its device; trials on GPUs resolve --precision for theirs
    return apply_shared_flags(tune_preset(args.preset, category_of(args)), args, student_train, driver_device_type())


def plan_device(use_gpu: str) -> str:
    """The device the memory plan is for: the trials' GPUs with --use-gpu yes, or auto where this machine has one."""
    if use_gpu == "yes":
        return "cuda"
    if use_gpu == "no":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def use_ray_token(address: str | None) -> None:
    """Ray (>= 2.59) authenticates by token, and reads whether to when it is imported, so this runs first.

    - An existing cluster (`--ray-address`): `ray start` clusters ask for the token their head was started
      with, which a client sends only in token mode. Where a token is at hand (RAY_AUTH_TOKEN,
      RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), token mode is set.
    - The local cluster: unless the user chose (any RAY_AUTH_* variable set), it gets a token of its own, in
      this process's environment, which every process of the cluster inherits. Left to itself, `ray.init`
      would write ~/.ray/auth_token on a machine without one, and every later `ray start --head` there would
      silently switch to token mode; a token the user already has is neither read nor touched.
    """
    import os
    import secrets

    if "ray" in sys.modules or "RAY_AUTH_MODE" in os.environ:
        return
    if address:
        if ("RAY_AUTH_TOKEN" in os.environ or "RAY_AUTH_TOKEN_PATH" in os.environ
                or Path("~/.ray/auth_token").expanduser().exists()):
            os.environ["RAY_AUTH_MODE"] = "token"
    elif "RAY_AUTH_TOKEN" not in os.environ and "RAY_AUTH_TOKEN_PATH" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    use_ray_token(args.ray_address)
    with clean_errors():
        from anchor_rm.mlflow_edge.registry import default_model_name
        from anchor_rm.mlflow_edge.store import resolve_tracking_uri
        from tuning.main_job import MainJobSettings, run_main_job
        from tuning.search import SearchFailed
        from tuning.space import LAYER_CHOICES

        cfg = tune_config(args)
        settings = MainJobSettings(
            preset=args.preset, storage_path=args.storage_path, name=args.name, resume=args.resume,
            tracking_uri=resolve_tracking_uri(args.tracking_uri),
            registered_name=args.registered_name or default_model_name(cfg.category), num_samples=args.num_samples,
            concurrency=args.concurrency, workers_per_trial=args.workers_per_trial, max_failures=args.max_failures,
            reference_cache=args.reference_cache, reference_cache_budget=args.reference_cache_budget,
            use_gpu=args.use_gpu, precision=args.precision, lambda_range=args.lambda_range,
            ray_address=args.ray_address, num_cpus=args.num_cpus, seed=args.seed)
        settings.check_batch(cfg.student_train.batch_size)
        if memory_plan_or_dry_run(cfg, args, device=plan_device(args.use_gpu), workers=args.workers_per_trial,
                                  workers_per_machine=args.concurrency * args.workers_per_trial,
                                  worker_memory=args.worker_memory, anchor_layer_choices=LAYER_CHOICES):
            return 0
        try:
            result = run_main_job(cfg, settings)
        except SearchFailed as exc:  # the trials' own errors were logged above, one line each
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if result.final is None:
            print(f"registered model version: {result.already_registered}")
            return 0
        print_outcome(result, settings.tracking_uri)
    return 0


def print_outcome(result, tracking_uri: str) -> None:
    from anchor_rm.evaluation.report_files import report_to_markdown

    version, seconds = result.final.version, result.seconds
    print(report_to_markdown(result.final.report))
    print("\nTest-split comparison (selection used validation splits only):\n")
    print(result.final.comparison)
    premise = result.final.report.premise
    if premise is not None:  # before any lambda: was there a failure for ANCHOR to fix in this run?
        print(f"\npremise: {premise['summary']}")
    print(f"\nregistered: {version.model_uri} (alias challenger), run {version.run_id}")
    print(f"report:     runs:/{version.run_id}/report/report.md (and report.json, report.png, comparison.md, "
          f"nts_vs_lambda.png)")
    print(f"wall time {seconds['total']:.0f} s: shared stages {seconds['shared']:.0f} s, search {seconds['search']:.0f} s "
          f"({result.trials} trials), final evaluation and registration "
          f"{seconds['total'] - seconds['shared'] - seconds['search']:.0f} s")
    print(f"promote: python pipelines/promote.py --name {version.name} --version {version.version}")
    print(f"browse:  mlflow ui --backend-store-uri {tracking_uri}")


if __name__ == "__main__":
    sys.exit(main())
