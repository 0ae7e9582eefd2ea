"""The search itself: the baselines and the ANCHOR search as two Tune experiments with the same budget.

- baselines: naive W2S and confidence W2S, every epoch, no early stopping (they are the yardstick);
- anchor: Optuna over the layer choice and lambda (log-uniform over the run's range per layer choice,
  lambda_scale.LambdaRange: calibrated for the student), with ASHA.

Both write under <storage>/<name>/ (Tune state in baselines/ and anchor/, Train runs and checkpoints in
train/), so `--resume` restores each one that did not finish and reuses the
results of each one that did, without redoing a finished trial.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import tune

from anchor_rm.mlflow_edge.writer import OUTAGE_ENV
from tuning.callbacks import MlflowTrialStatus, ProgressLog
from tuning.orphans import record_driver, release_orphaned_placement_groups
from tuning.space import DRIFT_RESULT, METRIC, make_scheduler, make_searcher
from tuning.storage import experiment_filesystem
from tuning.trainable import DRIVER_RESOURCES, STEP_HOOK_ENV, SharedPayload, trial_driver

log = logging.getLogger("anchor_rm")

BASELINE_METHODS = ("naive", "confidence")


@dataclass
class TrialOutcome:
    trial_id: str
    config: dict  # method, anchor_lambda, anchor_layers
    val_mean_nts: float
    val_id_acc: float
    epochs: int
    checkpoint_path: str | None
    error: str | None = None
    drift_last: float | None = None  # last-layer drift on the drift probe after its last epoch
    anchor_loss_start: float | None = None  # the anchor loss, mean of the trial's first steps
    anchor_loss_end: float | None = None  # and of its last epoch's last steps
    w2s_loss_end: float | None = None


TRIAL_KEYS = ("method", "anchor_lambda", "anchor_layers")


def _outcomes(grid) -> list[TrialOutcome]:
    """One outcome per trial of a finished Tune experiment. A trial that reported nothing (it failed, or its
    driver died, before its first epoch ended) has no metrics and so no config in Tune's result: it is an
    outcome with an error, named by its folder, never read as a result."""
    outcomes = []
    for result in grid:
        metrics = result.metrics or {}
        config = result.config or {}
        error = str(result.error) if result.error else None
        if error is None and METRIC not in metrics:
            error = "the trial reported no result"
        outcomes.append(TrialOutcome(
            trial_id=metrics.get("trial_id") or (Path(result.path).name if result.path else ""),
            config={k: config.get(k) for k in TRIAL_KEYS},
            val_mean_nts=float(metrics.get(METRIC, float("nan"))), val_id_acc=float(metrics.get("val_id_acc", float("nan"))),
            epochs=int(metrics.get("training_iteration", 0)), checkpoint_path=metrics.get("checkpoint_path"),
            error=error, drift_last=_number(metrics.get(DRIFT_RESULT)),
            anchor_loss_start=_number(metrics.get("anchor_loss_start")),
            anchor_loss_end=_number(metrics.get("anchor_loss_end")), w2s_loss_end=_number(metrics.get("w2s_loss_end")),
        ))
    return outcomes


def _number(value) -> float | None:
    return None if value is None else float(value)


# Tune saves its experiment state (which trials finished) at most every 10 s by default: a driver killed in
# that window would, on --resume, run a finished trial again. The state is a few kB; save it every second.
EXPERIMENT_STATE_PERIOD_S = "1"


def _tuner(path: Path, trainable, param_space: dict, tune_config: tune.TuneConfig, callbacks, resume: bool) -> tune.Tuner:
    import os

    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", EXPERIMENT_STATE_PERIOD_S)  # read when the Tuner starts
    if resume and tune.Tuner.can_restore(str(path)):
        log.info("resuming Tune experiment %s", path)
        return tune.Tuner.restore(str(path), trainable=trainable, resume_unfinished=True, resume_errored=True,
                                  restart_errored=False, storage_filesystem=experiment_filesystem())
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune_config,
        run_config=tune.RunConfig(name=path.name, storage_path=str(path.parent), callbacks=callbacks, verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=1),
                                  storage_filesystem=experiment_filesystem()),  # a kill never leaves half a file
    )


def run_search(payload: SharedPayload, *, num_samples: int, concurrency: int, resume: bool,
               seed: int, lambda_ranges: dict) -> tuple[list[TrialOutcome], list[TrialOutcome]]:
    """Runs (or resumes) the baselines and the ANCHOR search under payload.storage_path (the experiment's
    folder), lambda searched over `lambda_ranges` (layer choice -> (low, high)); returns (baseline outcomes,
    anchor outcomes)."""
    root = Path(payload.storage_path)
    record_driver(root)
    release_orphaned_placement_groups(root)
    trainable = tune.with_resources(tune.with_parameters(trial_driver, payload=payload), DRIVER_RESOURCES)
    callbacks = [MlflowTrialStatus(payload.tracking_uri, payload.experiment_id, payload.parent_run_id), ProgressLog()]
    epochs = payload.cfg.student_train.epochs

    baselines = _tuner(
        root / "baselines", trainable,
        {"method": tune.grid_search(list(BASELINE_METHODS))},
        tune.TuneConfig(max_concurrent_trials=concurrency, reuse_actors=False),
        callbacks, resume,
    ).fit()
    anchor = _tuner(
        root / "anchor", trainable, {},
        tune.TuneConfig(search_alg=make_searcher(seed, lambda_ranges), scheduler=make_scheduler(epochs),
                        num_samples=num_samples, max_concurrent_trials=concurrency, reuse_actors=False),
        callbacks, resume,
    ).fit()
    return _outcomes(baselines), _outcomes(anchor)


class SearchFailed(RuntimeError):
    """No trial of the search can be selected; the message names each trial, why, and what to do."""


# How the search's winner is chosen, stated in every report it registers (tuning/final.py).
SELECTION_RULE = ("the highest validation mean NTS among naive W2S and the ANCHOR trials that ran every epoch and "
                  "left a checkpoint; a tie (equal to 1e-6 points) goes to the higher validation ID accuracy, then "
                  "to the simpler model (the smaller lambda; naive W2S is lambda 0)")


def best_trial(outcomes: list[TrialOutcome]) -> TrialOutcome:
    """The winner by SELECTION_RULE. Early-stopped trials are left out (their last epoch is not comparable
    with a full run), unless no trial ran every epoch."""
    finished = [o for o in outcomes if o.error is None and o.checkpoint_path and o.val_mean_nts == o.val_mean_nts]
    if not finished:
        why = "; ".join(f"trial {o.trial_id or '?'}: {_last_line(o.error or 'no checkpoint')}" for o in outcomes)
        raise SearchFailed(f"no trial finished with a checkpoint ({why or 'no trials'}). `tune.py --resume` runs "
                           "the failed trials again from their last checkpoints; Ray's logs above say why they failed")
    most_epochs = max(o.epochs for o in finished)
    full = [o for o in finished if o.epochs == most_epochs]
    return max(full, key=_selection_key)


def _selection_key(outcome: TrialOutcome) -> tuple:
    return round(outcome.val_mean_nts, 6), outcome.val_id_acc, -(outcome.config.get("anchor_lambda") or 0.0)


def tied_with(selected: TrialOutcome, outcomes: list[TrialOutcome]) -> list[TrialOutcome]:
    """The other finished full-length candidates whose validation mean NTS equals the winner's (the tie rule
    decided between them)."""
    return [o for o in outcomes if o is not selected and o.error is None and o.checkpoint_path
            and o.epochs == selected.epochs and round(o.val_mean_nts, 6) == round(selected.val_mean_nts, 6)]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "?"


# Passed to every Ray worker, including those of a cluster started elsewhere (`ray start`): these names, and every
# variable of the prefixes below: the Hugging Face hub's token and caches (HF_TOKEN, HF_HOME, HF_HUB_CACHE: a gated
# Llama is refused with 401 on a node that lacks them), NCCL's and torch's NCCL settings (NCCL_SOCKET_IFNAME,
# NCCL_IB_DISABLE, TORCH_NCCL_...: what makes the GPUs of two nodes talk), the CUDA allocator's settings.
WORKER_ENV_VARS = ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS",
                   "HUGGING_FACE_HUB_TOKEN", "PYTORCH_CUDA_ALLOC_CONF",
                   "ANCHOR_RM_CACHE", "ANCHOR_RM_DATA_DIR", "MLFLOW_TRACKING_URI", OUTAGE_ENV,
                   "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", STEP_HOOK_ENV)
WORKER_ENV_PREFIXES = ("HF_", "NCCL_", "TORCH_NCCL_")


def worker_env(environ: dict[str, str]) -> dict[str, str]:
    """The driver's variables every Ray worker gets (WORKER_ENV_VARS and WORKER_ENV_PREFIXES). CUDA_VISIBLE_DEVICES
    is never among them: Ray sets each worker's own."""
    return {k: v for k, v in environ.items() if k in WORKER_ENV_VARS or k.startswith(WORKER_ENV_PREFIXES)}


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    if ray.is_initialized():
        return
    env_vars = worker_env(dict(os.environ))
    # Starting a worker imports torch and transformers: on a busy 2-core machine that alone can pass
    # Ray Train's default 60 s limit on worker-group startup.
    env_vars.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300"))
    runtime_env = {"env_vars": env_vars}
    # Worker output goes to Ray's log files (printed at the end when a trial fails); our progress lines
    # come from the Tune callbacks.
    if address:
        ray.init(address=address, log_to_driver=False, runtime_env=runtime_env)
    else:
        # The dashboard serves Ray's State API, which Ray Train's placement-group cleaner needs: without
        # it, a trial stopped by ASHA leaks its workers' CPUs and the next trial never starts. The cleaner asks
        # that API without an address: with another Ray instance on this machine (a second local tune.py, a
        # `ray start`) it finds two, its thread dies on "Found multiple active Ray instances", and the same leak
        # follows (seen in the test suite, session 11). So the new cluster's processes, which inherit this
        # environment, are told their own API server.
        dashboard_port = _free_port()
        os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{dashboard_port}"
        ray.init(num_cpus=num_cpus, log_to_driver=False, runtime_env=runtime_env, include_dashboard=True,
                 dashboard_host="127.0.0.1", dashboard_port=dashboard_port)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
