"""The MLflow model registry at the edge: a pyfunc that scores prompt/response pairs through the library's
one scoring path, registration of a selected model with its report, and reading a version's report back.

Each registered version carries its evaluation report three ways: the files (report/report.{json,md,png})
inside the logged model and in its run, the headline figures as version tags, and a description. Promotion
moves aliases (`challenger`, `champion`); registry stages are deprecated and never used.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types import ColSpec, Schema

from anchor_rm.report import EvaluationReport
from anchor_rm.report_files import read_report, write_report
from anchor_rm.tracking import artifact_writes

log = logging.getLogger("anchor_rm")

CHALLENGER = "challenger"
CHAMPION = "champion"
PREVIOUS_CHAMPION = "previous-champion"  # where --rollback goes back to
REPORT_ARTIFACT = "report"
REPORT_JSON = f"{REPORT_ARTIFACT}/report.json"

SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "prompt"), ColSpec("string", "response")]),
    outputs=Schema([ColSpec("double", "reward"), ColSpec("boolean", "truncated")]),
)
INPUT_EXAMPLE = pd.DataFrame(
    {"prompt": ["How do I boil an egg?"], "response": ["Put it in boiling water for 8 to 10 minutes."]}
)


def default_model_name(category: str) -> str:
    return f"anchor-rm-{category}"


class RewardModelPyfunc(mlflow.pyfunc.PythonModel):
    """`mlflow.pyfunc.load_model("models:/anchor-rm-helpful@champion").predict(df)` with columns prompt and
    response returns a reward per row (and whether the row was truncated to the model's max length)."""

    def load_context(self, context):
        from anchor_rm.workflow import load_saved

        self.reward_model = load_saved(context.artifacts["reward_model"])
        self.scorer = self.reward_model.scorer()

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        missing = {"prompt", "response"} - set(model_input.columns)
        if missing:
            raise ValueError(f"input DataFrame needs the columns prompt and response; missing {sorted(missing)}")
        scored = self.scorer.score(model_input["prompt"].astype(str).tolist(), model_input["response"].astype(str).tolist())
        return pd.DataFrame({"reward": scored.rewards, "truncated": scored.truncated})


def headline_tags(report: EvaluationReport) -> dict[str, str]:
    """The figures a registry browser shows without opening the report."""
    tags = {
        "mean_nts": f"{report.mean_nts:.2f}",
        "wrg": f"{report.wrg:.2f}",
        "id_accuracy": f"{report.id_split.student_accuracy:.2f}",
        "teacher_id_accuracy": f"{report.id_split.teacher_accuracy:.2f}",
        "method": str(report.model.get("method")),
        "figure_splits": report.figure_splits,
        "selection_splits": report.selection_splits,
        "test_splits_digest": test_splits_digest(report),
    }
    if report.validation is not None:  # what promotion compares
        tags["val_mean_nts"] = f"{report.validation['mean_nts']:.2f}"
        tags["val_id_accuracy"] = f"{report.validation_id_split.student_accuracy:.2f}"
        tags["validation_splits_digest"] = validation_splits_digest(report)
    for target, value in report.aog.items():
        tags[f"aog.{target}"] = f"{value:.2f}"
    if report.pgr is not None:
        tags["pgr"] = f"{report.pgr:.3f}"
    for key in ("anchor_lambda", "anchor_layers"):
        if key in report.model.get("hyperparameters", {}):
            tags[key] = str(report.model["hyperparameters"][key])
    return tags


def validation_splits_digest(report: EvaluationReport) -> str | None:
    """One digest of the validation data behind a report's validation rows (None: it has none)."""
    import hashlib

    if report.validation_splits is None:
        return None
    rows = sorted((r.dataset, r.role, r.split, r.n_pairs) for r in report.validation_splits)
    digests = sorted((k, v) for k, v in report.data_digests.items() if k.endswith(("/id_val", "/val")))
    return hashlib.sha256(json.dumps([rows, digests]).encode()).hexdigest()[:16]


def test_splits_digest(report: EvaluationReport) -> str:
    """One digest of the evaluation data behind the figures: two reports compare only when it matches."""
    import hashlib

    rows = sorted((r.dataset, r.role, r.split, r.n_pairs) for r in report.splits)
    digests = sorted((k, v) for k, v in report.data_digests.items() if k.endswith(("/id_test", "/test")))
    return hashlib.sha256(json.dumps([rows, digests]).encode()).hexdigest()[:16]


def describe(report: EvaluationReport) -> str:
    ood = ", ".join(f"{r.dataset} {r.student_accuracy:.1f} (teacher {r.teacher_accuracy:.1f}, n={r.n_pairs})" for r in report.ood_splits)
    idr = report.id_split
    return (
        f"{report.model.get('method')} student {report.model.get('student')} trained on soft labels of "
        f"{report.model.get('teacher')}. Selected on {report.selection_splits} splits; figures on "
        f"{report.figure_splits} splits. ID {idr.dataset}: {idr.student_accuracy:.1f} (teacher "
        f"{idr.teacher_accuracy:.1f}, n={idr.n_pairs}); WRG {report.wrg:+.2f}; mean OOD NTS "
        f"{report.mean_nts:+.2f}. OOD: {ood}."
    )


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str
    run_id: str
    model_uri: str


def log_and_register(model_folder: str | Path, report: EvaluationReport, name: str, extra_artifacts: dict[str, str] | None = None) -> RegisteredVersion:
    """Inside the active run: log the report and the pyfunc model, register a new version of `name`,
    tag and describe it, and point the `challenger` alias at it."""
    run = mlflow.active_run()
    if run is None:
        raise RuntimeError("log_and_register needs an active MLflow run")
    with tempfile.TemporaryDirectory() as tmp, artifact_writes():
        report_dir = Path(tmp) / REPORT_ARTIFACT
        write_report(report, report_dir)
        for filename, path in (extra_artifacts or {}).items():
            (report_dir / filename).write_bytes(Path(path).read_bytes())
        mlflow.log_artifacts(str(report_dir), REPORT_ARTIFACT)
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=RewardModelPyfunc(),
            artifacts={"reward_model": str(model_folder), REPORT_ARTIFACT: str(report_dir)},
            signature=SIGNATURE,
            input_example=INPUT_EXAMPLE,
            pip_requirements=_requirements(),
        )
    # Everything above wrote files (a full disk or an unwritable artifact location fails there, before any
    # version exists); a version is created only once its model and report are complete.
    version = mlflow.register_model(info.model_uri, name, tags=headline_tags(report))
    client = MlflowClient()
    try:
        client.update_model_version(name, version.version, description=describe(report))
        client.set_model_version_tag(name, version.version, "run_id", run.info.run_id)
        client.set_registered_model_alias(name, CHALLENGER, version.version)
    except BaseException:
        # A version without its description, run tag or alias is half-written: remove it, then fail.
        try:
            client.delete_model_version(name, version.version)
        except Exception as exc:
            log.error("could not remove the half-written version %s/%s: %s", name, version.version, exc)
        raise
    return RegisteredVersion(name, str(version.version), run.info.run_id, f"models:/{name}/{version.version}")


def _requirements() -> list[str]:
    import importlib.metadata as md

    names = ["torch", "transformers", "tokenizers", "safetensors", "mlflow", "pandas", "numpy"]
    return [f"{n}=={md.version(n)}" for n in names] + ["anchor-rm"]


def version_report(name: str, version: str) -> EvaluationReport | None:
    """The report a version carries, or None when it has none."""
    client = MlflowClient()
    mv = client.get_model_version(name, version)
    if not mv.run_id:
        return None
    try:
        path = mlflow.artifacts.download_artifacts(run_id=mv.run_id, artifact_path=REPORT_JSON)
    except Exception:  # no such artifact: MLflow raises different types per store
        return None
    return read_report(path)
