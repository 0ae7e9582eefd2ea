"""What a valid report is: report_schema.json run through jsonschema (so the checks and the published schema
cannot drift apart), the metrics derived from the rows (recomputed on read), and the rules a schema cannot state.
report.py builds and reads every report through these checks."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from anchor_rm.evaluation.metrics import (mean_net_transfer_score, net_transfer_score, ood_gain,
                                          performance_gap_recovered, transfer_metrics, weak_to_strong_gain)


SCHEMA_VERSION = "1"
PROTOCOL, EVALUATION = "protocol", "evaluation"
REPORT_KINDS = (PROTOCOL, EVALUATION)
SCHEMA_PATH = Path(__file__).with_name("report_schema.json")


# Derived metrics are recomputed on read; JSON round-trips floats exactly, so this only absorbs
# reports written by other tools that print fewer digits.
_DERIVED_TOLERANCE = 1e-6


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
