"""The MLflow model registry: registration of a selected model with its report, reading a version's report
and tags back, and the aliases promotion moves (`challenger`, `champion`, `previous-champion`); registry
stages are deprecated and never used.

Each registered version carries its evaluation report three ways: the files (report/report.{json,md,png})
inside the logged model and in its run, the headline figures as version tags, and a description.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlflow

from anchor_rm.evaluation import keys
from anchor_rm.evaluation.report import EvaluationReport
from anchor_rm.evaluation.report_files import read_report, write_report
from anchor_rm.evaluation.report_summary import describe, headline_tags
from anchor_rm.mlflow_edge import model_package, store
from anchor_rm.mlflow_edge.runs import artifact_writes

log = logging.getLogger("anchor_rm")


def default_model_name(category: str) -> str:
    return f"anchor-rm-{category}"


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str
    run_id: str
    model_uri: str


def log_and_register(model_folder: str | Path, report: EvaluationReport, name: str,
                     extra_artifacts: dict[str, str] | None = None, registration_key: str | None = None) -> RegisteredVersion:
    """Inside the active run: log the report and the pyfunc model, register a new version of `name`,
    tag and describe it, and point the `challenger` alias at it.

    `registration_key` makes registration idempotent: the version is created with the key as a tag (in the
    same call, so a version never exists without it), and when a version of `name` with this key exists
    already (a run killed after registering, then resumed), that version is completed (description, run tag,
    alias) and returned instead of registering a second one. tune.py passes its tune run's id."""
    run = mlflow.active_run()
    if run is None:
        raise RuntimeError("log_and_register needs an active MLflow run")
    if registration_key is not None:
        existing = find_version(name, keys.REGISTRATION_KEY_TAG, registration_key)
        if existing is not None:
            log.info("%s version %s was registered for %s already: completing it, not registering again",
                     name, existing.version, registration_key)
            return _complete(name, str(existing.version), existing.run_id, report, delete_on_failure=False)
    with tempfile.TemporaryDirectory() as tmp, artifact_writes():
        report_dir = Path(tmp) / keys.REPORT_ARTIFACT
        write_report(report, report_dir)
        for filename, path in (extra_artifacts or {}).items():
            (report_dir / filename).write_bytes(Path(path).read_bytes())
        mlflow.log_artifacts(str(report_dir), keys.REPORT_ARTIFACT)
        info = model_package.log_pyfunc(model_folder, report_dir)
    # Everything above wrote files (a full disk or an unwritable artifact location fails there, before any
    # version exists); a version is created only once its model and report are complete.
    tags = headline_tags(report)
    if registration_key is not None:
        tags[keys.REGISTRATION_KEY_TAG] = registration_key
    version = mlflow.register_model(info.model_uri, name, tags=tags)
    return _complete(name, str(version.version), run.info.run_id, report, delete_on_failure=True)


def _complete(name: str, version: str, run_id: str, report: EvaluationReport, delete_on_failure: bool) -> RegisteredVersion:
    """Description, run tag and the challenger alias: what makes a registered version complete."""
    client = store.client()
    try:
        client.update_model_version(name, version, description=describe(report))
        client.set_model_version_tag(name, version, keys.VERSION_RUN_TAG, run_id)
        client.set_registered_model_alias(name, keys.CHALLENGER, version)
    except BaseException:
        if delete_on_failure:  # a version without its description, run tag or alias is half-written
            try:
                client.delete_model_version(name, version)
            except Exception as exc:
                log.error("could not remove the half-written version %s/%s (promote.py --check --repair "
                          "removes it): %s", name, version, exc)
        raise
    return RegisteredVersion(name, version, run_id, f"models:/{name}/{version}")


def find_version(name: str, tag: str, value: str):
    """The newest version of `name` whose tag `tag` is `value` (MLflow's ModelVersion), or None."""
    try:
        versions = store.client().search_model_versions(f"name='{name}'")
    except store.TrackingError as exc:
        if store.not_found(exc):
            return None
        raise
    matching = [v for v in versions if (v.tags or {}).get(tag) == value]
    return max(matching, key=lambda v: int(v.version)) if matching else None


def incomplete_versions(name: str) -> list[tuple[str, str]]:
    """(version, what is missing) for each version of `name` that lacks what log_and_register writes: a
    readable report in its run, the run tag, the description. Such a version is left by a process killed
    mid-registration whose cleanup could not reach the store."""
    found = []
    for mv in sorted(store.client().search_model_versions(f"name='{name}'"), key=lambda v: int(v.version)):
        missing = []
        if not (mv.tags or {}).get(keys.VERSION_RUN_TAG):
            missing.append(f"the {keys.VERSION_RUN_TAG} tag")
        if not mv.description:
            missing.append("the description")
        try:
            if version_report(name, str(mv.version)) is None:
                missing.append(f"{keys.REPORT_JSON} in its run")
        except ValueError as exc:
            missing.append(f"a valid report ({str(exc)[:200]})")
        if missing:
            found.append((str(mv.version), ", ".join(missing)))
    return found


def delete_version(name: str, version: str) -> None:
    store.client().delete_model_version(name, version)


def version_report(name: str, version: str) -> EvaluationReport | None:
    """The report a version carries, or None when it has none."""
    mv = store.client().get_model_version(name, version)
    if not mv.run_id:
        return None
    with tempfile.TemporaryDirectory() as tmp:  # without dst_path MLflow leaves a new folder in /tmp
        try:
            path = mlflow.artifacts.download_artifacts(run_id=mv.run_id, artifact_path=keys.REPORT_JSON, dst_path=tmp)
        except Exception:  # no such artifact: MLflow raises different types per store
            return None
        return read_report(path)


def download_version_report(name: str, version: str, into: Path) -> Path | None:
    """report.json of the run that registered the version, downloaded into `into`; None without a run."""
    run_id = store.client().get_model_version(name, version).run_id
    if not run_id:
        return None
    return Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=keys.REPORT_JSON, dst_path=str(into)))


# ---------------------------------------------------------------------------------------------------
# Versions, tags and aliases.

def read_aliases(name: str) -> dict[str, str]:
    """All aliases of `name` in one read: {alias: version}. Raises store.TrackingError (see store.not_found)
    when there is no such registered model."""
    model = store.client().get_registered_model(name)
    return {alias: str(version) for alias, version in model.aliases.items()}


def version_status(name: str, version: str) -> str:
    """READY, PENDING_REGISTRATION or FAILED_REGISTRATION; store.TrackingError when there is no such version."""
    return store.client().get_model_version(name, str(version)).status


def version_tags(name: str, version: str) -> dict[str, str]:
    return dict(store.client().get_model_version(name, str(version)).tags or {})


def version_numbers(name: str) -> list[int]:
    return sorted(int(v.version) for v in store.client().search_model_versions(f"name='{name}'"))


def current_version(uri: str) -> str | None:
    """The version a models:/ URI names in the registry now (an alias is looked up, `latest` is the
    newest); None when the URI is fixed (a version number, a run, a folder) and so never moves."""
    parsed = model_package.parse_registry_uri(uri)
    if parsed is None:
        return None
    name, alias, version = parsed
    if alias is not None:
        return str(store.client().get_model_version_by_alias(name, alias).version)
    if version == "latest":
        return str(max(version_numbers(name)))
    return None


def set_alias(name: str, alias: str, version: str) -> None:
    store.client().set_registered_model_alias(name, alias, version)


def set_version_tag(name: str, version: str, key: str, value: str) -> None:
    store.client().set_model_version_tag(name, version, key, value)
