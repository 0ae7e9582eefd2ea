"""The search itself: the baselines and the ANCHOR search as two Tune experiments with the same budget.

- baselines: naive W2S and confidence W2S, every epoch, no early stopping (they are the yardstick);
- anchor: Optuna over lambda (0 or log-uniform over space.LAMBDA_RANGE, 1e-6..10) and the layer choice,
  with ASHA.

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
from tuning.space import METRIC, make_scheduler, make_searcher
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


def _outcomes(grid) -> list[TrialOutcome]:
    outcomes = []
    for result in grid:
        metrics = result.metrics or {}
        cfg = {k: result.config.get(k) for k in ("method", "anchor_lambda", "anchor_layers")}
        outcomes.append(TrialOutcome(
            # a trial that failed before its first report has no metrics: its folder names it
            trial_id=metrics.get("trial_id") or (Path(result.path).name if result.path else ""), config=cfg,
            val_mean_nts=float(metrics.get(METRIC, float("nan"))), val_id_acc=float(metrics.get("val_id_acc", float("nan"))),
            epochs=int(metrics.get("training_iteration", 0)), checkpoint_path=metrics.get("checkpoint_path"),
            error=str(result.error) if result.error else None,
        ))
    return outcomes


# Tune saves its experiment state (which trials finished) at most every 10 s by default: a driver killed in
# that window would, on --resume, run a finished trial again. The state is a few kB; save it every second.
EXPERIMENT_STATE_PERIOD_S = "1"


def _tuner(path: Path, trainable, param_space: dict, tune_config: tune.TuneConfig, callbacks, resume: bool) -> tune.Tuner:
    import os

    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", EXPERIMENT_STATE_PERIOD_S)  # read when the Tuner starts
    if resume and tune.Tuner.can_restore(str(path)):
        log.info("resuming Tune experiment %s", path)
        return tune.Tuner.restore(str(path), trainable=trainable, resume_unfinished=True, resume_errored=True,
                                  restart_errored=False)
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune_config,
        run_config=tune.RunConfig(name=path.name, storage_path=str(path.parent), callbacks=callbacks, verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=1)),
    )


def run_search(payload: SharedPayload, *, num_samples: int, concurrency: int, resume: bool,
               seed: int) -> tuple[list[TrialOutcome], list[TrialOutcome]]:
    """Runs (or resumes) the baselines and the ANCHOR search under payload.storage_path (the experiment's
    folder); returns (baseline outcomes, anchor outcomes)."""
    root = Path(payload.storage_path)
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
        tune.TuneConfig(search_alg=make_searcher(seed), scheduler=make_scheduler(epochs), num_samples=num_samples,
                        max_concurrent_trials=concurrency, reuse_actors=False),
        callbacks, resume,
    ).fit()
    return _outcomes(baselines), _outcomes(anchor)


def best_trial(outcomes: list[TrialOutcome]) -> TrialOutcome:
    """Highest validation mean NTS among trials that ran every epoch (an early-stopped trial's last epoch
    is not comparable) and left a checkpoint; ties go to the smaller lambda."""
    finished = [o for o in outcomes if o.error is None and o.checkpoint_path and o.val_mean_nts == o.val_mean_nts]
    if not finished:
        raise RuntimeError("no trial finished with a checkpoint; see the Ray logs above")
    most_epochs = max(o.epochs for o in finished)
    full = [o for o in finished if o.epochs == most_epochs]
    return max(full, key=lambda o: (o.val_mean_nts, -(o.config.get("anchor_lambda") or 0.0)))


# Passed to every Ray worker, including those of a cluster started elsewhere (`ray start`).
WORKER_ENV_VARS = ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS",
                   "ANCHOR_RM_CACHE", "ANCHOR_RM_DATA_DIR", "MLFLOW_TRACKING_URI", OUTAGE_ENV,
                   "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", STEP_HOOK_ENV)


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    if ray.is_initialized():
        return
    env_vars = {k: os.environ[k] for k in WORKER_ENV_VARS if k in os.environ}
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
