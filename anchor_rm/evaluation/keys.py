"""Every name the project writes into MLflow, in one place: tags, aliases, artifact paths and metric keys.

Pure: no mlflow import, so the core and the study tables can build metric dicts without the tracker.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

# Run tags.
STAGE_TAG = "anchor_rm.stage"  # data, teacher, ceiling, student, tune, trial, final, evaluation
CACHE_KEY_TAG = "anchor_rm.cache_key"  # the digest of a stage's inputs (runs.stage_run)
METHOD_TAG = "anchor_rm.method"
DATA_RUN_TAG = "anchor_rm.data_run"
TEACHER_RUN_TAG = "anchor_rm.teacher_run"  # names the teacher's stage run, which logged the teacher as model/
CEILING_RUN_TAG = "anchor_rm.ceiling_run"
TRIAL_TAG = "anchor_rm.trial_id"
TRIAL_OUTCOME_TAG = "anchor_rm.trial_outcome"
RESUMED_FROM_EPOCH_TAG = "anchor_rm.resumed_from_epoch"
# + the first epoch a worker group trained: the Ray node id of its rank-0 worker (a trial restarted on
# another node has one tag per start)
RAY_NODE_TAG_PREFIX = "anchor_rm.ray_node.from_epoch_"
PROCESS_GROUP_TAG = "anchor_rm.process_group_backend"  # torch.distributed's backend in the trial's workers
PRECISION_TAG = "anchor_rm.precision"  # the precision a trial's workers resolved for their device (fp32, bf16)
TUNE_NAME_TAG = "anchor_rm.tune_name"
REGISTERED_TAG = "anchor_rm.registered_version"
LAMBDA_RANGE_TAG = "anchor_rm.lambda_range"  # on the tune run: the search's lambda range (lambda_scale), as JSON
TRIALS_TAG = "anchor_rm.trials"  # on the tune run: how many trials the search ran
TRIALS_FAILED_TAG = "anchor_rm.trials_failed"  # ... and how many of them failed (tuning/main_job.py)
CATEGORY_TAG = "anchor_rm.category"
SEED_TAG = "anchor_rm.seed"
SETTING_TAG = "anchor_rm.setting"
MODEL_URI_TAG = "anchor_rm.model_uri"
EVALUATED_RUN_TAG = "anchor_rm.evaluated_run"
PARENT_TAG = "mlflow.parentRunId"
RUN_NAME_TAG = "mlflow.runName"

# Registry aliases (registry stages are deprecated and never used).
CHALLENGER = "challenger"
CHAMPION = "champion"
PREVIOUS_CHAMPION = "previous-champion"  # where a rollback goes back to

# Model version tags written by promotion.
PROMOTED_AT_TAG = "promoted_at"
PROMOTED_FROM_TAG = "promoted_from"
PROMOTION_FORCED_TAG = "promotion_forced"
ROLLED_BACK_AT_TAG = "rolled_back_at"
ROLLED_BACK_FROM_TAG = "rolled_back_from"
VERSION_RUN_TAG = "run_id"
REGISTRATION_KEY_TAG = "anchor_rm.registration_key"  # makes registration idempotent (registry.log_and_register)

# Artifacts.
REPORT_ARTIFACT = "report"
REPORT_JSON = f"{REPORT_ARTIFACT}/report.json"
MODEL_ARTIFACT = "model"  # the reward model folder a run logs; the pyfunc model in a registered version
REWARD_MODEL_ARTIFACT = "reward_model"  # the pyfunc's artifact key for the reward model folder
OUTPUTS_FILE = "outputs.json"  # a stage run's outputs (runs.stage_run)
DATA_DIGESTS_FILE = "data_digests.json"

TRAIN_STEP_KEYS = ("loss", "w2s_loss", "anchor_loss", "lr")
RESUMED_FROM_EPOCH_METRIC = "train/resumed_from_epoch"


def metric_name(text: str) -> str:
    """MLflow metric names allow letters, digits, _ - . / and space; dataset names mostly comply."""
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in text)


def cache_key(*parts: Any) -> str:
    """A stable digest of a stage's inputs (configs, data digests, upstream keys)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def step_metrics(entry, prefix: str = "train") -> dict[str, float]:
    """One training step (training.StepLog) as metrics."""
    return {f"{prefix}/loss": entry.loss, f"{prefix}/w2s_loss": entry.w2s_loss,
            f"{prefix}/anchor_loss": entry.anchor_loss, f"{prefix}/lr": entry.learning_rate}


def training_summary(result, n_pairs: int, identical_after_truncation: int | None = None) -> dict[str, float]:
    """What one training call (training.TrainResult) took."""
    out = {"train/pairs_per_second": result.pairs_seen / max(result.seconds, 1e-9), "train/seconds": result.seconds,
           "train/pairs": n_pairs}
    if identical_after_truncation is not None:
        out["train/identical_after_truncation"] = identical_after_truncation
    return out


def score_metrics(prefix: str, scores: Mapping) -> dict[str, float]:
    """Accuracy and size per data set (dataset -> metrics.SplitScore)."""
    out = {}
    for name, s in scores.items():
        out[f"{prefix}/acc/{metric_name(name)}"] = s.accuracy
        out[f"{prefix}/n/{metric_name(name)}"] = s.n_pairs
    return out


# The student's last-layer drift on the drift probe's student-train pairs after each epoch (drift.DriftProbe).
DRIFT_METRIC = "val/drift_last"


def validation_metrics(source: str, teacher_val: Mapping, student_scores: Mapping,
                       headline_targets: list[str] | None = None) -> dict[str, float]:
    """Accuracy per val set and NTS per OOD target against the teacher; the tuning objective, val/mean_nts,
    averages the headline targets (experiment.SharedStages.headline_targets; default all)."""
    from anchor_rm.evaluation.metrics import transfer_metrics

    tm = transfer_metrics({k: v.accuracy for k, v in teacher_val.items()},
                          {k: v.accuracy for k, v in student_scores.items()}, source,
                          headline_targets=headline_targets)
    out = {f"val/acc/{metric_name(k)}": v.accuracy for k, v in student_scores.items()}
    out.update({f"val/nts/{metric_name(k)}": v for k, v in tm.nts.items()})
    out.update({"val/wrg": tm.wrg, "val/mean_nts": tm.mean_nts})
    return out


def report_metrics(report, prefix: str = "test") -> dict[str, float]:
    """A report's figures (report.EvaluationReport) as metrics under `prefix`."""
    metrics = {f"{prefix}/wrg": report.wrg, f"{prefix}/mean_nts": report.mean_nts,
               f"{prefix}/id_acc": report.id_split.student_accuracy}
    metrics.update({f"{prefix}/acc/{metric_name(r.dataset)}": r.student_accuracy for r in report.splits})
    metrics.update({f"{prefix}/aog/{metric_name(k)}": v for k, v in report.aog.items()})
    metrics.update({f"{prefix}/nts/{metric_name(k)}": v for k, v in report.nts.items()})
    if report.pgr is not None:
        metrics[f"{prefix}/pgr"] = report.pgr
    return metrics


def data_count_metrics(counts: Mapping[str, Mapping]) -> dict[str, float]:
    """What cleaning kept and dropped per data set, and its split sizes (splits.ProtocolSplits.counts)."""
    out = {}
    for name, c in counts.items():
        out.update({f"{metric_name(name)}.{k}": v for k, v in c.items() if isinstance(v, int)})
        out.update({f"{metric_name(name)}.split.{k}": v for k, v in c["splits"].items()})
    return out


def evaluation_key(prefix: str, dataset: str) -> str:
    """A metric key for a data set named by a path or a hub name ("/tmp/x.jsonl" makes a poor metric name):
    the allowed characters, empty and dot segments dropped."""
    parts = [p for p in metric_name(dataset).split("/") if p not in ("", ".", "..")]
    return f"{prefix}/{'/'.join(parts) or '_'}"


def evaluation_metrics(report) -> dict[str, float]:
    """An evaluation report (pipelines/evaluate.py) as the metrics of its evaluation run."""
    metrics = {}
    for row in report.splits:
        metrics[evaluation_key("acc", row.dataset)] = row.student_accuracy
        metrics[evaluation_key("n", row.dataset)] = float(row.n_pairs)
        if row.teacher_accuracy is not None:
            metrics[evaluation_key("teacher_acc", row.dataset)] = row.teacher_accuracy
    metrics.update({evaluation_key("aog", k): v for k, v in report.aog.items()})
    metrics.update({evaluation_key("nts", k): v for k, v in report.nts.items()})
    for key in ("wrg", "mean_nts", "pgr"):
        if getattr(report, key) is not None:
            metrics[key] = getattr(report, key)
    return metrics
