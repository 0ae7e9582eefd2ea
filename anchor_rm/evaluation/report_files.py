"""A report as files: report.md (a table for people), report.png (grouped bars) and report.json (the
record), written together and atomically (`write_report`), and read back with validation (`read_report`).
The record itself, its schema and its metrics: anchor_rm/evaluation/report.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

from anchor_rm.evaluation.metrics import accuracy_standard_error, difference_standard_error
from anchor_rm.evaluation.report import REPORT_FILENAMES, EvaluationReport, SplitResult, report_from_dict
from anchor_rm.evaluation.report_checks import EVALUATION, PROTOCOL
from anchor_rm.model.ood_flag import block_markdown


def _accuracy_cell(accuracy: float | None, n_pairs: int) -> str:
    if accuracy is None:
        return "-"
    return f"{accuracy:.1f} ±{accuracy_standard_error(accuracy, n_pairs):.1f}"


def _rows_in_order(report: EvaluationReport) -> list[SplitResult]:
    return [row for row in [report.id_split, *report.ood_splits] if row is not None]


def _has_teacher(report: EvaluationReport) -> bool:
    return any(row.teacher_accuracy is not None for row in report.splits)


def report_to_markdown(report: EvaluationReport) -> str:
    model = report.model
    hyperparameters = ", ".join(f"`{k}={v}`" for k, v in sorted(model["hyperparameters"].items())) or "none"
    has_ceiling = any(row.ceiling_accuracy is not None for row in report.splits)
    # A protocol report always has every column; an evaluation report drops the ones nothing fills.
    has_teacher = _has_teacher(report)
    has_aog, has_nts = report.kind == PROTOCOL or bool(report.aog), report.kind == PROTOCOL or bool(report.nts)
    teacher = f"`{model['teacher']}`" if model.get("teacher") else "not known"
    if report.kind == EVALUATION and not has_teacher:
        teacher += " (not scored)"
    lines = [
        f"# Evaluation report: {model['name']}",
        "",
        f"- Method: {model['method']}",
        f"- Student: `{model['student']}`; teacher: {teacher}",
        f"- Hyperparameters: {hyperparameters}",
        f"- Run: {model.get('run_id') or 'not recorded'}; created {report.created_at}; schema {report.schema_version}"
        + (f"; kind {report.kind}" if report.kind != PROTOCOL else ""),
        "",
    ]
    header = ["dataset", "role", "split", "pairs"] + (["teacher acc"] if has_teacher else []) + ["student acc"]
    header += ["ceiling acc"] if has_ceiling else []
    header += (["AOG"] if has_aog else []) + (["NTS"] if has_nts else []) + ["student ties"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in _rows_in_order(report):
        cells = [row.dataset.replace("|", "\\|"), row.role, row.split, str(row.n_pairs)]
        cells += [_accuracy_cell(row.teacher_accuracy, row.n_pairs)] if has_teacher else []
        cells.append(_accuracy_cell(row.student_accuracy, row.n_pairs))
        cells += [_accuracy_cell(row.ceiling_accuracy, row.n_pairs)] if has_ceiling else []
        gain_se = (f" ±{difference_standard_error(row.student_accuracy, row.n_pairs, row.teacher_accuracy, row.n_pairs):.1f}"
                   if row.teacher_accuracy is not None else "")
        flag = _row_flag(report, row.dataset)
        cells += [f"{report.aog[row.dataset]:+.1f}{gain_se}" if row.dataset in report.aog else "-"] if has_aog else []
        cells += [f"{report.nts[row.dataset]:+.1f}{gain_se}{flag}" if row.dataset in report.nts else "-"] if has_nts else []
        cells.append(f"{row.student_tie_rate:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + (_protocol_summary(report) if report.kind == PROTOCOL else _evaluation_summary(report))
    lines += [
        "",
        "Accuracies are pairwise accuracy in points (chosen scored strictly above rejected; exact ties "
        "count as wrong), ± one binomial standard error; `pairs` is the number of pairs behind each. "
        "A gain's ± (WRG, AOG, NTS) treats student and teacher accuracies as independent, which overstates "
        "it for two models scored on the same pairs; NTS's ± leaves out the ID term.",
    ]
    if report.ood_flag is not None:
        lines += [""] + block_markdown(report.ood_flag)
    if report.data_digests:
        lines += ["", "Data (sha256):", ""]
        lines += [f"- `{name}`: `{digest}`" for name, digest in sorted(report.data_digests.items())]
    return "\n".join(lines) + "\n"


def _pgr_text(report: EvaluationReport) -> str:
    if report.pgr is not None:
        return f"{report.pgr:.2f}"
    if report.id_split.ceiling_accuracy is None:
        return "n/a (no ceiling accuracy on the ID split)"
    return "undefined (ceiling equals teacher on the ID split)"


def _splits_line(report: EvaluationReport) -> str:
    return (f"- Splits: model selection used `{report.selection_splits}`; every number and figure here "
            f"comes from `{report.figure_splits}`.")


def _left_out(report: EvaluationReport) -> list[str]:
    """OOD targets the headline mean NTS leaves out (no transfer signal for this student)."""
    if report.headline_targets is None:
        return []
    return [name for name in report.nts if name not in report.headline_targets]


def _row_flag(report: EvaluationReport, dataset: str) -> str:
    left_out = dataset in _left_out(report)
    why = report.target_flags.get(dataset)
    if why is None:  # a report written before flags were kept: the only reason then was the ceiling
        return " (no signal)" if left_out else ""
    kind = next((kind for kind in ("too small", "over-refusal") if why.startswith(kind)), "no clear signal")
    return f" (left out: {kind})" if left_out else f" (flagged: {kind})"


def _protocol_summary(report: EvaluationReport) -> list[str]:
    idr = report.id_split
    wrg_se = difference_standard_error(idr.student_accuracy, idr.n_pairs, idr.teacher_accuracy, idr.n_pairs)
    left_out = _left_out(report)
    headline = [name for name in report.nts if name not in left_out]
    lines = [
        f"- WRG (student - teacher, ID `{idr.dataset}`): {report.wrg:+.1f} ±{wrg_se:.1f} points",
        f"- Mean NTS over {len(headline)} OOD targets ({', '.join(f'`{n}`' for n in headline)}): "
        f"{report.mean_nts:+.1f} points",
    ]
    if report.headline_note:
        lines.append(f"- **Headline fallback**: {report.headline_note}.")
    for name, why in report.target_flags.items():
        lines.append(f"- `{name}` {'left out of' if name in left_out else 'kept in'} the mean NTS, {why}; its row is "
                     "still shown")
    if left_out and not report.target_flags:
        lines.append(f"- Left out of the mean NTS, no transfer signal: {', '.join(f'`{n}`' for n in left_out)} (the "
                     "strong ceiling is below chance on its validation split; its row is still shown)")
    if idr.ceiling_accuracy is not None:
        gap_se = difference_standard_error(idr.ceiling_accuracy, idr.n_pairs, idr.teacher_accuracy, idr.n_pairs)
        lines.append(f"- Ceiling - teacher (ID): {idr.ceiling_accuracy - idr.teacher_accuracy:+.1f} ±{gap_se:.1f} points")
    lines += [f"- PGR (ID): {_pgr_text(report)}", _splits_line(report)]
    if report.teacher_calibration is not None:
        c = report.teacher_calibration
        lines.append(f"- Teacher calibration on `{c['dataset']}` {c['split']} ({c['n_pairs']} pairs): ECE {c['ece']:.3f} "
                     f"over {c['bins']} bins, mean |q - 0.5| {c['mean_margin']:.3f}, accuracy {c['accuracy']:.1f}, "
                     f"mean confidence {c['mean_confidence']:.3f}")
        if "temperature_fit" in c:
            t, k = c["temperature_fit"], c["calibrated"]
            lines.append(f"- Teacher temperature {t['temperature']:.3g}, fitted on {t['n_pairs']} gold `{t['split']}` pairs "
                         f"(NLL {t['nll_raw']:.4f} -> {t['nll_calibrated']:.4f}); scaled labels on the same {c['split']} "
                         f"split: ECE {k['ece']:.3f}, mean |q - 0.5| {k['mean_margin']:.3f}")
        if "student_train_labels" in c:
            s = c["student_train_labels"]
            scaled = (f", {s['calibrated_information_nats']:.4f} scaled" if "calibrated_information_nats" in s else "")
            lines.append(f"- The labels the students learn from ({s['n_pairs']} student-train pairs): "
                         f"{s['information_nats']:.4f} nats per pair raw{scaled}, of ln 2 = 0.693 for hard labels "
                         f"(0: no information); right on {s['accuracy']:.1f}% of them (gold)")
    lines += _premise_lines(report)
    if report.selection is not None:
        lines += _selection_lines(report.selection)
    if report.validation is not None:
        val_id = report.validation_id_split
        lines.append(f"- Validation (what promotion compares; not a figure): ID `{val_id.dataset}` student "
                     f"{val_id.student_accuracy:.1f}, teacher {val_id.teacher_accuracy:.1f} (n={val_id.n_pairs}); "
                     f"WRG {report.validation['wrg']:+.1f}, mean NTS {report.validation['mean_nts']:+.1f} points")
    return lines


def _premise_lines(report: EvaluationReport) -> list[str]:
    if report.premise is None:
        return []
    return [f"- **Does the failure ANCHOR targets happen here?** {report.premise['summary']} (anchor_rm/evaluation/premise.py: "
            "absolute, WRG > 0 with mean AOG < 0; relative, a smaller share of the teacher-to-ceiling gap recovered "
            "OOD than ID; each beyond its 95% paired-bootstrap interval)"]


def _candidate_text(candidate: dict) -> str:
    if candidate["method"] == "anchor":
        name = f"ANCHOR {candidate['anchor_layers']} lambda={candidate['anchor_lambda']:.2g}"
    else:
        name = f"{candidate['method']} W2S"
    return f"{name} (val mean NTS {candidate['val_mean_nts']:+.2f}, val ID acc {candidate['val_id_acc']:.1f})"


def _selection_lines(selection: dict) -> list[str]:
    lines = [f"- Selection among {selection['candidates']} candidates: {selection['rule']}.",
             f"- Selected: {_candidate_text(selection['selected'])}"
             + (f"; tied on validation mean NTS with {', '.join(_candidate_text(c) for c in selection['tied_with'])}"
                if selection["tied_with"] else "")]
    if selection["difference_from_naive"] is None:
        lines.append("- Naive W2S did not finish: no comparison with it on validation.")
    elif selection["selected"]["method"] == "naive":
        lines.append("- Naive W2S itself was selected: no ANCHOR setting beat it on validation.")
    else:
        verdict = ("distinguishable" if selection["distinguishable_from_naive"]
                   else "**not distinguishable** (within 1.96 standard errors)")
        lines.append(f"- Against naive W2S on validation: mean NTS {selection['selected']['val_mean_nts']:+.2f} vs "
                     f"{selection['naive_val_mean_nts']:+.2f}, difference {selection['difference_from_naive']:+.2f} "
                     f"±{selection['difference_standard_error']:.2f} points: {verdict} from naive W2S.")
    return lines + _drift_lines(selection)


def _drift_lines(selection: dict) -> list[str]:
    """Lambda in drift terms: the search's range and what each trial removed of naive W2S's last-layer drift."""
    lines = []
    if "lambda_range" in selection:
        lr = selection["lambda_range"]
        bounds = ", ".join(f"{choice} {lo:.3g}..{hi:.3g}" for choice, (lo, hi) in lr["ranges"].items())
        how = {"calibrated": f"calibrated for the student after {lr['steps']} naive W2S steps (lambda_grad "
                             + ", ".join(f"{c} {b:.3g}" for c, b in (lr["lambda_grad"] or {}).items()) + " x 1e-4..1)",
               "given": "given (--lambda-range)", "uncalibrated": "not calibrated (a sharded student)"}[lr["method"]]
        lines.append(f"- Lambda searched over {bounds}: {how}. Lambda does not carry across models or loss "
                     "definitions; the drift it removes does.")
    drift = selection.get("drift")
    if drift and any(row["drift_last"] is not None for row in drift["trials"]):
        lines += ["", "| trial | lambda | val mean NTS | last-layer drift | naive W2S's drift removed | anchor loss start / end |",
                  "|---|---|---|---|---|---|"]
        for row in drift["trials"]:
            name = (f"ANCHOR {row['anchor_layers']}" if row["method"] == "anchor" else f"{row['method']} W2S")
            lam = "-" if row["method"] != "anchor" else f"{row['anchor_lambda']:.3g}"
            nts = "-" if row["val_mean_nts"] is None else f"{row['val_mean_nts']:+.2f}"
            msd = "-" if row["drift_last"] is None else f"{row['drift_last']:.4g}"
            removed = "-" if row["drift_reduction"] is None else f"{100 * row['drift_reduction']:.0f}%"
            scale = ("-" if row["anchor_loss_end"] is None or row["method"] != "anchor"
                     else f"{row['anchor_loss_start'] or 0:.3g} / {row['anchor_loss_end']:.3g}")
            lines.append(f"| {name} | {lam} | {nts} | {msd} | {removed} | {scale} |")
        lines.append("")
    return lines


def _evaluation_summary(report: EvaluationReport) -> list[str]:
    id_row, lines = report.id_split, []
    if not _has_teacher(report):
        lines.append("- No teacher accuracies: no teacher model was found to score, so AOG, WRG and NTS are not "
                     "computed.")
    if report.wrg is not None:
        lines.append(f"- WRG (student - teacher, ID `{id_row.dataset}`): {report.wrg:+.1f} points")
    elif id_row is None:
        lines.append("- WRG and NTS: n/a (no dataset is marked in-distribution)")
    elif _has_teacher(report):
        lines.append(f"- WRG and NTS: n/a (no teacher accuracy on the ID row `{id_row.dataset}`)")
    if report.mean_nts is not None:
        lines.append(f"- Mean NTS over {len(report.nts)} OOD targets: {report.mean_nts:+.1f} points")
    if report.wrg is not None:
        lines.append(f"- PGR (ID): {_pgr_text(report)}")
    lines += _premise_lines(report)
    if report.figure_splits == "all":
        lines.append("- Data: every row is a whole data set as given (`all`), not a held-out split: a model "
                     "trained or tuned on part of a data set is scored on those pairs too.")
    else:
        lines.append(_splits_line(report))
    return lines


def _render_png(report: EvaluationReport) -> bytes:
    # Figure without pyplot: Agg rendering, no display, and no global backend switch for the caller.
    from matplotlib.figure import Figure

    rows = _rows_in_order(report)
    series = [("student", "student_accuracy", "#1f77b4")]
    if _has_teacher(report):
        series.insert(0, ("teacher", "teacher_accuracy", "#9e9e9e"))
    if any(row.ceiling_accuracy is not None for row in rows):
        series.append(("ceiling", "ceiling_accuracy", "#2ca02c"))
    width = 0.8 / len(series)
    figure = Figure(figsize=(max(6.0, 1.5 * len(rows) + 2.0), 4.5), layout="constrained")
    axes = figure.add_subplot()
    for offset, (label, attribute, color) in enumerate(series):
        positions, heights, errors = [], [], []
        for index, row in enumerate(rows):
            accuracy = getattr(row, attribute)
            if accuracy is not None:
                positions.append(index + (offset - (len(series) - 1) / 2) * width)
                heights.append(accuracy)
                errors.append(accuracy_standard_error(accuracy, row.n_pairs))
        axes.bar(positions, heights, width, yerr=errors, capsize=3, label=label, color=color)
    axes.axhline(50.0, color="black", linestyle="--", linewidth=1, label="chance (50)")
    tick_labels = []
    for row in rows:
        label = f"{row.dataset}\n({row.role.upper()}, n={row.n_pairs})"
        if row.dataset in report.nts:
            label += f"\nNTS {report.nts[row.dataset]:+.1f}"
        elif row.role == "id" and report.wrg is not None:
            label += f"\nWRG {report.wrg:+.1f}"
        elif row.dataset in report.aog:
            label += f"\nAOG {report.aog[row.dataset]:+.1f}"
        tick_labels.append(label)
    axes.set_xticks(range(len(rows)), tick_labels)
    axes.set_ylim(0, 100)
    axes.set_ylabel("pairwise accuracy (points)")
    title = f"{report.model['name']} ({report.model['method']}) on {report.figure_splits}"
    if report.kind == EVALUATION:  # model URIs run long: name on a line of its own
        title = f"{report.model['name']} ({report.model['method']})\non " + (
            "whole data sets" if report.figure_splits == "all" else report.figure_splits)
    if report.mean_nts is not None:
        title += f": mean NTS {report.mean_nts:+.1f} points"
    axes.set_title(title, fontsize="medium" if report.kind == EVALUATION else None)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    return buffer.getvalue()


def write_atomically(path: Path, data: bytes) -> None:
    """A temp file in the same directory, then os.replace: readers see the old file or the new one, never a
    half-written one (a kill, a full disk), and a failure leaves no temp file behind."""
    descriptor, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp_name, 0o644)  # mkstemp creates 0600; a report is meant to be read by others
        os.replace(temp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        raise


def report_to_png(report: EvaluationReport, path: str | Path) -> Path:
    path = Path(path)
    write_atomically(path, _render_png(report))
    return path


def write_report(report: EvaluationReport, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md and report.png into out_dir; returns {"json"|"markdown"|"png": path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Render everything before touching the directory, so a rendering error writes nothing at all.
    contents = {
        "json": (json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n").encode(),
        "markdown": report_to_markdown(report).encode(),
        "png": _render_png(report),
    }
    paths = {kind: out_dir / REPORT_FILENAMES[kind] for kind in contents}
    for kind, data in contents.items():
        write_atomically(paths[kind], data)
    return paths


def read_report(path: str | Path) -> EvaluationReport:
    """Read and validate a report.json (or the report.json inside a directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / REPORT_FILENAMES["json"]
    return report_from_dict(json.loads(path.read_text()))
