"""The registered model's layout, written and read in one place.

A registered version is an MLflow pyfunc model (`RewardModelPyfunc`) whose artifacts are the reward model
folder (`reward_model`: a transformers checkpoint with anchor_rm.json) and the evaluation report
(`report`: report.json, .md, .png). This module writes that layout's pyfunc, finds the reward model and the
report inside a downloaded model folder, and resolves a models:/ or runs:/ URI (or a local folder) to a
local reward model folder with what MLflow knows of it.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.models import Model, ModelSignature
from mlflow.types import ColSpec, Schema

from anchor_rm.evaluation.keys import REPORT_ARTIFACT, REWARD_MODEL_ARTIFACT
from anchor_rm.mlflow_edge import store
from anchor_rm.model.loading import SCORER_CONFIG, ModelError

MODEL_FORMS = "models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/PATH or a local model folder"

SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "prompt"), ColSpec("string", "response")]),
    outputs=Schema([ColSpec("double", "reward"), ColSpec("boolean", "truncated"),
                    ColSpec("double", "ood_score", required=False), ColSpec("boolean", "in_domain", required=False)]),
)
INPUT_EXAMPLE = pd.DataFrame(
    {"prompt": ["How do I boil an egg?"], "response": ["Put it in boiling water for 8 to 10 minutes."]}
)


class RewardModelPyfunc(mlflow.pyfunc.PythonModel):
    """`mlflow.pyfunc.load_model("models:/anchor-rm-harmless@champion").predict(df)` with columns prompt and
    response returns a reward per row (and whether the row was truncated to the model's max length), and where the
    version has an OOD flag (anchor_rm/model/ood_flag.py), its ood_score and in_domain."""

    def load_context(self, context):
        from anchor_rm.model.reward_model import load_saved

        self.reward_model = load_saved(context.artifacts[REWARD_MODEL_ARTIFACT])
        self.scorer = self.reward_model.scorer()

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        missing = {"prompt", "response"} - set(model_input.columns)
        if missing:
            raise ValueError(f"input DataFrame needs the columns prompt and response; missing {sorted(missing)}")
        scored = self.scorer.score(model_input["prompt"].astype(str).tolist(), model_input["response"].astype(str).tolist())
        flag = {} if scored.ood_scores is None else {"ood_score": scored.ood_scores, "in_domain": scored.in_domain}
        return pd.DataFrame({"reward": scored.rewards, "truncated": scored.truncated, **flag})


# What a registered version needs to load and score, pinned to the versions it was logged with: the packages the
# reward model and the scorer import (anchor_rm itself ships in the model's code_paths, not as a requirement).
MODEL_REQUIREMENTS = ("torch", "transformers", "tokenizers", "safetensors", "peft", "numpy", "pandas", "pyarrow", "scipy",
                      "jsonschema", "mlflow")
# anchor_rm's own files that a version carries: the Python code and the report schema, not the shipped datasets.
_CODE_FILES = ("*.py", "report_schema.json")


def requirements() -> list[str]:
    """The pip requirements a registered version records: MODEL_REQUIREMENTS at the installed versions (a local
    build label such as torch's +cpu dropped: which build pip takes follows its index)."""
    import importlib.metadata as md

    return [f"{name}=={md.version(name).split('+')[0]}" for name in MODEL_REQUIREMENTS]


def package_code(into: Path) -> Path:
    """A copy of the anchor_rm package's code (no data) under `into`/anchor_rm, for the model's code_paths."""
    source = Path(__file__).resolve().parents[1]
    target = Path(into) / "anchor_rm"
    for pattern in _CODE_FILES:
        for path in source.rglob(pattern):
            if "__pycache__" in path.parts or "shipped_data" in path.relative_to(source).parts:
                continue
            destination = target / path.relative_to(source)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination)
    return target


def log_pyfunc(model_folder: str | Path, report_folder: str | Path):
    """Logs the pyfunc model (reward model + report as artifacts) in the active run, as models from code
    (anchor_rm/mlflow_edge/pyfunc_model.py) with the anchor_rm package as code_paths; MLflow's ModelInfo."""
    with tempfile.TemporaryDirectory(prefix="anchor-rm-code-") as staging:
        return mlflow.pyfunc.log_model(
            name="model",
            python_model=str(Path(__file__).with_name("pyfunc_model.py")),
            code_paths=[str(package_code(Path(staging)))],
            artifacts={REWARD_MODEL_ARTIFACT: str(model_folder), REPORT_ARTIFACT: str(report_folder)},
            signature=SIGNATURE,
            input_example=INPUT_EXAMPLE,
            pip_requirements=requirements(),
        )


def _pyfunc_artifacts(folder: Path) -> dict:
    return Model.load(str(folder)).flavors.get("python_function", {}).get("artifacts") or {}


def reward_model_folder(path: str | Path) -> Path:
    """The reward model inside `path`: `path` itself when it is a transformers checkpoint (config.json), or
    the `reward_model` artifact of an MLflow pyfunc model folder (MLmodel), as registry.log_and_register
    logs it."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    if (path / "MLmodel").is_file():
        artifacts = _pyfunc_artifacts(path)
        if REWARD_MODEL_ARTIFACT in artifacts:
            # The stored path keeps the source folder's name, not the key: read it from MLmodel.
            return reward_model_folder(path / artifacts[REWARD_MODEL_ARTIFACT]["path"])
        raise ModelError(f"{path}: an MLflow model without a {REWARD_MODEL_ARTIFACT!r} artifact "
                         f"(artifacts: {sorted(artifacts) or 'none'}); not an anchor-rm reward model")
    raise ModelError(f"{path}: neither a reward model folder (config.json) nor an MLflow model (MLmodel)")


def find_report(folder: Path) -> Path | None:
    """report/report.json inside the pyfunc model that holds the reward model `folder`, or beside a plain
    model folder; None when there is none."""
    for candidate in (folder, *list(folder.parents)[:3]):
        if (candidate / "MLmodel").is_file():
            artifacts = _pyfunc_artifacts(candidate)
            if REPORT_ARTIFACT in artifacts:
                path = candidate / artifacts[REPORT_ARTIFACT]["path"] / "report.json"
                return path if path.is_file() else None
            return None
    path = folder / REPORT_ARTIFACT / "report.json"
    return path if path.is_file() else None


# ---------------------------------------------------------------------------------------------------
# URIs.

_REGISTERED = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>[^/@]+))/?$")
_RUN = re.compile(r"^runs:/(?P<run_id>[^/]+)/(?P<path>.+?)/?$")


def parse_registry_uri(uri: str) -> tuple[str, str | None, str | None] | None:
    """models:/NAME@ALIAS or models:/NAME/VERSION -> (name, alias, version); None for other URIs."""
    match = _REGISTERED.match(uri)
    if match is None:
        return None
    return match["name"], match["alias"], match["version"]


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


def _registered_models_there(client) -> str:
    """What the registry holds, for an error that names a model it lacks (e.g. the smoke preset registers
    anchor-rm-helpful while the service asks for anchor-rm-harmless)."""
    try:
        found = client.search_registered_models(max_results=20)
    except store.TrackingError:
        return "check --tracking-uri"
    if not found:
        return "it holds no registered models yet: run the main job (pipelines/tune.py), or check --tracking-uri"
    names = ", ".join(f"{m.name} ({', '.join('@' + a for a in sorted(m.aliases or {})) or 'no aliases'})"
                      for m in found)
    return f"it holds: {names}"


def _registry_version(uri: str, name: str, alias: str | None, version: str | None) -> tuple[str, Any]:
    client = store.client()
    try:
        registered = client.get_registered_model(name)
    except store.TrackingError as exc:
        raise ModelError(f"{uri}: no registered model {name!r} in the registry at {store.registry_uri()} "
                         f"({store.message(exc)}); {_registered_models_there(client)}") from None
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
    except store.TrackingError:
        raise ModelError(f"{uri}: registered model {name!r} has no version {version}; its versions: "
                         f"{', '.join(map(str, numbers)) or 'none'}") from None


def run_details(run_id: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """(tags, params) of a run; empty when there is no run or it was deleted (the model still loads)."""
    if not run_id:
        return {}, {}
    try:
        run = store.client().get_run(run_id)
    except store.TrackingError:
        return {}, {}
    return dict(run.data.tags), dict(run.data.params)


def download(uri: str, destination: Path) -> Path:
    destination.mkdir(parents=True, exist_ok=True)
    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(destination)))
    except (store.TrackingError, OSError) as exc:
        raise ModelError(f"{uri}: cannot download ({store.message(exc)})") from None


def _resolve_registered(uri: str, download_dir: Path) -> ResolvedModel:
    parsed = parse_registry_uri(uri)
    if parsed is None:
        raise ModelError(f"model URI {uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    name, alias, version = parsed
    version, model_version = _registry_version(uri, name, alias, version)
    tags, params = run_details(model_version.run_id)
    local = download(f"models:/{name}/{version}", download_dir / "model")
    return ResolvedModel(uri, f"models:/{name}/{version}", reward_model_folder(local), name, version,
                         model_version.run_id, tags, params)


def _resolve_run(uri: str, download_dir: Path) -> ResolvedModel:
    match = _RUN.match(uri)
    if match is None:
        raise ModelError(f"model URI {uri!r}: expected runs:/RUN_ID/PATH, e.g. runs:/0123abcd/model")
    try:
        store.client().get_run(match["run_id"])
    except store.TrackingError as exc:
        raise ModelError(f"{uri}: no run {match['run_id']!r} at {store.tracking_uri()} "
                         f"({store.message(exc)}); check --tracking-uri") from None
    tags, params = run_details(match["run_id"])
    local = download(uri, download_dir / "model")
    return ResolvedModel(uri, f"runs:/{match['run_id']}/{match['path']}", reward_model_folder(local), None, None,
                         match["run_id"], tags, params)
