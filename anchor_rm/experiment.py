"""One weak-to-strong experiment, recorded in MLflow: data -> teacher -> (ceiling) -> student -> report.

Data preparation, the teacher and the strong ceiling are stage runs of their own, reused when their inputs
are unchanged (tracking.stage_run); each student is a run linked to them by tags. train.py runs one
student; Ray Tune (tuning/) runs many against the same shared stages.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlflow
import numpy as np

from anchor_rm.catalog import dataset_digest
from anchor_rm.config import ProtocolConfig
from anchor_rm.metrics import signal_targets, transfer_metrics
from anchor_rm.report import EvaluationReport, build_report
from anchor_rm.report_files import write_report
from anchor_rm.splits import ProtocolSplits, build_protocol_splits
from anchor_rm.tracking import StageRun, artifact_writes, cache_key, log_json, metric_name, stage_run
from anchor_rm.training import StepLog, TrainConfig
from anchor_rm.workflow import (
    RewardModel,
    evaluate_model,
    load_pretrained,
    reference_states,
    save_reward_model,
    scores_from_dict,
    scores_to_dict,
    soft_labels,
    split_results,
    train_on_pairs,
)

log = logging.getLogger("anchor_rm")

# Bump when a stage's code changes what it computes, so that cached stage runs are not reused.
STAGE_VERSION = "1"


@dataclass
class SharedStages:
    """What every student of one experiment reuses."""

    splits: ProtocolSplits
    data: StageRun
    teacher: StageRun
    ceiling: StageRun | None

    def teacher_scores(self, split: str):
        return scores_from_dict(self.teacher.outputs["scores"][split])

    def ceiling_scores(self, split: str):
        """The ceiling's scores on `split`; None without a ceiling or without scores on that split."""
        if self.ceiling is None or split not in self.ceiling.outputs["scores"]:
            return None
        return scores_from_dict(self.ceiling.outputs["scores"][split])

    @property
    def soft_labels(self) -> list[float]:
        return self.teacher.outputs["soft_labels"]

    @functools.cached_property
    def headline_targets(self) -> list[str]:
        """The OOD targets the mean NTS averages, in validation and in the test report alike: those on which
        the strong ceiling reaches chance on *validation* (metrics.signal_targets). Without a ceiling, all."""
        targets = list(self.splits.ood)
        if self.ceiling_scores("val") is None:
            return targets
        ceiling_val = {name: s.accuracy for name, s in self.ceiling_scores("val").items()}
        kept = signal_targets(ceiling_val, targets)
        if not kept:
            log.warning("the strong ceiling is below chance on every OOD target's validation split: no target "
                        "carries transfer signal; the mean NTS keeps them all")
        return kept or targets

    def gap(self, split: str = "val") -> float | None:
        """Strong ceiling minus weak teacher on the ID split, in points (None without a ceiling)."""
        if self.ceiling_scores(split) is None:
            return None
        source = self.splits.source
        return self.ceiling_scores(split)[source].accuracy - self.teacher_scores(split)[source].accuracy

    def check_gap(self, min_gap: float) -> None:
        """Stops the experiment, before any student trains, when the strong ceiling does not beat the weak
        teacher on ID validation by `min_gap` points: there is then no weak-to-strong setting to study."""
        gap = self.gap("val")
        if gap is None or gap >= min_gap:
            return
        source = self.splits.source
        teacher, ceiling = self.teacher_scores("val")[source], self.ceiling_scores("val")[source]
        raise ValueError(
            f"no weak-to-strong gap: on {source} ID validation ({teacher.n_pairs} pairs) the strong ceiling scores "
            f"{ceiling.accuracy:.1f} and the weak teacher {teacher.accuracy:.1f}, a gap of {gap:+.1f} points, under "
            f"--min-gap {min_gap:g}. Make the teacher weaker (--teacher with fewer layers, fewer teacher-train "
            f"pairs) or the ceiling stronger (more student-train pairs, --max-length, --epochs), or lower --min-gap")

    def tags(self) -> dict[str, str]:
        tags = {"anchor_rm.data_run": self.data.run_id, "anchor_rm.teacher_run": self.teacher.run_id}
        if self.ceiling:
            tags["anchor_rm.ceiling_run"] = self.ceiling.run_id
        return tags


def split_digests(splits: ProtocolSplits) -> dict[str, str]:
    digests = {
        f"{splits.source}/{name}": dataset_digest(getattr(splits, name))
        for name in ("teacher_train", "student_train", "id_val", "id_test")
    }
    for target, parts in splits.ood.items():
        for split, pairs in parts.items():
            digests[f"{target}/{split}"] = dataset_digest(pairs)
    return digests


def prepare_data(cfg: ProtocolConfig, experiment_id: str) -> tuple[ProtocolSplits, StageRun]:
    splits = build_protocol_splits(cfg.source, cfg.targets, cfg.seed, max_pairs=cfg.max_pairs,
                                   source_fractions=tuple(cfg.source_fractions.items()))
    digests = split_digests(splits)
    for name, counts in splits.counts.items():
        log.info("data %s: %s", name, counts)

    def compute() -> dict:
        for name, counts in splits.counts.items():
            mlflow.log_metrics({f"{metric_name(name)}.{k}": v for k, v in counts.items() if isinstance(v, int)})
            mlflow.log_metrics({f"{metric_name(name)}.split.{k}": v for k, v in counts["splits"].items()})
        return {"digests": digests, "counts": splits.counts}

    run = stage_run(experiment_id, "data", cache_key(STAGE_VERSION, digests), compute, params=cfg.data_dict())
    return splits, run


def _log_model(rm: RewardModel, artifact_path: str, extra: dict | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp, artifact_writes():
        mlflow.log_artifacts(str(save_reward_model(rm, Path(tmp) / "model", extra)), artifact_path)


def step_logger(prefix: str = "train") -> Callable[[StepLog], None]:
    def on_step(entry: StepLog) -> None:
        mlflow.log_metrics(
            {f"{prefix}/loss": entry.loss, f"{prefix}/w2s_loss": entry.w2s_loss,
             f"{prefix}/anchor_loss": entry.anchor_loss, f"{prefix}/lr": entry.learning_rate},
            step=entry.step,
        )
    return on_step


def _log_scores(prefix: str, scores) -> None:
    for name, s in scores.items():
        mlflow.log_metrics({f"{prefix}/acc/{metric_name(name)}": s.accuracy, f"{prefix}/n/{metric_name(name)}": s.n_pairs})


def _gold_stage(stage: str, model_name: str, train_cfg: TrainConfig, cfg: ProtocolConfig, splits: ProtocolSplits,
                data: StageRun, experiment_id: str, train_pairs, label_pairs=None,
                eval_splits: tuple[str, ...] = ("val", "test")) -> StageRun:
    """Trains `model_name` on gold labels and scores it on `eval_splits`: validation for the tuning objective,
    the gap gate and the headline targets, test for the report."""
    key = cache_key(STAGE_VERSION, stage, data.outputs["digests"], model_name, train_cfg.to_dict(), cfg.eval_batch_size,
                    eval_splits, cfg.precision)

    def compute() -> dict:
        log.info("%s: training %s on %d gold pairs", stage, model_name, len(train_pairs))
        rm = load_pretrained(model_name, train_cfg.max_length, train_cfg.seed)
        result, _ = train_on_pairs(rm, train_pairs, None, train_cfg, on_step=step_logger())
        mlflow.log_metric("train/pairs_per_second", result.pairs_seen / max(result.seconds, 1e-9))
        outputs = {"model": model_name, "scores": {}}
        for split in eval_splits:
            scores = evaluate_model(rm, splits, split, cfg.eval_batch_size, precision=cfg.precision)
            _log_scores(split, scores)
            outputs["scores"][split] = scores_to_dict(scores)
        if label_pairs is not None:
            labels = soft_labels(rm, label_pairs, cfg.eval_batch_size, cfg.precision)
            outputs["soft_labels"] = labels.tolist()
            mlflow.log_metrics({"soft_labels/mean": float(np.mean(labels)), "soft_labels/agree_with_gold": float(np.mean(labels > 0.5) * 100)})
        _log_model(rm, "model", {"stage": stage})
        return outputs

    params = {"model": model_name, "train": train_cfg.to_dict(), "n_train_pairs": len(train_pairs)}
    run = stage_run(experiment_id, stage, key, compute, params=params, tags={"anchor_rm.data_run": data.run_id})
    if run.reused:
        log.info("%s: reusing run %s (same inputs)", stage, run.run_id)
    return run


def prepare_shared(cfg: ProtocolConfig, experiment_id: str) -> SharedStages:
    """Data, teacher (with its soft labels on student-train) and the strong ceiling, each once."""
    splits, data = prepare_data(cfg, experiment_id)
    teacher = _gold_stage("teacher", cfg.teacher, cfg.teacher_train, cfg, splits, data, experiment_id,
                          splits.teacher_train, label_pairs=splits.student_train)
    ceiling = None
    if cfg.train_ceiling:
        gold = TrainConfig(**{**cfg.student_train.to_dict(), "method": "gold"})
        ceiling = _gold_stage("ceiling", cfg.student, gold, cfg, splits, data, experiment_id, splits.student_train)
    return SharedStages(splits, data, teacher, ceiling)


def validation_metrics(source: str, teacher_val: dict, student_scores: dict,
                       headline_targets: list[str] | None = None) -> dict[str, float]:
    """Accuracy per val set and NTS per OOD target against the teacher; the tuning objective, val/mean_nts,
    averages the headline targets (SharedStages.headline_targets; default all)."""
    tm = transfer_metrics({k: v.accuracy for k, v in teacher_val.items()},
                          {k: v.accuracy for k, v in student_scores.items()}, source,
                          headline_targets=headline_targets)
    out = {f"val/acc/{metric_name(k)}": v.accuracy for k, v in student_scores.items()}
    out.update({f"val/nts/{metric_name(k)}": v for k, v in tm.nts.items()})
    out.update({"val/wrg": tm.wrg, "val/mean_nts": tm.mean_nts})
    return out


def final_report(shared: SharedStages, rm: RewardModel, model_info: dict, eval_batch_size: int, precision: str,
                 selection_splits: str = "none") -> EvaluationReport:
    """The student on every test split, beside the teacher (and ceiling), as a report; `precision` is the
    experiment's resolved precision (the teacher's test scores were taken in it too). The same on every
    validation split goes into the report's validation block: what promotion compares."""
    model_info = {**model_info, "precision": precision}
    rows = {}
    for split in ("val", "test"):
        student = evaluate_model(rm, shared.splits, split, eval_batch_size, precision=precision)
        rows[split] = split_results(shared.splits, split, student, shared.teacher_scores(split),
                                    shared.ceiling_scores(split))
    digests = {k: v for k, v in shared.data.outputs["digests"].items()}
    return build_report(model_info, rows["test"], selection_splits=selection_splits, figure_splits="test",
                        data_digests=digests, headline_targets=shared.headline_targets,
                        validation_results=rows["val"])


def log_report(report: EvaluationReport, artifact_path: str = "report") -> None:
    with tempfile.TemporaryDirectory() as tmp, artifact_writes():
        write_report(report, tmp)
        mlflow.log_artifacts(tmp, artifact_path)
    metrics = {"test/wrg": report.wrg, "test/mean_nts": report.mean_nts, "test/id_acc": report.id_split.student_accuracy}
    metrics.update({f"test/acc/{metric_name(r.dataset)}": r.student_accuracy for r in report.splits})
    metrics.update({f"test/aog/{metric_name(k)}": v for k, v in report.aog.items()})
    metrics.update({f"test/nts/{metric_name(k)}": v for k, v in report.nts.items()})
    if report.pgr is not None:
        metrics["test/pgr"] = report.pgr
    mlflow.log_metrics(metrics)


def train_student(cfg: ProtocolConfig, shared: SharedStages, train_cfg: TrainConfig) -> tuple[RewardModel, list[dict]]:
    """Trains one student on the teacher's soft labels inside the active MLflow run, logging per-step losses
    and per-epoch validation metrics. Returns the model and the per-epoch validation metrics."""
    rm = load_pretrained(cfg.student, train_cfg.max_length, train_cfg.seed)
    reference = None
    if train_cfg.uses_anchor:
        reference = reference_states(cfg.student, rm, shared.splits.student_train, [train_cfg.anchor_layers],
                                     precision=train_cfg.precision, batch_size=cfg.eval_batch_size)
        mlflow.log_metric("reference_cache/megabytes", reference.nbytes() / 1e6)
    history: list[dict] = []

    def on_epoch_end(epoch: int, model, optimizer_state: dict) -> dict:
        scores = evaluate_model(rm, shared.splits, "val", cfg.eval_batch_size, precision=cfg.precision)
        metrics = validation_metrics(shared.splits.source, shared.teacher_scores("val"), scores, shared.headline_targets)
        mlflow.log_metrics(metrics, step=epoch)
        history.append(metrics)
        log.info("epoch %d: val mean NTS %.2f, val ID acc %.1f", epoch, metrics["val/mean_nts"],
                 scores[shared.splits.source].accuracy)
        return metrics

    result, encoded = train_on_pairs(rm, shared.splits.student_train, shared.soft_labels, train_cfg, reference=reference,
                                     on_step=step_logger(), on_epoch_end=on_epoch_end)
    mlflow.log_metrics({"train/pairs_per_second": result.pairs_seen / max(result.seconds, 1e-9),
                        "train/seconds": result.seconds, "train/pairs": len(encoded),
                        "train/identical_after_truncation": encoded.identical_after_truncation})
    return rm, history


def run_student(cfg: ProtocolConfig, shared: SharedStages, train_cfg: TrainConfig, run_name: str | None = None) -> tuple[str, EvaluationReport]:
    """A full student run: train, report on test, log model and report. Returns (run id, report)."""
    with mlflow.start_run(run_name=run_name or train_cfg.method) as run:
        mlflow.set_tags({"anchor_rm.stage": "student", "anchor_rm.method": train_cfg.method, **shared.tags()})
        mlflow.log_params({"student": cfg.student, "teacher": cfg.teacher, "source": cfg.source,
                           "targets": ",".join(cfg.targets), **{f"train.{k}": v for k, v in train_cfg.to_dict().items()}})
        log_json(shared.data.outputs["digests"], "data_digests.json")
        rm, _ = train_student(cfg, shared, train_cfg)
        info = {"name": f"{cfg.student} ({train_cfg.method})", "student": cfg.student, "teacher": cfg.teacher,
                "method": train_cfg.method, "hyperparameters": train_cfg.to_dict(), "run_id": run.info.run_id}
        report = final_report(shared, rm, info, cfg.eval_batch_size, cfg.precision)
        log_report(report)
        _log_model(rm, "model", {"method": train_cfg.method, "teacher": cfg.teacher})
    return run.info.run_id, report

