"""What a registered version shows of its report without opening it: the headline figures as tags, a
description, and digests of the data behind its figures (two reports compare only when they match).
Pure: the registry edge (mlflow_edge.registry) writes these, promotion compares them."""

from __future__ import annotations

import hashlib
import json

from anchor_rm.evaluation.report import EvaluationReport


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
    if report.model.get("method") == "anchor":  # a naive or confidence version has no anchor to tag
        for key in ("anchor_lambda", "anchor_layers"):
            if key in report.model.get("hyperparameters", {}):
                tags[key] = str(report.model["hyperparameters"][key])
    if report.premise is not None:
        tags["premise"] = report.premise["verdict"]  # is there a failure for ANCHOR to fix here?
    return tags


def validation_splits_digest(report: EvaluationReport) -> str | None:
    """One digest of the validation data behind a report's validation rows (None: it has none)."""
    if report.validation_splits is None:
        return None
    rows = sorted((r.dataset, r.role, r.split, r.n_pairs) for r in report.validation_splits)
    digests = sorted((k, v) for k, v in report.data_digests.items() if k.endswith(("/id_val", "/val")))
    return hashlib.sha256(json.dumps([rows, digests]).encode()).hexdigest()[:16]


def test_splits_digest(report: EvaluationReport) -> str:
    """One digest of the evaluation data behind the figures: two reports compare only when it matches."""
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
        + (f" Premise: {report.premise['summary']}." if report.premise is not None else "")
    )
