"""Shared command-line plumbing for the pipelines: logging, quiet third-party output, clean errors.

Kept free of heavy imports so that `--help` and the registry-only scripts (promote.py) start quickly.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from contextlib import contextmanager

# Nothing may reach the hub at run time on an offline machine; users with a network can unset this.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Read by transformers when it is first imported: no load reports or progress bars in our output.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def protocol_parser(description: str, preset_help: str):
    """The parser train.py and tune.py start from: --preset and --category."""
    import argparse

    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["default", "smoke", "paper"], default="default", help=preset_help)
    p.add_argument("--category", choices=["helpful", "harmless"],
                   help="helpful (source hh-helpful) or harmless (source pku-saferlhf); the OOD targets of each: "
                        "README, What the main job does. Default: harmless for the default preset (the category "
                        "whose strong ceiling beats the weak teacher at this scale, docs/results.md), helpful for "
                        "smoke and paper")
    return p


# The category a preset runs when --category is not given. The default preset runs harmless: with MiniLM-L6 the
# helpful ceiling saturates near 60% and its gap over the teacher is not reliable (docs/results.md, The protocol;
# on an AVX2 CPU in fp32, seed 0's helpful gap on validation came out at -0.7 points and the gate stopped the run).
PRESET_CATEGORY = {"default": "harmless", "smoke": "helpful", "paper": "helpful"}


def category_of(args) -> str:
    """--category, else the preset's (PRESET_CATEGORY)."""
    return args.category or PRESET_CATEGORY[args.preset]


def add_precision_argument(parser) -> None:
    # The choices are written here, not imported: --help must not pay for importing torch.
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="forward-pass precision of training and evaluation: auto (default) picks bf16 autocast "
                             "only where the hardware computes bf16 natively and faster (CUDA with bf16, a CPU with "
                             "AVX512-BF16 or AMX) and fp32 everywhere else; the choice is logged and recorded")


def add_frozen_layers_argument(parser) -> None:
    parser.add_argument("--frozen-layers", type=int, metavar="K",
                        help="freeze the embeddings and the lowest K transformer layers of the student and the ceiling "
                             "(no gradient, no optimiser state; their forward pass still runs): about 0.8x the epoch "
                             "time for K=2 of MiniLM-L6 on an AVX2 CPU (docs/benchmarks.md); every anchored layer must "
                             "lie above K (default 0: full fine-tuning)")


def add_teacher_labels_argument(parser) -> None:
    parser.add_argument("--teacher-labels", choices=["raw", "calibrated"],
                        help="the weak teacher's soft labels the students train on: raw, or calibrated (scaled by the "
                             "temperature fitted on the gold teacher_calibration split, which no model trains on); "
                             "default: the preset's")


def add_scale_arguments(parser) -> None:
    """LoRA and activation checkpointing: what a 1-8B student needs (docs/scaling.md)."""
    parser.add_argument("--lora-rank", type=int, metavar="R",
                        help="train LoRA adapters of rank R on every linear layer (the reward head in full) instead of "
                             "every weight; ANCHOR's reference is then the student with its adapters off, no second "
                             "copy (default 0: full fine-tuning)")
    parser.add_argument("--lora-alpha", type=float, help="LoRA scaling: the adapters' output times alpha / R (default 16)")
    parser.add_argument("--lora-learning-rate", type=float, metavar="LR",
                        help="the adapters' learning rate; the head keeps --learning-rate (default: --learning-rate)")
    parser.add_argument("--activation-checkpointing", action="store_true", default=None,
                        help="recompute activations in the backward pass (non-reentrant) instead of keeping them: "
                             "less memory, a longer step")


SCALE_FIELDS = ("lora_rank", "lora_alpha", "lora_learning_rate", "activation_checkpointing")


def add_dry_run_argument(parser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="print the configuration, where each dataset comes from and the memory plan, then stop: "
                             "no data is read and nothing trains (what the `paper` preset can show without a GPU)")


def memory_plan_or_dry_run(cfg, args, *, device: str = "cpu", workers: int = 1, workers_per_machine: int = 1,
                           worker_memory: int | None = None, anchor_layer_choices: tuple | None = None) -> bool:
    """The memory plan, logged before anything starts; a plan that will not fit stops the run here in one line
    (MemoryPlanError, which clean_errors prints), as do settings the models' configs refuse (protocol_plans;
    `anchor_layer_choices`: a search's layer choices, each checked against --frozen-layers). With --dry-run, the
    configuration, the datasets and the plans are printed instead of logged, and True says: stop."""
    import json

    from anchor_rm.data.catalog import data_schema
    from anchor_rm.method.memory_plan import check_protocol_memory, planned_precision, protocol_plans

    strategy = cfg.student_train.strategy
    planned = {"strategy": strategy, "workers": workers, "device": device, "anchor_layer_choices": anchor_layer_choices,
               "precision": planned_precision(cfg, device, args.precision)}
    limits = {**planned, "workers_per_machine": workers_per_machine, "worker_memory": worker_memory}
    if not args.dry_run:
        check_protocol_memory(cfg, **limits, log=logging.getLogger("anchor_rm"))
        return False
    print("configuration:")
    print(json.dumps(cfg.to_dict(), indent=2))
    print("\ndata (nothing is read in a dry run):")
    for name, role in [(cfg.source, "source")] + [(t, "OOD target") for t in cfg.targets]:
        schema = data_schema(name, role, cfg.from_hub)
        print(f"- {schema['dataset']} ({schema['role']}): from {schema['from']}; reader {schema['reader']} -> "
              f"(prompt, chosen, rejected); licence {schema['license']}")
    print("\nmemory plan:")
    for role, plan in protocol_plans(cfg, **planned).items():
        print(f"- {role}: {plan.summary()}")
    check_protocol_memory(cfg, **limits)
    print("\nthe plan fits; nothing was trained (--dry-run)")
    return True


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
         "TIB": 2**40}


def seed_number(text: str) -> int:
    """argparse type: a seed, a whole number >= 0 (numpy's generators take no negative seed)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def lambda_range(text: str) -> tuple[float, float]:
    """argparse type: "LOW,HIGH", two lambdas with 0 < LOW < HIGH."""
    parts = text.split(",")
    try:
        low, high = (float(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW,HIGH (two numbers, e.g. 1e-3,1e2)") from None
    if not 0 < low < high:
        raise argparse.ArgumentTypeError(f"{text!r}: needs 0 < LOW < HIGH")
    return low, high


def byte_size(text: str) -> int:
    """argparse type: "500MB", "2GB", "1.5GiB" or a number of bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (a number with KB, MB, GB, KiB, MiB or GiB, or bytes)")
    return int(float(match.group(1)) * UNITS[unit])


def apply_shared_flags(cfg, args, student_train: dict, device_type: str = "cpu"):
    """The flags train.py and tune.py share (--student, --teacher, --seed, --min-gap, --precision) and the
    student-training fields given in `student_train` (None: keep the preset's) applied to a ProtocolConfig,
    checked, with the precision resolved once for `device_type`, where the driver's own stages run."""
    if args.student:
        cfg.student = args.student
    if args.teacher:
        cfg.teacher = args.teacher
    if args.seed is not None:
        cfg.seed = cfg.teacher_train.seed = cfg.student_train.seed = args.seed
    if args.min_gap is not None:
        cfg.min_gap = args.min_gap
    for name, value in student_train.items():
        if value is not None:
            setattr(cfg.student_train, name, value)
    cfg.student_train.__post_init__()
    cfg.resolve_precision(args.precision, device_type)
    return cfg


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    for noisy in ("mlflow", "alembic", "urllib3", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextmanager
def clean_errors():
    """Bad input ends the program with one line naming what is wrong, not a library traceback
    (ANCHOR_RM_DEBUG=1 shows the traceback). DataError and ModelError are ValueErrors; an MLflow store's error is
    one line too."""
    try:
        yield
    except (ValueError, FileNotFoundError) as exc:
        if os.environ.get("ANCHOR_RM_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:  # disk full, read-only or unwritable folder (artifacts, checkpoints, reports)
        if os.environ.get("ANCHOR_RM_DEBUG"):
            raise
        print(f"error: {os_error_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # an MLflow store's error (a server gone, a name it refuses): one line naming it
        mlflow_errors = sys.modules.get("mlflow.exceptions")
        if mlflow_errors is None or not isinstance(exc, mlflow_errors.MlflowException) or os.environ.get("ANCHOR_RM_DEBUG"):
            raise
        print(f"error: MLflow: {getattr(exc, 'message', None) or exc}", file=sys.stderr)
        sys.exit(2)


def os_error_line(exc: OSError) -> str:
    """One line naming the path and what the system said ("No space left on device", "Read-only file system")."""
    import shutil

    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        source, target, why = exc.args[0][0]  # copytree gathers one (source, target, reason) per file
        return f"{target}: {why}"
    if exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)
