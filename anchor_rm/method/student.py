"""One student run, the only one: train a student reward model on a teacher's soft labels, measure it on the
validation splits, and write every metric through a sink. train.py's student, each student of the study and
each Ray Tune trial's workers call `train_student`; what differs between them is the sink (the active MLflow
run, the trial's buffered writer, nothing) and what happens after each epoch (a Ray checkpoint).

No tracker here: the metric names are those of mlflow_edge.keys (pure), and the sink decides where they go.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from anchor_rm.data.records import PreferencePair
from anchor_rm.data.splits import ProtocolSplits
from anchor_rm.evaluation import keys
from anchor_rm.evaluation.scores import evaluate_model
from anchor_rm.method.drift import DriftProbe
from anchor_rm.method.stages import train_on_pairs
from anchor_rm.method.training import StepLog, TrainConfig, TrainResult
from anchor_rm.model.reward_model import RewardModel


class MetricSink(Protocol):
    def log(self, metrics: dict[str, float], step: int | None = None) -> None: ...


class NoSink:
    """Drops every metric: a run nobody tracks (non-zero Ray ranks, a library caller without a tracker)."""

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass


@dataclass(frozen=True)
class Validation:
    """How a student is measured on the validation splits against its teacher."""

    splits: ProtocolSplits
    teacher_val: dict  # dataset -> metrics.SplitScore: the teacher on each validation split
    headline_targets: list[str]  # the OOD targets val/mean_nts averages
    batch_size: int
    precision: str
    drift_probe: DriftProbe | None = None  # with it, the metrics carry the student's last-layer drift

    def measure(self, rm: RewardModel) -> tuple[dict, dict[str, float]]:
        """(scores per validation set, the validation metrics: accuracy, NTS per target, WRG, mean NTS, and with
        a drift probe the last-layer drift on its student-train pairs)."""
        scores = evaluate_model(rm, self.splits, "val", self.batch_size, precision=self.precision)
        metrics = keys.validation_metrics(self.splits.source, self.teacher_val, scores, self.headline_targets)
        if self.drift_probe is not None:
            metrics[keys.DRIFT_METRIC] = self.drift_probe.measure(rm, batch_size=self.batch_size,
                                                                  precision=self.precision)
        return scores, metrics


@dataclass
class StudentRun:
    result: TrainResult
    pairs: int  # pairs trained on after encoding
    identical_after_truncation: int
    history: list[dict] = field(default_factory=list)  # the validation metrics after each epoch (when measured)
    # The last epoch's scores per validation set (scores.SplitScore), when measured: the trained model's, so the
    # report's validation block takes them instead of scoring the same model on the same pairs again.
    validation_scores: dict | None = None


def train_student(
    rm: RewardModel,
    pairs: Sequence[PreferencePair],
    soft_labels: Sequence[float] | None,
    train_cfg: TrainConfig,
    sink: MetricSink,
    *,
    validation: Validation | None = None,
    reference=None,
    after_step: Callable[[StepLog], None] | None = None,
    after_epoch: Callable[[int, dict[str, float], dict, dict | None], None] | None = None,
    start_epoch: int = 0,
    optimizer_state: dict | None = None,
) -> StudentRun:
    """Trains `rm` in place on `pairs` (soft labels, or gold when None), logging each step's losses; after
    each epoch, measures it on `validation` (when given) and logs that with the epoch as step, then calls
    `after_epoch(epoch, metrics, optimizer_state, scores)` (a checkpoint; scores None without validation). At the
    end, logs what training took. `start_epoch` and `optimizer_state` continue from a checkpoint; the first step run again then carries
    train/resumed_from_epoch, so that a step logged twice is explained by the metric beside it."""
    history: list[dict] = []
    last_scores: list[dict | None] = [None]
    resumed = [start_epoch > 0]

    def on_step(entry: StepLog) -> None:
        metrics = keys.step_metrics(entry)
        if resumed[0]:
            metrics[keys.RESUMED_FROM_EPOCH_METRIC] = start_epoch - 1
            resumed[0] = False
        sink.log(metrics, entry.step)
        if after_step is not None:
            after_step(entry)

    def on_epoch_end(epoch: int, model, opt_state: dict) -> dict:
        metrics: dict[str, float] = {}
        scores = None
        if validation is not None:
            scores, metrics = validation.measure(rm)
            sink.log(metrics, epoch)
            history.append(metrics)
        last_scores[0] = scores
        if after_epoch is not None:
            after_epoch(epoch, metrics, opt_state, scores)
        return metrics

    result, encoded = train_on_pairs(rm, pairs, soft_labels, train_cfg, reference=reference, on_step=on_step,
                                     on_epoch_end=on_epoch_end, start_epoch=start_epoch, optimizer_state=optimizer_state)
    sink.log(keys.training_summary(result, len(encoded), encoded.identical_after_truncation))
    return StudentRun(result, len(encoded), encoded.identical_after_truncation, history, last_scores[0])
