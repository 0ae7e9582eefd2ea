"""One Tune trial = one Ray Train `TorchTrainer` (N workers, DDP: gloo on CPU, nccl on GPU) running the
library's training loop. The Ray 2.60 pattern: a Tune function builds and fits the TorchTrainer, and
`TuneReportCallback` carries each epoch's validation metrics from the workers to Tune (and ASHA).

Each trial is an MLflow child run of the tune experiment's parent run. Rank 0 logs per-step losses and
per-epoch validation metrics to it; the run id lives in the trial's config, so a worker restarted from a
checkpoint keeps writing to the same run instead of opening a duplicate.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from anchor_rm.config import ProtocolConfig
from anchor_rm.splits import ProtocolSplits
from tuning.space import METRIC, trial_method_config

TRAINING_STATE = "training_state.pt"
log = logging.getLogger("anchor_rm")

# Test-only fault injection (tests/test_reliability.py): "<step>:<marker file>" makes the rank-0 worker
# SIGKILL itself when it finishes that training step, once (the marker file remembers), so that a test can
# watch Ray Train restore the trial from its last checkpoint. Unset, nothing happens.
KILL_WORKER_ENV = "ANCHOR_RM_TEST_KILL_WORKER_AT"
# Ray Train's controller collects a worker's reports (and so its checkpoints) when it polls the worker, every
# RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default). A checkpoint reported but not yet collected dies with
# the worker, and the restart begins from the one before. The hook waits two polls before it kills, so that
# the test's kill always lands after the epoch's checkpoint is known (on a fast CPU steps 6-8 take under 2 s).
_HEALTH_CHECK_INTERVAL_S = float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0"))


def _kill_once_at(step: int) -> None:
    spec = os.environ.get(KILL_WORKER_ENV)
    if not spec:
        return
    at, marker = spec.split(":", 1)
    if step != int(at):
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # atomic: only the first one dies
    except FileExistsError:
        return
    time.sleep(2 * _HEALTH_CHECK_INTERVAL_S + 1)
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class SharedPayload:
    """Everything trials share, computed once by the driver and handed out through the object store."""

    cfg: ProtocolConfig
    splits: ProtocolSplits
    soft_labels: list[float]
    teacher_val: dict  # dataset -> SplitScore dict, the teacher's validation accuracies (for NTS)
    headline_targets: list  # the OOD targets val/mean_nts averages (SharedStages.headline_targets)
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    storage_path: str  # the experiment's folder: Tune state and Train checkpoints live under it
    num_workers: int = 1
    cpus_per_worker: float = 1.0  # logical CPUs Ray reserves for each worker
    threads_per_worker: int = 1  # torch threads in each worker
    use_gpu: bool = False
    max_failures: int = 2
    tags: dict = field(default_factory=dict)  # links to the data/teacher/ceiling stage runs
    reference_states: object = None  # ObjectRef of the frozen reference's states on student-train (all layer choices)


def _train_config(payload: SharedPayload, config: dict):
    from anchor_rm.training import TrainConfig

    return TrainConfig(**{**payload.cfg.student_train.to_dict(), **trial_method_config(config)})


class TrackingUnavailable(RuntimeError):
    """Metric values could not be delivered to the tracking server within the allowed outage."""


OUTAGE_ENV = "ANCHOR_RM_MLFLOW_OUTAGE_SECONDS"


def outage_seconds_from_env(environ=os.environ) -> float:
    """How long a trial waits for an unreachable tracking server before it fails (default 600 s)."""
    raw = environ.get(OUTAGE_ENV, "600")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{OUTAGE_ENV} must be a number of seconds above 0, not {raw!r}")
    return seconds


class _MlflowLogger:
    """Rank 0's writer to the trial's run: batched, so a remote tracking server sees few requests.

    The server may be unreachable for a while (MLflow's client already retries each request for a few
    minutes). A batch it did not take stays pending, at most `max_pending` values, and is sent again after a
    backoff while training goes on. Before each checkpoint `deliver` insists: it retries for up to
    `outage_seconds` (OUTAGE_ENV, default 600) and then raises TrackingUnavailable,
    naming the run and how many values are undelivered. The trial then fails loudly (Ray Train retries it
    from its last checkpoint; Tune marks its run FAILED) instead of checkpointing past metrics that never
    arrived: no value is dropped silently.
    """

    BATCH_LIMIT = 1000  # MLflow's log_batch limit
    FLUSH_AT = 200

    def __init__(self, tracking_uri: str, run_id: str, active: bool, outage_seconds: float | None = None,
                 max_pending: int = 100_000):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri) if active else None
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.pending = []
        self.outage_seconds = outage_seconds_from_env() if outage_seconds is None else outage_seconds
        self.max_pending = max_pending
        self.failures = 0  # consecutive failed attempts
        self.next_attempt = 0.0  # time.monotonic() before which add() does not try again
        self.last_error = ""

    def add(self, metrics: dict[str, float], step: int) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending += [Metric(key, float(value), now, step) for key, value in metrics.items()]
        if len(self.pending) >= self.max_pending:
            self.deliver()  # the buffer is full: wait for the server (or fail) rather than drop values
        elif len(self.pending) >= self.FLUSH_AT and time.monotonic() >= self.next_attempt:
            self.flush()

    def flush(self) -> bool:
        """One attempt to send everything pending. A batch the server did not take stays pending (and the
        next attempt waits 2, 4, ... 60 s); returns whether nothing is pending any more."""
        from mlflow.exceptions import MlflowException

        while self.client is not None and self.pending:
            batch = self.pending[: self.BATCH_LIMIT]
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except MlflowException as exc:
                status = exc.get_http_status_code()
                if 400 <= status < 500 and status != 429:  # the request itself is wrong: retrying cannot help
                    raise
                self.failures += 1
                self.last_error = str(exc).splitlines()[0][:300]
                delay = min(60.0, 2.0 ** self.failures)
                self.next_attempt = time.monotonic() + delay
                log.warning("MLflow run %s: %d metric values not delivered yet (%s); next attempt in %.0f s",
                            self.run_id, len(self.pending), self.last_error, delay)
                return False
            del self.pending[: len(batch)]
        self.failures, self.next_attempt = 0, 0.0
        return True

    def deliver(self) -> None:
        """Send everything pending, retrying with backoff for up to outage_seconds; raise if that fails."""
        deadline = time.monotonic() + self.outage_seconds
        while not self.flush():
            if time.monotonic() >= deadline:
                raise TrackingUnavailable(
                    f"MLflow tracking server {self.tracking_uri} unreachable for over {self.outage_seconds:.0f} s: "
                    f"{len(self.pending)} metric values of run {self.run_id} not delivered ({self.last_error})")
            time.sleep(max(0.0, min(self.next_attempt, deadline) - time.monotonic()))


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's per-worker function: build the student, resume from the latest checkpoint if any, train,
    and after each epoch evaluate on the validation splits (rank 0), checkpoint and report."""
    import resource

    import ray.train
    import ray.train.torch

    from anchor_rm.experiment import validation_metrics
    from anchor_rm.workflow import (evaluate_model, load_pretrained, load_saved, save_reward_model, scores_from_dict,
                                    train_on_pairs)

    payload: SharedPayload = config["payload"]
    torch.set_num_threads(payload.threads_per_worker)
    cfg = payload.cfg
    train_cfg = _train_config(payload, config)
    context = ray.train.get_context()
    rank = context.get_world_rank()
    device = ray.train.torch.get_device()

    start_epoch, optimizer_state = 0, None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        rm = load_pretrained(cfg.student, train_cfg.max_length, train_cfg.seed)
    else:  # a restarted worker or a resumed experiment: continue after the last finished epoch
        with checkpoint.as_directory() as folder:
            rm = load_saved(folder)
            state = torch.load(Path(folder) / TRAINING_STATE, weights_only=False)
        start_epoch, optimizer_state = state["epoch"] + 1, state["optimizer_state"]
    rm.model.to(device).train()
    # The frozen reference's states: computed once by the driver, shared by every trial via the object store.
    reference = ray.get(payload.reference_states) if train_cfg.uses_anchor else None
    logger = _MlflowLogger(payload.tracking_uri, config["mlflow_run_id"], active=rank == 0)
    if start_epoch and rank == 0:
        logger.client.set_tag(config["mlflow_run_id"], "anchor_rm.resumed_from_epoch", str(start_epoch - 1))
    teacher_val = scores_from_dict(payload.teacher_val)

    # After a restart the steps of the interrupted epoch run (and are logged) again: the first of them carries
    # train/resumed_from_epoch, so a step logged twice in the history is explained by the metric beside it.
    resume_marker = [start_epoch > 0]

    def on_step(entry) -> None:
        logger.add({"train/loss": entry.loss, "train/w2s_loss": entry.w2s_loss,
                    "train/anchor_loss": entry.anchor_loss, "train/lr": entry.learning_rate}, entry.step)
        if resume_marker[0]:
            logger.add({"train/resumed_from_epoch": start_epoch - 1}, entry.step)
            resume_marker[0] = False
        if rank == 0:
            _kill_once_at(entry.step)

    def on_epoch_end(epoch: int, model, opt_state: dict) -> dict:
        metrics = {}
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                scores = evaluate_model(rm, payload.splits, "val", cfg.eval_batch_size, precision=cfg.precision)
                metrics = validation_metrics(payload.splits.source, teacher_val, scores, payload.headline_targets)
                metrics["worker/peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                logger.add(metrics, epoch)
                logger.deliver()  # every value up to here reaches MLflow before the checkpoint exists
                save_reward_model(rm, tmp, {"method": train_cfg.method, "teacher": cfg.teacher})
                torch.save({"epoch": epoch, "optimizer_state": opt_state}, Path(tmp) / TRAINING_STATE)
            tune_metrics = {METRIC: metrics.get("val/mean_nts", 0.0), "val_wrg": metrics.get("val/wrg", 0.0),
                            "val_id_acc": metrics.get(f"val/acc/{payload.splits.source}", 0.0), "epoch": epoch,
                            # This worker's peak resident memory so far, evaluation included (Linux: ru_maxrss in KiB).
                            "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
            ray.train.report(tune_metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp) if rank == 0 else None)
        return metrics

    train_on_pairs(rm, payload.splits.student_train, payload.soft_labels, train_cfg, reference=reference,
                   on_step=on_step, on_epoch_end=on_epoch_end, start_epoch=start_epoch, optimizer_state=optimizer_state)
    logger.deliver()


def trial_driver(config: dict, payload: SharedPayload) -> None:
    """The Tune function of one trial: open (or find again) its MLflow child run, then build and fit a
    TorchTrainer whose workers run `train_loop_per_worker`."""
    import ray.train
    import ray.tune
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    from tuning.callbacks import child_run_for_trial

    context = ray.tune.get_context()
    trial_id, trial_name = context.get_trial_id(), context.get_trial_name()
    train_cfg = _train_config(payload, config)
    run_id = child_run_for_trial(payload, trial_id, trial_name, train_cfg)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={**config, "payload": payload, "mlflow_run_id": run_id},
        scaling_config=ray.train.ScalingConfig(
            num_workers=payload.num_workers, use_gpu=payload.use_gpu,
            resources_per_worker={"CPU": payload.cpus_per_worker, **({"GPU": 1} if payload.use_gpu else {})},
        ),
        run_config=ray.train.RunConfig(
            # Named after the trial: a resumed Tune experiment restarts this Train run from its checkpoint.
            name=f"train-{trial_id}",
            storage_path=str(Path(payload.storage_path) / "train"),
            failure_config=ray.train.FailureConfig(max_failures=payload.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
            callbacks=[TuneReportCallback()],
        ),
    )
    trainer.fit()


# The Tune function only builds and watches the TorchTrainer; Ray rejects a zero request, so it holds a sliver.
DRIVER_CPU = 0.01


def worker_resources(total_cpus: float, concurrency: int, num_workers: int) -> tuple[float, int]:
    """(logical CPUs per worker, torch threads per worker) so that `concurrency` trials fit the cluster."""
    per_trial = total_cpus / concurrency
    logical = round((per_trial - DRIVER_CPU) / num_workers, 2)
    if logical <= 0:
        raise ValueError(f"{total_cpus} CPUs cannot hold {concurrency} concurrent trials of {num_workers} workers")
    return logical, max(1, int(per_trial // num_workers))
