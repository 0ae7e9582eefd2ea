"""The main job, step by step (pipelines/tune.py reads the flags and prints the outcome; this runs it):
shared stages (data, teacher, ceiling) and the gap gate, the tune run in MLflow, the search on Ray, and
the final evaluation and registration (tuning/final.py)."""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from anchor_rm.evaluation import keys
from anchor_rm.evaluation.keys import cache_key
from anchor_rm.method.lambda_scale import (CALIBRATION_STEPS, SPAN, UNCALIBRATED_RANGE, LambdaRange, calibrate_lambda,
                                           fixed_range)
from anchor_rm.method.stages import load_student
from anchor_rm.mlflow_edge import runs
from anchor_rm.mlflow_edge.store import configure
from anchor_rm.mlflow_edge.writer import outage_seconds_from_env
from anchor_rm.model.reward_model import release_device_memory
from anchor_rm.pipeline.config import TUNE_SAMPLES, ProtocolConfig
from anchor_rm.pipeline.experiment import STAGE_VERSION, prepare_shared
from tuning.final import FinalResult, register_selected
from tuning.search import init_ray, run_search
from tuning.space import LAYER_CHOICES
from tuning.trainable import make_payload

log = logging.getLogger("anchor_rm")

LAMBDA_RANGE_STAGE = "lambda-range"


@dataclass
class MainJobSettings:
    """What pipelines/tune.py's flags decide beyond the protocol itself."""

    preset: str = "default"
    storage_path: str = "ray_results"
    name: str | None = None  # default: <category>-<preset>-<time>, or with resume the latest such
    resume: bool = False
    tracking_uri: str = ""
    registered_name: str = ""
    num_samples: int | None = None  # default: TUNE_SAMPLES[preset]
    concurrency: int = 1
    workers_per_trial: int = 1
    max_failures: int = 2  # Ray Train restarts of a trial's worker group (FailureConfig)
    reference_cache: str = "auto"  # ram, disk, live or auto (reference_cache.choose_reference_cache)
    reference_cache_budget: int | None = None  # bytes; default a quarter of physical memory
    use_gpu: str = "auto"
    precision: str = "auto"  # what --precision asked for: trials on GPUs resolve it for their own device
    lambda_range: tuple[float, float] | None = None  # --lambda-range; default calibrated for the student
    ray_address: str | None = None
    num_cpus: int | None = None  # the local cluster's CPUs (default: all of this machine's); not with ray_address
    seed: int = 0

    def __post_init__(self):
        """Counts a run cannot work with are refused before anything runs, naming the flag."""
        for flag, value, least in (("--num-samples", self.num_samples, 1), ("--concurrency", self.concurrency, 1),
                                   ("--workers-per-trial", self.workers_per_trial, 1),
                                   ("--max-failures", self.max_failures, 0)):
            if value is not None and value < least:
                raise ValueError(f"{flag} must be at least {least}, not {value}")
        if self.num_cpus is not None:
            if self.ray_address:
                raise ValueError("--num-cpus sizes the local Ray cluster; with --ray-address the cluster's nodes "
                                 "decide (drop one of the two)")
            if self.num_cpus < 1:
                raise ValueError(f"--num-cpus must be at least 1, not {self.num_cpus}")
        if self.lambda_range is not None and not 0 < self.lambda_range[0] < self.lambda_range[1]:
            raise ValueError(f"--lambda-range needs 0 < low < high, not {self.lambda_range[0]:g},{self.lambda_range[1]:g}")
        if self.registered_name and not re.fullmatch(r"[^/:'\"]+", self.registered_name.strip()):
            raise ValueError(f"--registered-name {self.registered_name!r}: MLflow's model names take no /, :, or quotes")

    def check_batch(self, batch_size: int) -> None:
        """Each Ray Train worker takes an equal share of a step's pairs: refused here, not in every trial."""
        if batch_size % self.workers_per_trial:
            raise ValueError(f"--workers-per-trial {self.workers_per_trial} does not divide the preset's student batch "
                             f"of {batch_size} pairs: each worker takes an equal share of a step")


@dataclass
class MainJobResult:
    name: str
    final: FinalResult | None  # None when the experiment had registered its version already
    already_registered: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # shared, search, total
    trials: int = 0


def experiment_name(prefix: str, storage: Path, name: str | None, resume: bool) -> str:
    if name:
        return name
    if resume:
        existing = sorted(p.name for p in storage.glob(f"{prefix}-*") if p.is_dir())
        if not existing:
            raise ValueError(f"--resume: no experiment named {prefix}-* under {storage}; pass --name")
        return existing[-1]
    return f"{prefix}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def check_resumable(name: str, storage: Path, experiment_id: str, experiment: str) -> None:
    """--resume --name NAME: the experiment must exist, in Tune's storage or as a tune run in MLflow (a driver
    killed during the shared stages leaves neither: run it again without --resume, its stages are reused).
    A misspelt name would otherwise start a whole new search, quietly."""
    if (storage / name).is_dir() or runs.find_run(experiment_id, {keys.TUNE_NAME_TAG: name}) is not None:
        return
    existing = sorted(p.name for p in storage.iterdir() if p.is_dir() and any(p.glob("*/experiment_state-*.json")))[-5:] \
        if storage.is_dir() else []
    raise ValueError(f"--resume --name {name}: no such experiment (nothing at {storage / name}, no tune run named {name} "
                     f"in MLflow experiment {experiment}); "
                     + (f"experiments under {storage}: {', '.join(existing)}" if existing else f"none under {storage}")
                     + "; to start it, run without --resume")


def parent_run(experiment_id: str, name: str, resume: bool) -> str:
    """The tune run of experiment `name`: found again on resume, else new."""
    if resume:
        run_id = runs.find_run(experiment_id, {keys.TUNE_NAME_TAG: name})
        if run_id is not None:
            return run_id
    return runs.create_run(experiment_id, {keys.TUNE_NAME_TAG: name, keys.STAGE_TAG: "tune"}, run_name=f"tune {name}")


def record_failures(outcomes: list) -> None:
    """How many trials failed, on the tune run (tag) and in the log, each with its error's last line; the
    selection goes on among the others (search.best_trial)."""
    failed = [o for o in outcomes if o.error is not None]
    runs.set_tags({keys.TRIALS_FAILED_TAG: str(len(failed)), keys.TRIALS_TAG: str(len(outcomes))})
    if failed:
        log.warning("%d of %d trials failed; selecting among the others:", len(failed), len(outcomes))
        for o in failed:
            lines = [line.strip() for line in o.error.splitlines() if line.strip()]
            log.warning("  trial %s %s: %s", o.trial_id or "?", o.config, lines[-1][:300] if lines else "?")


def shared_stages(cfg: ProtocolConfig, experiment_id: str):
    """Data, teacher and ceiling (experiment.prepare_shared), trained on the driver's device (its first GPU where it
    has one), whose memory is handed back before Ray gives that GPU to a trial (reward_model.release_device_memory)."""
    shared = prepare_shared(cfg, experiment_id)
    release_device_memory()
    return shared


def search_lambda_range(cfg: ProtocolConfig, shared, settings: MainJobSettings, experiment_id: str) -> LambdaRange:
    """The anchor search's lambda range (lambda_scale), recorded as the tune run's tag: --lambda-range when given;
    else calibrated for the student on the driver's device (a few naive W2S steps of a fresh copy, its memory handed
    back before Ray starts), a stage run keyed by its inputs, so that a resumed or repeated experiment searches the
    same range (another thread count would change its last digits); a sharded student, which the driver cannot
    hold, gets the uncalibrated range, with a warning."""
    train_cfg = replace(cfg.student_train, precision=cfg.precision)
    if settings.lambda_range is not None:
        found = fixed_range(LAYER_CHOICES, *settings.lambda_range, "given")
    elif train_cfg.strategy == "fsdp2":
        log.warning("lambda range not calibrated: a sharded student does not fit the driver; searching %g..%g, which "
                    "suits MiniLM-L6, not necessarily %s (give --lambda-range)", *UNCALIBRATED_RANGE, cfg.student)
        found = fixed_range(LAYER_CHOICES, *UNCALIBRATED_RANGE, "uncalibrated")
    else:
        def compute() -> dict:
            rm = load_student(cfg.student, train_cfg)
            calibrated = calibrate_lambda(rm, shared.splits.student_train,
                                          shared.soft_labels(train_cfg.teacher_labels), train_cfg, LAYER_CHOICES,
                                          batch_size=cfg.eval_batch_size)
            del rm
            release_device_memory()
            return calibrated.to_dict()

        key = cache_key(STAGE_VERSION, LAMBDA_RANGE_STAGE, shared.data.outputs["digests"], shared.teacher.run_id,
                        cfg.student, train_cfg.key_dict(), cfg.eval_batch_size, LAYER_CHOICES, CALIBRATION_STEPS, SPAN)
        run = runs.stage_run(experiment_id, LAMBDA_RANGE_STAGE, key, compute, tags=shared.tags())
        found = LambdaRange.from_dict(run.outputs)
        if run.reused:
            log.info("lambda range: %s (reusing run %s: same inputs)", found.describe(), run.run_id)
    runs.set_tags({keys.LAMBDA_RANGE_TAG: json.dumps(found.to_dict())})
    return found


def run_main_job(cfg: ProtocolConfig, settings: MainJobSettings) -> MainJobResult:
    outage_seconds_from_env()  # a bad value fails here, before any stage runs, not later in every trial
    started = time.perf_counter()
    storage = Path(settings.storage_path).resolve()
    name = experiment_name(f"{cfg.category}-{settings.preset}", storage, settings.name, settings.resume)
    experiment_id = configure(settings.tracking_uri, f"anchor-rm-{cfg.category}")
    if settings.resume and settings.name:
        check_resumable(name, storage, experiment_id, f"anchor-rm-{cfg.category}")
    num_samples = settings.num_samples or TUNE_SAMPLES[settings.preset]

    log.info("experiment %s: student %s, teacher %s, source %s, targets %s", name, cfg.student, cfg.teacher,
             cfg.source, ", ".join(cfg.targets))
    shared = shared_stages(cfg, experiment_id)
    shared_seconds = time.perf_counter() - started
    log.info("shared stages (data, teacher, ceiling) ready after %.0f s; ceiling - teacher on ID val %s",
             shared_seconds, "n/a" if shared.gap() is None else f"{shared.gap():+.1f} points")
    if cfg.min_gap is not None:
        shared.check_gap(cfg.min_gap)

    parent_id = parent_run(experiment_id, name, settings.resume)
    with runs.start_run(run_id=parent_id):
        runs.set_tags(shared.tags())
        if not settings.resume:
            runs.log_params({"preset": settings.preset, "category": cfg.category, "student": cfg.student,
                             "teacher": cfg.teacher, "num_samples": num_samples, "concurrency": settings.concurrency,
                             "workers_per_trial": settings.workers_per_trial, "max_failures": settings.max_failures,
                             "reference_cache": settings.reference_cache,
                             "epochs": cfg.student_train.epochs,
                             "seed": settings.seed, "precision": cfg.precision})
        existing = runs.run_tag(parent_id, keys.REGISTERED_TAG)
        if existing:  # a finished experiment: --resume restores nothing, trains nothing, registers nothing
            log.info("this experiment already registered %s; nothing more to do", existing)
            return MainJobResult(name, None, existing, {"shared": shared_seconds})
        lambda_range = search_lambda_range(cfg, shared, settings, experiment_id)
        init_ray(settings.ray_address, settings.num_cpus)
        payload = make_payload(cfg, shared, tracking_uri=settings.tracking_uri, experiment_id=experiment_id,
                               parent_run_id=parent_id, storage_path=str(storage / name),
                               workers_per_trial=settings.workers_per_trial, concurrency=settings.concurrency,
                               use_gpu=settings.use_gpu, max_failures=settings.max_failures,
                               reference_cache=settings.reference_cache,
                               reference_cache_budget=settings.reference_cache_budget, precision=settings.precision)
        search_started = time.perf_counter()
        baselines, anchor = run_search(payload, num_samples=num_samples, concurrency=settings.concurrency,
                                       resume=settings.resume, seed=settings.seed,
                                       lambda_ranges=lambda_range.ranges)
        search_seconds = time.perf_counter() - search_started
        result = MainJobResult(name, None, None, {"shared": shared_seconds, "search": search_seconds},
                               len(baselines) + len(anchor))
        record_failures(baselines + anchor)
        result.final = register_selected(shared, cfg, baselines, anchor, settings.registered_name, parent_id,
                                         experiment_id, lambda_range)
        runs.set_tags({keys.REGISTERED_TAG: f"{result.final.version.name}/{result.final.version.version}"})
    result.seconds["total"] = time.perf_counter() - started
    return result
