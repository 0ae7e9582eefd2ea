"""The evaluation report: per-split accuracies plus the transfer metrics derived from them.

A report is written as three files (report.json, report.md, report.png; anchor_rm/report_files.py).
report.json is the record a registry version carries; its layout is fixed by anchor_rm/report_schema.json and documented in
docs/report-schema.md. Validation runs that schema file through jsonschema, so the checks and the
published schema cannot drift apart.

Two kinds of report share the layout. A "protocol" report (the default) is what training and tuning
produce: exactly one ID row, the teacher on every row, every metric defined. An "evaluation" report
(pipelines/evaluate.py) scores a model on whatever data it is given: the teacher may be unknown
(teacher accuracies null) and no row need be ID, so the metrics that need them are null or absent.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from jsonschema import Draft202012Validator

from anchor_rm.metrics import (mean_net_transfer_score, net_transfer_score, ood_gain, performance_gap_recovered,
                              transfer_metrics, weak_to_strong_gain)

SCHEMA_VERSION = "1"
PROTOCOL, EVALUATION = "protocol", "evaluation"
REPORT_KINDS = (PROTOCOL, EVALUATION)
SCHEMA_PATH = Path(__file__).with_name("report_schema.json")
REPORT_FILENAMES = {"json": "report.json", "markdown": "report.md", "png": "report.png"}
# Derived metrics are recomputed on read; JSON round-trips floats exactly, so this only absorbs
# reports written by other tools that print fewer digits.
_DERIVED_TOLERANCE = 1e-6


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


# ---------------------------------------------------------------------------------------------------
# Validation: report_schema.json through jsonschema, plus the rules a schema cannot state.

@functools.lru_cache(maxsize=1)
def load_report_schema() -> dict[str, Any]:
    """The parsed report_schema.json (cached; treat as read-only)."""
    return json.loads(SCHEMA_PATH.read_text())


@functools.lru_cache(maxsize=None)
def _schema_validator(property_name: str | None = None, kind: str = PROTOCOL) -> Draft202012Validator:
    # The whole report, or one top-level property (with $defs kept so its $refs still resolve) under the
    # rules of `kind`: a protocol report adds $defs/protocol_report's stricter rules for that property.
    schema = load_report_schema()
    if property_name is not None:
        parts = [schema["properties"][property_name]]
        strict = schema["$defs"]["protocol_report"]["properties"].get(property_name)
        if kind == PROTOCOL and strict is not None:
            parts.append(strict)
        schema = {"$defs": schema["$defs"], "allOf": parts}
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _field_path(parts: Any) -> str:
    path = ""
    for key in parts:
        path += f"[{key}]" if isinstance(key, int) else f".{key}" if path else str(key)
    return path or "report"


def _non_json_errors(value: Any, path: tuple[Any, ...]) -> list[str]:
    # JSON has no NaN or inf (jsonschema would accept them as numbers) and only string keys.
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{_field_path(path)}: {value!r} is not a finite number (JSON has no NaN or Infinity)"]
    errors = []
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                errors.append(f"{_field_path(path)}: key {key!r} is not a string")
            errors += _non_json_errors(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            errors += _non_json_errors(item, (*path, index))
    return errors


def _resolve_local_ref(subschema: dict[str, Any]) -> dict[str, Any]:
    # {"$ref": "#/$defs/name"} -> that definition, so messages can quote its description.
    ref = subschema.get("$ref", "")
    return load_report_schema()["$defs"].get(ref.removeprefix("#/$defs/"), subschema) if ref else subschema


def _schema_errors(value: Any, validator: Draft202012Validator, prefix: tuple[Any, ...] = ()) -> list[str]:
    errors = _non_json_errors(value, prefix)
    for error in validator.iter_errors(value):
        path = (*prefix, *error.absolute_path)
        if error.validator == "required":
            missing = [key for key in error.validator_value if key not in error.instance]
            errors += [f"{_field_path((*path, key))}: missing required field" for key in missing]
        elif error.validator == "additionalProperties" and error.validator_value is False:
            allowed = error.schema.get("properties", {})
            errors += [f"{_field_path((*path, key))}: unexpected field (allowed: {', '.join(allowed)})"
                       for key in error.instance if key not in allowed]
        elif error.validator in ("contains", "minContains", "maxContains"):
            # jsonschema's "does not contain" message quotes the whole list; name what was wanted instead.
            wanted = _resolve_local_ref(error.schema["contains"]).get("description", "a matching item")
            message = error.message if error.validator != "contains" else "no item matches the given schema"
            errors.append(f"{_field_path(path)}: {message} (wanted: {wanted})")
        else:
            errors.append(f"{_field_path(path)}: {error.message}")
    return list(dict.fromkeys(errors))  # one error per missing/extra field, however many keywords found it


def _consistency_errors(report_dict: dict[str, Any]) -> list[str]:
    """Rules a JSON Schema cannot state: rows agree with the split policy, derived metrics agree with rows."""
    errors = []
    try:
        json.dumps(report_dict["model"]["hyperparameters"], allow_nan=False)
    except (TypeError, ValueError) as error:
        errors.append(f"model.hyperparameters: not JSON-serialisable ({error})")
    rows = report_dict["splits"]
    names = [row["dataset"] for row in rows]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        errors.append(f"splits: dataset names must be unique, repeated: {duplicates}")
    figure_split = report_dict["figure_splits"]
    for index, row in enumerate(rows):
        if row["split"] != figure_split:
            errors.append(
                f"splits[{index}].split: expected {figure_split!r} (figure_splits), got {row['split']!r}"
            )
    selection = {name.strip() for name in report_dict["selection_splits"].split(",")}
    if figure_split in selection:
        # Figures come from splits no selection has seen; otherwise they overstate transfer.
        errors.append(
            f"figure_splits: {figure_split!r} was also used for selection (selection_splits="
            f"{report_dict['selection_splits']!r}); report on a split selection has not seen"
        )
    if errors:
        return errors

    headline = report_dict.get("headline_targets")
    ood_names = [row["dataset"] for row in rows if row["role"] == "ood"]
    if headline is not None and (set(headline) - set(ood_names) or report_dict.get("kind", PROTOCOL) != PROTOCOL):
        return [f"headline_targets: {headline} must name OOD datasets of a protocol report ({ood_names})"]
    flagged = sorted(set(report_dict.get("target_flags", {})) - set(ood_names))
    if flagged:
        return [f"target_flags: {flagged} are not OOD datasets of this report ({ood_names})"]
    errors += _validation_errors(report_dict, names, headline)
    errors += _ood_flag_errors(report_dict.get("ood_flag"), rows)
    derived = _derive_metrics(rows, report_dict.get("kind", PROTOCOL), headline)
    for key in ("wrg", "mean_nts", "pgr"):
        stored, expected = report_dict[key], derived[key]
        if (stored is None) != (expected is None) or (
            expected is not None and not math.isclose(stored, expected, abs_tol=_DERIVED_TOLERANCE)
        ):
            errors.append(f"{key}: stored {stored!r} but the splits give {expected!r}")
    for key in ("aog", "nts"):
        stored, expected = report_dict[key], derived[key]
        if set(stored) != set(expected):
            errors.append(f"{key}: keys {sorted(stored)} differ from the OOD datasets {sorted(expected)}"
                          + ("" if report_dict.get("kind", PROTOCOL) == PROTOCOL else
                             " (those with a teacher accuracy; for NTS also a teacher accuracy on an ID row)"))
            continue
        for target, value in expected.items():
            if not math.isclose(stored[target], value, abs_tol=_DERIVED_TOLERANCE):
                errors.append(f"{key}.{target}: stored {stored[target]!r} but the splits give {value!r}")
    return errors


def _validation_errors(report_dict: dict[str, Any], figure_names: list[str], headline: list[str] | None) -> list[str]:
    """The validation block: protocol reports only, "val" rows on the same datasets as the figure rows, one
    ID row, and its wrg and mean_nts as its rows give them."""
    block = report_dict.get("validation")
    if block is None:
        return []
    if report_dict.get("kind", PROTOCOL) != PROTOCOL:
        return ["validation: only a protocol report has validation rows"]
    rows = block["splits"]
    errors = [f"validation.splits[{index}].split: expected 'val', got {row['split']!r}"
              for index, row in enumerate(rows) if row["split"] != "val"]
    names = [row["dataset"] for row in rows]
    if sorted(names) != sorted(figure_names):
        errors.append(f"validation.splits: datasets {sorted(names)} differ from the figure rows' {sorted(figure_names)}")
    elif any(row["role"] != next(r["role"] for r in report_dict["splits"] if r["dataset"] == row["dataset"])
             for row in rows):
        errors.append("validation.splits: a dataset's role differs from its figure row's")
    if errors:
        return errors
    derived = _derive_metrics(rows, PROTOCOL, headline)
    for key in ("wrg", "mean_nts"):
        if not math.isclose(block[key], derived[key], abs_tol=_DERIVED_TOLERANCE):
            errors.append(f"validation.{key}: stored {block[key]!r} but its splits give {derived[key]!r}")
    return errors


def _ood_flag_errors(block: dict[str, Any] | None, rows: list[dict[str, Any]]) -> list[str]:
    """The flag's rows name the report's datasets, with their pair counts."""
    if block is None:
        return []
    errors = []
    by_name = {row["dataset"]: row for row in rows}
    for index, flagged in enumerate(block["sets"]):
        row = by_name.get(flagged["dataset"])
        if row is None:
            errors.append(f"ood_flag.sets[{index}].dataset: {flagged['dataset']!r} is not a dataset of this report "
                          f"({sorted(by_name)})")
        elif flagged["n_pairs"] != row["n_pairs"] or flagged["flagged_pairs"] > flagged["n_pairs"]:
            errors.append(f"ood_flag.sets[{index}]: {flagged['flagged_pairs']} flagged of {flagged['n_pairs']} pairs, "
                          f"but the report's {flagged['dataset']} row has {row['n_pairs']}")
    return errors


def validate_report_dict(report_dict: Any) -> None:
    """Raise ValueError naming every field path that breaks report_schema.json or the report's rules."""
    errors = _schema_errors(report_dict, _schema_validator())
    if not errors:
        errors = _consistency_errors(report_dict)
    if errors:
        raise ValueError("invalid evaluation report: " + "; ".join(errors))


# ---------------------------------------------------------------------------------------------------
# Building and (de)serialising.

def _derive_metrics(rows: list[dict[str, Any]], kind: str = PROTOCOL,
                    headline_targets: list[str] | None = None) -> dict[str, Any]:
    if kind == EVALUATION:
        return _derive_evaluation_metrics(rows)
    id_name = next(row["dataset"] for row in rows if row["role"] == "id")
    ceiling = {row["dataset"]: row["ceiling_accuracy"] for row in rows if row["ceiling_accuracy"] is not None}
    metrics = transfer_metrics(
        teacher_acc={row["dataset"]: row["teacher_accuracy"] for row in rows},
        student_acc={row["dataset"]: row["student_accuracy"] for row in rows},
        id_name=id_name,
        ceiling_acc=ceiling,
        headline_targets=headline_targets,
    )
    return {"wrg": metrics.wrg, "aog": metrics.aog, "nts": metrics.nts, "mean_nts": metrics.mean_nts,
            "pgr": metrics.pgr_id}


def _derive_evaluation_metrics(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The same formulas as transfer_metrics, each only where its inputs exist: AOG on OOD rows with a
    teacher accuracy; WRG, NTS and PGR only with a teacher accuracy on an ID row. With a teacher on every
    row, one ID row and an OOD row, the result equals transfer_metrics'."""
    id_row = next((row for row in rows if row["role"] == "id"), None)
    aog = {row["dataset"]: ood_gain(row["student_accuracy"], row["teacher_accuracy"])
           for row in rows if row["role"] == "ood" and row["teacher_accuracy"] is not None}
    wrg, nts, pgr = None, {}, None
    if id_row is not None and id_row["teacher_accuracy"] is not None:
        teacher_id, student_id = id_row["teacher_accuracy"], id_row["student_accuracy"]
        wrg = weak_to_strong_gain(student_id, teacher_id)
        nts = {name: net_transfer_score(gain, teacher_id, student_id) for name, gain in aog.items()}
        if id_row["ceiling_accuracy"] is not None:
            pgr = performance_gap_recovered(student_id, teacher_id, id_row["ceiling_accuracy"])
    mean_nts = mean_net_transfer_score(nts) if nts else None
    return {"wrg": wrg, "aog": aog, "nts": nts, "mean_nts": mean_nts, "pgr": pgr}


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
