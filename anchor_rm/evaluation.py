"""Any reward model on any preference data: the library side of pipelines/evaluate.py.

A model comes from the MLflow registry (models:/NAME@ALIAS, models:/NAME/VERSION), from a run
(runs:/RUN_ID/PATH) or from a local folder. Its teacher is known when the run that logged the model has the
tag anchor_rm.teacher_run (set by experiment.run_student) naming the teacher's stage run, which logged the
teacher as model/; or when the caller names one. A known teacher is scored on the same data, so the report
has teacher columns and AOG (and WRG and NTS when one data set is marked in-distribution).

Resolving a model talks to MLflow, because that is where versions live; loading data, scoring and building
the report are plain functions of their inputs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from anchor_rm.catalog import dataset_digest, load_dataset_pairs
from anchor_rm.data import DataError, PreferencePair, ReadStats
from anchor_rm.models import ModelError
from anchor_rm.report import EVALUATION, EvaluationReport, SplitResult, build_report
from anchor_rm.splits import CleanCounts, clean_pairs, subsample
from anchor_rm.tracking import metric_name
from anchor_rm.workflow import SCORER_CONFIG, RewardModel, evaluate_pairs

TEACHER_RUN_TAG = "anchor_rm.teacher_run"
EVALUATION_EXPERIMENT = "anchor-rm-evaluations"
WHOLE_SET = "all"  # the report's split for a data set scored as given, not a protocol split
REWARD_MODEL_ARTIFACT = "reward_model"  # registry.RewardModelPyfunc's artifact key
MODEL_FORMS = "models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/PATH or a local model folder"


# ---------------------------------------------------------------------------------------------------
# Data.

@dataclass
class EvaluationSet:
    """One data set as scored: cleaned pairs, what cleaning dropped, and a digest of exactly these pairs."""

    name: str
    pairs: list[PreferencePair]
    counts: CleanCounts
    skipped_invalid: int = 0  # records --skip-invalid passed over
    subsampled_from: int | None = None  # pairs before --max-pairs, when it cut
    digest: str = ""

    def summary(self) -> str:
        c = self.counts
        dropped = {"ties": c.ties, "empty": c.empty, "identical": c.identical, "conflicting": c.conflicting,
                   "duplicates": c.duplicates}
        text = f"data {self.name}: {c.total} pairs read, {c.kept} kept"
        reasons = ", ".join(f"{n} {reason}" for reason, n in dropped.items() if n)
        text += f" (dropped: {reasons})" if reasons else ""
        if self.skipped_invalid:
            text += f"; {self.skipped_invalid} invalid records skipped"
        if self.subsampled_from is not None:
            text += f"; {len(self.pairs)} of the {self.subsampled_from} sampled (--max-pairs)"
        return text


def load_evaluation_set(name: str, *, prompt_column: str = "prompt", chosen_column: str = "chosen",
                        rejected_column: str = "rejected", hub_split: str = "train", skip_invalid: bool = False,
                        max_pairs: int | None = None, seed: int = 0) -> EvaluationSet:
    """A catalog name, a file or a hub name (catalog.load_dataset_pairs), cleaned (splits.clean_pairs) and
    optionally cut to a seeded sample of max_pairs."""
    stats = ReadStats()
    raw = load_dataset_pairs(name, prompt_column=prompt_column, chosen_column=chosen_column,
                             rejected_column=rejected_column, split=hub_split, skip_invalid=skip_invalid, stats=stats)
    kept, counts = clean_pairs(raw)
    if not kept:
        raise DataError(f"dataset {name!r}: no pair left after cleaning ({counts.to_dict()})")
    before = None
    if max_pairs is not None and len(kept) > max_pairs:
        before, kept = len(kept), subsample(kept, max_pairs, seed, name)
    return EvaluationSet(name, kept, counts, stats.skipped, before, dataset_digest(kept))


# ---------------------------------------------------------------------------------------------------
# Scoring and the report.

def score_sets(student: RewardModel, sets: Sequence[EvaluationSet], *, teacher: RewardModel | None = None,
               id_name: str | None = None, batch_size: int = 32, precision: str = "auto") -> list[SplitResult]:
    """One report row per data set: the student's accuracy, the teacher's beside it when there is one.
    `id_name` marks the in-distribution set (role "id"); every other set is "ood"."""
    names = [s.name for s in sets]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"data sets must be distinct, repeated: {repeated}")
    if id_name is not None and id_name not in names:
        raise ValueError(f"the ID data set {id_name!r} is not among the data sets {names}")
    rows = []
    for s in sets:
        try:
            scored = evaluate_pairs(student, s.pairs, batch_size, precision=precision)
            teacher_scored = (evaluate_pairs(teacher, s.pairs, batch_size, precision=precision)
                              if teacher is not None else None)
        except ValueError as exc:
            raise ValueError(f"dataset {s.name!r}: {exc}") from None
        rows.append(SplitResult(
            dataset=s.name, role="id" if s.name == id_name else "ood", split=WHOLE_SET, n_pairs=scored.n_pairs,
            teacher_accuracy=None if teacher_scored is None else teacher_scored.accuracy,
            student_accuracy=scored.accuracy, ceiling_accuracy=None, student_tie_rate=scored.tie_rate,
        ))
    return rows


def evaluation_report(model_info: dict[str, Any], rows: list[SplitResult], sets: Sequence[EvaluationSet],
                      created_at: str | None = None) -> EvaluationReport:
    """An "evaluation" report: whole data sets (split "all"), selection unknown, a digest per set."""
    return build_report(model_info, rows, selection_splits="unknown", figure_splits=WHOLE_SET,
                        data_digests={s.name: s.digest for s in sets}, created_at=created_at, kind=EVALUATION)


# ---------------------------------------------------------------------------------------------------
# Models: where a URI or folder leads, and who taught it.

@dataclass(frozen=True)
class ResolvedModel:
    uri: str  # as the caller wrote it
    name: str  # what the report calls it: models:/NAME/VERSION, runs:/RUN_ID/PATH or the folder
    folder: Path  # the reward model: a transformers checkpoint, usually with anchor_rm.json
    registered_name: str | None = None
    version: str | None = None
    run_id: str | None = None  # the MLflow run that logged the model
    run_tags: dict[str, str] = field(default_factory=dict)
    run_params: dict[str, str] = field(default_factory=dict)
    # anchor_rm.json beside the weights (max length, base model, method, teacher), read at once: a
    # downloaded folder may be gone by the time the report is built.
    saved_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        path = self.folder / SCORER_CONFIG
        if not self.saved_info and path.is_file():
            object.__setattr__(self, "saved_info", json.loads(path.read_text()))


def reward_model_folder(path: str | Path) -> Path:
    """The reward model inside `path`: `path` itself when it is a transformers checkpoint (config.json), or
    the `reward_model` artifact of an MLflow pyfunc model folder (MLmodel), as registry.log_and_register
    logs it."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    if (path / "MLmodel").is_file():
        from mlflow.models import Model

        artifacts = Model.load(str(path)).flavors.get("python_function", {}).get("artifacts") or {}
        if REWARD_MODEL_ARTIFACT in artifacts:
            # The stored path keeps the source folder's name, not the key: read it from MLmodel.
            return reward_model_folder(path / artifacts[REWARD_MODEL_ARTIFACT]["path"])
        raise ModelError(f"{path}: an MLflow model without a {REWARD_MODEL_ARTIFACT!r} artifact "
                         f"(artifacts: {sorted(artifacts) or 'none'}); not an anchor-rm reward model")
    raise ModelError(f"{path}: neither a reward model folder (config.json) nor an MLflow model (MLmodel)")


_REGISTERED = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>[^/@]+))/?$")
_RUN = re.compile(r"^runs:/(?P<run_id>[^/]+)/(?P<path>.+?)/?$")


def resolve_model_uri(uri: str, download_dir: str | Path) -> ResolvedModel:
    """A registry URI, a run URI or a local folder -> the reward model folder (downloaded into
    download_dir when remote) and what MLflow knows of it."""
    download_dir = Path(download_dir)
    if uri.startswith("models:/"):
        return _resolve_registered(uri, download_dir)
    if uri.startswith("runs:/"):
        return _resolve_run(uri, download_dir)
    folder = Path(uri).expanduser()
    if folder.is_dir():
        return ResolvedModel(uri, uri, reward_model_folder(folder))
    if folder.exists():
        raise ModelError(f"model {uri!r} is a file, not a model folder; use {MODEL_FORMS}")
    raise ModelError(f"model {uri!r}: no such folder; use {MODEL_FORMS}")


def _mlflow_message(exc: Exception) -> str:
    return getattr(exc, "message", None) or str(exc)


def _registry_version(uri: str, name: str, alias: str | None, version: str | None) -> tuple[str, Any]:
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    try:
        registered = client.get_registered_model(name)
    except MlflowException as exc:
        raise ModelError(f"{uri}: no registered model {name!r} in the registry at {mlflow.get_registry_uri()} "
                         f"({_mlflow_message(exc)}); check --tracking-uri") from None
    numbers = sorted(int(v.version) for v in client.search_model_versions(f"name='{name}'"))
    if alias is not None:
        aliases = dict(registered.aliases or {})
        if alias not in aliases:
            known = ", ".join(f"@{a} (version {v})" for a, v in sorted(aliases.items())) or "none"
            raise ModelError(f"{uri}: registered model {name!r} has no alias {alias!r}; its aliases: {known}")
        version = str(aliases[alias])
    elif version == "latest":
        if not numbers:
            raise ModelError(f"{uri}: registered model {name!r} has no versions")
        version = str(numbers[-1])
    elif not version.isdigit():
        raise ModelError(f"{uri}: version {version!r} is not a number; use models:/NAME/VERSION or "
                         "models:/NAME@ALIAS (registry stages are not used)")
    try:
        return version, client.get_model_version(name, version)
    except MlflowException:
        raise ModelError(f"{uri}: registered model {name!r} has no version {version}; its versions: "
                         f"{', '.join(map(str, numbers)) or 'none'}") from None


def _run_details(run_id: str | None) -> tuple[dict[str, str], dict[str, str]]:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    if not run_id:
        return {}, {}
    try:
        run = MlflowClient().get_run(run_id)
    except MlflowException:
        return {}, {}  # the run was deleted; the model still loads
    return dict(run.data.tags), dict(run.data.params)


def _download(uri: str, destination: Path) -> Path:
    import mlflow
    from mlflow.exceptions import MlflowException

    destination.mkdir(parents=True, exist_ok=True)
    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(destination)))
    except (MlflowException, OSError) as exc:
        raise ModelError(f"{uri}: cannot download ({_mlflow_message(exc)})") from None


def _resolve_registered(uri: str, download_dir: Path) -> ResolvedModel:
    match = _REGISTERED.match(uri)
    if match is None:
        raise ModelError(f"model URI {uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    name = match["name"]
    version, model_version = _registry_version(uri, name, match["alias"], match["version"])
    tags, params = _run_details(model_version.run_id)
    local = _download(f"models:/{name}/{version}", download_dir / "model")
    return ResolvedModel(uri, f"models:/{name}/{version}", reward_model_folder(local), name, version,
                         model_version.run_id, tags, params)


def _resolve_run(uri: str, download_dir: Path) -> ResolvedModel:
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    match = _RUN.match(uri)
    if match is None:
        raise ModelError(f"model URI {uri!r}: expected runs:/RUN_ID/PATH, e.g. runs:/0123abcd/model")
    try:
        MlflowClient().get_run(match["run_id"])
    except MlflowException as exc:
        raise ModelError(f"{uri}: no run {match['run_id']!r} at {mlflow.get_tracking_uri()} "
                         f"({_mlflow_message(exc)}); check --tracking-uri") from None
    tags, params = _run_details(match["run_id"])
    local = _download(uri, download_dir / "model")
    return ResolvedModel(uri, f"runs:/{match['run_id']}/{match['path']}", reward_model_folder(local), None, None,
                         match["run_id"], tags, params)


def find_teacher(model: ResolvedModel, download_dir: str | Path) -> tuple[ResolvedModel | None, str]:
    """The teacher of a model an anchor-rm run logged, downloaded, and a line saying where it came from
    or why there is none (the evaluation then has no teacher columns)."""
    if model.run_id is None:
        return None, "no teacher: the model was not logged in an MLflow run (--teacher names one)"
    teacher_run = model.run_tags.get(TEACHER_RUN_TAG)
    if not teacher_run:
        return None, f"no teacher: run {model.run_id} has no {TEACHER_RUN_TAG} tag (--teacher names one)"
    uri = f"runs:/{teacher_run}/model"
    try:
        teacher = resolve_model_uri(uri, Path(download_dir) / "teacher")
    except ModelError as exc:
        return None, f"no teacher: the teacher run named by {TEACHER_RUN_TAG} has no usable model/ artifact ({exc})"
    return teacher, f"teacher: {uri} (tag {TEACHER_RUN_TAG} of run {model.run_id})"


def model_info(model: ResolvedModel, teacher: ResolvedModel | None, run_id: str | None,
               precision: str | None = None) -> dict[str, Any]:
    """The report's `model` section: what was evaluated, from anchor_rm.json and the logging run."""
    saved, params = model.saved_info, model.run_params
    return {
        "name": model.name,
        "student": saved.get("base_model") or params.get("student") or model.name,
        # The teacher that was scored; else the teacher's name as recorded (its accuracies stay null).
        "teacher": teacher.name if teacher else saved.get("teacher") or params.get("teacher"),
        "method": saved.get("method") or model.run_tags.get("anchor_rm.method") or "unknown",
        "hyperparameters": {k.removeprefix("train."): v for k, v in sorted(params.items()) if k.startswith("train.")},
        "run_id": run_id,
        **({"precision": precision} if precision else {}),
    }


def training_source(model: ResolvedModel) -> str | None:
    """The data set the model was trained on, when its run recorded one (train.py logs `source`)."""
    return model.run_params.get("source")


# ---------------------------------------------------------------------------------------------------
# What an evaluation run records.

def _metric_key(prefix: str, dataset: str) -> str:
    # File paths make poor metric names ("/tmp/x.jsonl"): keep the allowed characters, drop empty segments.
    parts = [p for p in metric_name(dataset).split("/") if p not in ("", ".", "..")]
    return f"{prefix}/{'/'.join(parts) or '_'}"


def run_params(model: ResolvedModel, teacher: ResolvedModel | None, sets: Sequence[EvaluationSet],
               id_name: str | None) -> dict[str, str]:
    params = {"model_uri": model.uri, "model": model.name, "registered_model": model.registered_name or "",
              "model_version": model.version or "", "model_run": model.run_id or "",
              "teacher": teacher.name if teacher else "", "id_data": id_name or "",
              "data": ",".join(s.name for s in sets)}
    for index, s in enumerate(sets, 1):
        params.update({f"data.{index}.name": s.name, f"data.{index}.digest": s.digest,
                       f"data.{index}.pairs": str(len(s.pairs))})
    return {k: v[:6000] for k, v in params.items()}


def run_tags(model: ResolvedModel, teacher: ResolvedModel | None) -> dict[str, str]:
    tags = {"anchor_rm.stage": "evaluation", "anchor_rm.model_uri": model.name}
    if model.run_id:
        tags["anchor_rm.evaluated_run"] = model.run_id
    if teacher is not None and teacher.run_id:
        tags[TEACHER_RUN_TAG] = teacher.run_id
    return tags


def report_metrics(report: EvaluationReport) -> dict[str, float]:
    metrics = {}
    for row in report.splits:
        metrics[_metric_key("acc", row.dataset)] = row.student_accuracy
        metrics[_metric_key("n", row.dataset)] = float(row.n_pairs)
        if row.teacher_accuracy is not None:
            metrics[_metric_key("teacher_acc", row.dataset)] = row.teacher_accuracy
    metrics.update({_metric_key("aog", k): v for k, v in report.aog.items()})
    metrics.update({_metric_key("nts", k): v for k, v in report.nts.items()})
    for key in ("wrg", "mean_nts", "pgr"):
        if getattr(report, key) is not None:
            metrics[key] = getattr(report, key)
    return metrics
