"""MLflow at the edge: where runs go, and stage runs that are reused when their inputs are unchanged.

The library's stages know nothing of MLflow; the pipelines call them and record what they did here.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlflow
from mlflow.tracking import MlflowClient

STAGE_TAG = "anchor_rm.stage"
CACHE_KEY_TAG = "anchor_rm.cache_key"
OUTPUTS_FILE = "outputs.json"
DEFAULT_DB = "mlflow.db"


def resolve_tracking_uri(cli_value: str | None) -> str:
    """--tracking-uri, else $MLFLOW_TRACKING_URI, else SQLite in the working directory."""
    if cli_value:
        return cli_value
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path.cwd() / DEFAULT_DB}"


def configure(tracking_uri: str | None, experiment: str) -> str:
    """Points MLflow at the tracking store and experiment; returns the experiment id."""
    uri = resolve_tracking_uri(tracking_uri)
    mlflow.set_tracking_uri(uri)
    if uri.startswith("sqlite:") and not os.environ.get("MLFLOW_REGISTRY_URI"):
        mlflow.set_registry_uri(uri)
    existing = mlflow.get_experiment_by_name(experiment)
    if existing is None and uri.startswith("sqlite:///"):
        # Keep artifacts beside the database rather than in whatever directory the command ran from.
        artifacts = Path(uri[len("sqlite:///"):]).resolve().parent / "mlartifacts"
        mlflow.create_experiment(experiment, artifact_location=artifacts.as_uri())
    return mlflow.set_experiment(experiment).experiment_id


def cache_key(*parts: Any) -> str:
    """A stable digest of a stage's inputs (configs, data digests, upstream keys)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class StageRun:
    run_id: str
    outputs: dict
    reused: bool


def find_stage_run(experiment_id: str, stage: str, key: str) -> str | None:
    runs = MlflowClient().search_runs(
        [experiment_id],
        filter_string=f"tags.`{STAGE_TAG}` = '{stage}' and tags.`{CACHE_KEY_TAG}` = '{key}' and attributes.status = 'FINISHED'",
        max_results=1,
        order_by=["attributes.start_time DESC"],
    )
    return runs[0].info.run_id if runs else None


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
        run_id = find_stage_run(experiment_id, stage, key)
        if run_id is not None:
            path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=OUTPUTS_FILE)
            return StageRun(run_id, json.loads(Path(path).read_text()), reused=True)
    with mlflow.start_run(run_name=stage, nested=mlflow.active_run() is not None) as run:
        mlflow.set_tags({STAGE_TAG: stage, CACHE_KEY_TAG: key, **(tags or {})})
        if params:
            mlflow.log_params(flatten_params(params))
        outputs = compute()
        log_json(outputs, OUTPUTS_FILE)
    return StageRun(run.info.run_id, outputs, reused=False)


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


def metric_name(text: str) -> str:
    """MLflow metric names allow letters, digits, _ - . / and space; dataset names mostly comply."""
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in text)
