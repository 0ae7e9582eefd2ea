"""MLflow runs: stage runs cached on the digest of their inputs, the active run's logging, the trial runs
Tune opens, and the metric sinks the library's training writes through."""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import mlflow
from mlflow.entities import Param, RunStatus

from anchor_rm.evaluation import keys
from anchor_rm.mlflow_edge import store


@dataclass(frozen=True)
class StageRun:
    run_id: str
    outputs: dict
    reused: bool


def stage_run(
    experiment_id: str,
    stage: str,
    key: str,
    compute: Callable[[], dict],
    *,
    params: dict | None = None,
    tags: dict | None = None,
    force: bool = False,
) -> StageRun:
    """Runs `compute` inside a new MLflow run tagged (stage, key), unless a finished run with the same
    tags exists: then its outputs.json is read back and nothing is recomputed.

    `compute` runs with the stage run active, so it may log metrics and artifacts (a model, files);
    whatever it returns (JSON-serialisable) is stored as outputs.json and handed back.
    """
    if not force:
        run_id = find_run(experiment_id, {keys.STAGE_TAG: stage, keys.CACHE_KEY_TAG: key}, finished_only=True)
        if run_id is not None:
            with tempfile.TemporaryDirectory() as tmp:  # without dst_path MLflow leaves a new folder in /tmp
                path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=keys.OUTPUTS_FILE, dst_path=tmp)
                return StageRun(run_id, json.loads(Path(path).read_text()), reused=True)
    with mlflow.start_run(run_name=stage, nested=mlflow.active_run() is not None) as run:
        mlflow.set_tags({keys.STAGE_TAG: stage, keys.CACHE_KEY_TAG: key, **(tags or {})})
        if params:
            mlflow.log_params(flatten_params(params))
        outputs = compute()
        log_json(outputs, keys.OUTPUTS_FILE)
    return StageRun(run.info.run_id, outputs, reused=False)


# ---------------------------------------------------------------------------------------------------
# The active run.

@contextmanager
def start_run(*, run_id: str | None = None, run_name: str | None = None, experiment_id: str | None = None,
              nested: bool = False) -> Iterator[str]:
    """An MLflow run made active for the block (a new one, or `run_id` again); yields its id."""
    with mlflow.start_run(run_id=run_id, run_name=run_name, experiment_id=experiment_id, nested=nested) as run:
        yield run.info.run_id


def set_tags(tags: dict[str, Any]) -> None:
    mlflow.set_tags(tags)


def log_params(params: dict[str, Any]) -> None:
    mlflow.log_params(flatten_params(params))


def log_metrics(metrics: dict[str, float], step: int | None = None) -> None:
    mlflow.log_metrics(metrics, step=step)


def run_tag(run_id: str, key: str) -> str | None:
    return store.client().get_run(run_id).data.tags.get(key)


@contextmanager
def artifact_writes():
    """A failed artifact write (disk full, read-only or unwritable folder) often says only "No space left on
    device"; name the active run's artifact location in it."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and mlflow.active_run() is not None:
            raise OSError(exc.errno, exc.strerror or str(exc), mlflow.get_artifact_uri()) from exc
        raise


def log_json(obj: Any, artifact_file: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, artifact_writes():
        path = Path(tmp) / Path(artifact_file).name
        path.write_text(json.dumps(obj, indent=2, sort_keys=True))
        parent = str(Path(artifact_file).parent)
        mlflow.log_artifact(str(path), None if parent == "." else parent)


def log_files(paths, artifact_path: str) -> None:
    """Each file in `paths` into the active run's `artifact_path`."""
    with artifact_writes():
        for path in paths:
            mlflow.log_artifact(str(path), artifact_path)


def log_folder(folder: str | Path, artifact_path: str) -> None:
    with artifact_writes():
        mlflow.log_artifacts(str(folder), artifact_path)


def log_reward_model(rm, extra: dict | None = None, artifact_path: str = keys.MODEL_ARTIFACT) -> None:
    """A reward model (reward_model.RewardModel) saved as a folder into the active run."""
    from anchor_rm.model.reward_model import save_reward_model

    with tempfile.TemporaryDirectory() as tmp:
        log_folder(save_reward_model(rm, Path(tmp) / "model", extra), artifact_path)


def log_report(report, artifact_path: str = keys.REPORT_ARTIFACT) -> None:
    """A report's files (JSON, Markdown, PNG) and its test figures as metrics, into the active run."""
    from anchor_rm.evaluation.report_files import write_report

    with tempfile.TemporaryDirectory() as tmp, artifact_writes():
        write_report(report, tmp)
        mlflow.log_artifacts(tmp, artifact_path)
    mlflow.log_metrics(keys.report_metrics(report))


def flatten_params(params: dict, prefix: str = "") -> dict[str, str]:
    """Nested dicts -> dotted keys; values as strings cut to MLflow's 6000-character limit."""
    flat = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_params(value, name + "."))
        else:
            flat[name] = str(value)[:6000]
    return flat


class ActiveRunSink:
    """A metric sink (training.MetricSink) writing to the active MLflow run."""

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        mlflow.log_metrics(metrics, step=step)


# ---------------------------------------------------------------------------------------------------
# Runs made by id, without an active run: the tune parent run and Tune's trial runs.

def find_run(experiment_id: str, tags: dict[str, str], *, finished_only: bool = False,
             tracking_uri: str | None = None) -> str | None:
    """The newest run of the experiment carrying every tag in `tags` (only FINISHED ones with
    `finished_only`); None when there is none."""
    where = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    if finished_only:
        where += " and attributes.status = 'FINISHED'"
    runs = store.client(tracking_uri).search_runs([experiment_id], filter_string=where, max_results=1,
                                                  order_by=["attributes.start_time DESC"])
    return runs[0].info.run_id if runs else None


def create_run(experiment_id: str, tags: dict[str, str], run_name: str | None = None,
               params: dict[str, Any] | None = None, tracking_uri: str | None = None) -> str:
    client = store.client(tracking_uri)
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    if params:
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in flatten_params(params).items()])
    return run.info.run_id


def trial_run(tracking_uri: str, experiment_id: str, parent_run_id: str, trial_id: str, trial_name: str,
              tags: dict[str, str], params: dict[str, Any]) -> str:
    """A Tune trial's child run of the tune run: created on the trial's first start, found again (and set
    RUNNING) when the trial restarts or the experiment resumes, so a trial never has two runs."""
    client = store.client(tracking_uri)
    run_id = find_trial_run(tracking_uri, experiment_id, parent_run_id, trial_id)
    if run_id is not None:
        client.update_run(run_id, status="RUNNING")
        return run_id
    tags = {keys.PARENT_TAG: parent_run_id, keys.TRIAL_TAG: trial_id, keys.RUN_NAME_TAG: trial_name,
            keys.STAGE_TAG: "trial", **tags}
    return create_run(experiment_id, tags, params=params, tracking_uri=tracking_uri)


def find_trial_run(tracking_uri: str, experiment_id: str, parent_run_id: str, trial_id: str) -> str | None:
    return find_run(experiment_id, {keys.PARENT_TAG: parent_run_id, keys.TRIAL_TAG: trial_id}, tracking_uri=tracking_uri)


def end_run(tracking_uri: str, run_id: str, failed: bool, note: str) -> None:
    """Closes a run made by id: FINISHED or FAILED, with a note saying how it ended."""
    client = store.client(tracking_uri)
    client.set_tag(run_id, keys.TRIAL_OUTCOME_TAG, note[:5000])
    status = RunStatus.FAILED if failed else RunStatus.FINISHED
    client.set_terminated(run_id, status=RunStatus.to_string(status))


def set_run_tag(tracking_uri: str, run_id: str, key: str, value: str) -> None:
    store.client(tracking_uri).set_tag(run_id, key, value)
