"""The evaluation report: per-split accuracies plus the transfer metrics derived from them.

A report is written as three files (report.json, report.md, report.png; anchor_rm/evaluation/report_files.py).
report.json is the record a registry version carries; its layout is fixed by anchor_rm/evaluation/report_schema.json and documented in
docs/report-schema.md. Validation runs that schema file through jsonschema, so the checks and the
published schema cannot drift apart.

Two kinds of report share the layout. A "protocol" report (the default) is what training and tuning
produce: exactly one ID row, the teacher on every row, every metric defined. An "evaluation" report
(pipelines/evaluate.py) scores a model on whatever data it is given: the teacher may be unknown
(teacher accuracies null) and no row need be ID, so the metrics that need them are null or absent.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from anchor_rm.evaluation.report_checks import (PROTOCOL, REPORT_KINDS, SCHEMA_VERSION, _derive_metrics,
                                                _schema_errors, _schema_validator, validate_report_dict)


REPORT_FILENAMES = {"json": "report.json", "markdown": "report.md", "png": "report.png"}


@dataclass
class SplitResult:
    dataset: str
    role: Literal["id", "ood"]
    split: Literal["val", "test", "all"]  # "all": a whole data set, in evaluation reports only
    n_pairs: int
    teacher_accuracy: float | None  # points; None only in an evaluation report whose teacher is not known
    student_accuracy: float  # points
    ceiling_accuracy: float | None  # points; None when no gold-trained ceiling was evaluated
    student_tie_rate: float  # points; ties count as wrong, so this explains part of a low accuracy


@dataclass
class EvaluationReport:
    created_at: str
    model: dict[str, Any]  # name, student, teacher, method, hyperparameters, run_id
    selection_splits: str
    figure_splits: str
    splits: list[SplitResult]
    wrg: float | None  # None only in an evaluation report (no ID row, or no teacher on it)
    aog: dict[str, float]
    nts: dict[str, float]
    mean_nts: float | None  # None only in an evaluation report (no NTS defined)
    pgr: float | None
    data_digests: dict[str, str] = field(default_factory=dict)
    schema_version: str = SCHEMA_VERSION
    kind: str = PROTOCOL  # "protocol" (strict, training and tuning) or "evaluation" (evaluate.py)
    # The OOD targets mean_nts averages; None: every OOD target (metrics.choose_headline_targets decides, on
    # split sizes and validation accuracies)
    headline_targets: list[str] | None = None
    # Why an OOD target is flagged (left out of the headline, or kept in it only by a fallback); and the
    # fallback's note. Empty / None in reports written before 2026-12-03.
    target_flags: dict[str, str] = field(default_factory=dict)
    headline_note: str | None = None
    # The weak teacher's soft labels against gold on ID validation (metrics.calibration, with dataset and
    # split); None where no teacher stage measured it (evaluation reports, reports before 2026-12-03).
    teacher_calibration: dict[str, Any] | None = None
    # The same models on the validation splits (protocol reports): what promotion compares; None in reports
    # written before these rows existed, and in evaluation reports.
    validation_splits: list[SplitResult] | None = None
    # How tune.py chose this model among its trials (the rule, the winner's tie and its distance from naive
    # W2S on validation); None for a model no search selected.
    selection: dict[str, Any] | None = None
    # The OOD flag the model serves with (ood_flag.measure_sets: its fit, and per set the share flagged,
    # AUROC, accuracy on flagged and unflagged pairs); None for a model without one.
    ood_flag: dict[str, Any] | None = None
    # Whether the run's naive W2S shows the failure ANCHOR targets (premise.premise_check: the verdict and its
    # numbers); None in reports written before session 30 and where no check was made.
    premise: dict[str, Any] | None = None

    @property
    def validation(self) -> dict[str, Any] | None:
        """WRG, AOG, NTS and mean NTS (over the headline targets) on the validation rows, or None."""
        if self.validation_splits is None:
            return None
        return _derive_metrics([asdict(row) for row in self.validation_splits], PROTOCOL, self.headline_targets)

    def validation_mean_nts(self, headline_targets: list[str] | None) -> float | None:
        """The validation mean NTS over other headline targets (promotion compares two versions on one set)."""
        if self.validation_splits is None:
            return None
        return _derive_metrics([asdict(row) for row in self.validation_splits], PROTOCOL, headline_targets)["mean_nts"]

    @property
    def validation_id_split(self) -> SplitResult | None:
        return next((row for row in self.validation_splits or [] if row.role == "id"), None)

    @property
    def id_split(self) -> SplitResult | None:
        """The ID row; a protocol report always has one, an evaluation report may not (then None)."""
        return next((row for row in self.splits if row.role == "id"), None)

    @property
    def ood_splits(self) -> list[SplitResult]:
        return [row for row in self.splits if row.role == "ood"]

    def to_dict(self) -> dict[str, Any]:
        # "kind" is written only for evaluation reports: a protocol report stays exactly what it was
        # before kinds existed, so every reader of schema version 1 still reads it.
        kind = {} if self.kind == PROTOCOL else {"kind": self.kind}
        report_dict = {
            "schema_version": self.schema_version,
            **kind,
            "created_at": self.created_at,
            "model": dict(self.model),
            "selection_splits": self.selection_splits,
            "figure_splits": self.figure_splits,
            "splits": [asdict(row) for row in self.splits],
            "wrg": self.wrg,
            "aog": dict(self.aog),
            "nts": dict(self.nts),
            "mean_nts": self.mean_nts,
            **({"headline_targets": list(self.headline_targets)} if self.headline_targets is not None else {}),
            **({"target_flags": dict(self.target_flags)} if self.target_flags else {}),
            **({"headline_note": self.headline_note} if self.headline_note else {}),
            **({"teacher_calibration": dict(self.teacher_calibration)} if self.teacher_calibration else {}),
            "pgr": self.pgr,
            **({"validation": {"splits": [asdict(row) for row in self.validation_splits],
                               "wrg": self.validation["wrg"], "mean_nts": self.validation["mean_nts"]}}
               if self.validation_splits is not None else {}),
            **({"selection": dict(self.selection)} if self.selection is not None else {}),
            **({"ood_flag": dict(self.ood_flag)} if self.ood_flag is not None else {}),
            **({"premise": dict(self.premise)} if self.premise is not None else {}),
            "data_digests": dict(self.data_digests),
        }
        validate_report_dict(report_dict)
        return report_dict


def _canonical_model(model_info: dict[str, Any]) -> dict[str, Any]:
    # Fixed key order so report.json diffs cleanly; unknown keys are kept for validation to name.
    model = {key: model_info[key] for key in ("name", "student", "teacher", "method") if key in model_info}
    model["hyperparameters"] = dict(model_info.get("hyperparameters") or {})
    model["run_id"] = model_info.get("run_id")
    return {**model, **{k: v for k, v in model_info.items() if k not in model}}


def build_report(
    model_info: dict[str, Any],
    results: list[SplitResult],
    *,
    selection_splits: str,
    figure_splits: str,
    data_digests: dict[str, str] | None = None,
    created_at: str | None = None,
    kind: str = PROTOCOL,
    headline_targets: list[str] | None = None,
    validation_results: list[SplitResult] | None = None,
    selection: dict[str, Any] | None = None,
    target_flags: dict[str, str] | None = None,
    headline_note: str | None = None,
    teacher_calibration: dict[str, Any] | None = None,
    ood_flag: dict[str, Any] | None = None,
    premise: dict[str, Any] | None = None,
) -> EvaluationReport:
    """Assemble a report and compute WRG, AOG, NTS, mean NTS and PGR (ID) from the rows.

    `validation_results` (protocol reports): the same models on the validation splits, kept beside the
    figures for what may select (promotion); the figures themselves stay on `figure_splits`. `selection`:
    how a search chose this model (tuning/final.py: selection_summary). `target_flags` and `headline_note`:
    why OOD targets are flagged (metrics.choose_headline_targets). `teacher_calibration`: the teacher's soft
    labels against gold on ID validation (metrics.calibration). `ood_flag`: what the model's OOD flag does on
    the figure splits (ood_flag.measure_sets). `premise`: whether the run's naive W2S shows the failure ANCHOR
    targets (premise.premise_check).

    kind="protocol" (training, tuning): `results` holds exactly one row with role "id" and at least one
    "ood" row, all on `figure_splits`, each with a teacher accuracy. kind="evaluation" (any model on any
    data): at most one "id" row, teacher accuracies may be None; metrics without their inputs are None
    (WRG, mean NTS, PGR) or left out (AOG, NTS keys).
    """
    if kind not in REPORT_KINDS:
        raise ValueError(f"kind: expected one of {list(REPORT_KINDS)}, got {kind!r}")
    id_rows = [row.dataset for row in results if row.role == "id"]
    if kind == PROTOCOL:
        if len(id_rows) != 1:
            raise ValueError(f"results: expected exactly one row with role 'id', got {len(id_rows)}: {id_rows}")
        if not any(row.role == "ood" for row in results):
            raise ValueError("results: expected at least one row with role 'ood'; transfer needs an OOD target")
    elif len(id_rows) > 1:
        raise ValueError(f"results: expected at most one row with role 'id', got {len(id_rows)}: {id_rows}")
    model = _canonical_model(model_info)
    rows = [asdict(row) for row in results]
    # Schema and split-policy checks first, so a bad row is reported by its path, not by a metrics error.
    errors = _schema_errors(rows, _schema_validator("splits", kind), ("splits",))
    if errors:
        raise ValueError("invalid evaluation report: " + "; ".join(errors))
    if headline_targets is not None and kind != PROTOCOL:
        raise ValueError("headline_targets: only a protocol report has headline targets")
    derived = _derive_metrics(rows, kind, headline_targets)
    report = EvaluationReport(
        created_at=created_at or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        model=model,
        selection_splits=selection_splits,
        figure_splits=figure_splits,
        splits=[_split_result_from_dict(row) for row in rows],
        data_digests=dict(data_digests or {}),
        kind=kind,
        headline_targets=None if headline_targets is None else list(headline_targets),
        validation_splits=None if validation_results is None else [_split_result_from_dict(asdict(row))
                                                                   for row in validation_results],
        selection=None if selection is None else dict(selection),
        target_flags=dict(target_flags or {}),
        headline_note=headline_note,
        teacher_calibration=None if teacher_calibration is None else dict(teacher_calibration),
        ood_flag=None if ood_flag is None else dict(ood_flag),
        premise=None if premise is None else dict(premise),
        **derived,
    )
    report.to_dict()  # validates the whole report
    return report


def _split_result_from_dict(row: dict[str, Any]) -> SplitResult:
    # Validated rows may hold ints (60, 470.0); normalise so equal reports compare and serialise equal.
    return SplitResult(
        dataset=row["dataset"],
        role=row["role"],
        split=row["split"],
        n_pairs=int(row["n_pairs"]),
        teacher_accuracy=_optional_float(row["teacher_accuracy"]),
        student_accuracy=float(row["student_accuracy"]),
        ceiling_accuracy=_optional_float(row["ceiling_accuracy"]),
        student_tie_rate=float(row["student_tie_rate"]),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def report_from_dict(report_dict: dict[str, Any]) -> EvaluationReport:
    """Validate a report dict (as read from report.json) and build the report; ValueError names bad fields."""
    validate_report_dict(report_dict)
    rows = [_split_result_from_dict(row) for row in report_dict["splits"]]
    return EvaluationReport(
        schema_version=report_dict["schema_version"],
        created_at=report_dict["created_at"],
        model=_canonical_model(report_dict["model"]),
        selection_splits=report_dict["selection_splits"],
        figure_splits=report_dict["figure_splits"],
        splits=rows,
        wrg=_optional_float(report_dict["wrg"]),
        aog={k: float(v) for k, v in report_dict["aog"].items()},
        nts={k: float(v) for k, v in report_dict["nts"].items()},
        mean_nts=_optional_float(report_dict["mean_nts"]),
        pgr=_optional_float(report_dict["pgr"]),
        data_digests=dict(report_dict["data_digests"]),
        kind=report_dict.get("kind", PROTOCOL),
        headline_targets=report_dict.get("headline_targets"),
        validation_splits=([_split_result_from_dict(row) for row in report_dict["validation"]["splits"]]
                           if "validation" in report_dict else None),
        selection=report_dict.get("selection"),
        target_flags=dict(report_dict.get("target_flags", {})),
        headline_note=report_dict.get("headline_note"),
        teacher_calibration=report_dict.get("teacher_calibration"),
        ood_flag=report_dict.get("ood_flag"),
        premise=report_dict.get("premise"),
    )


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file, for `data_digests`: pins the exact data a report was computed on."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
