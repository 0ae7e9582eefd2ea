"""After the search: the selected model and the baselines evaluated once on the test splits, the comparison
and the NTS-against-lambda chart, and the registry version that carries them (`register_selected`)."""

from __future__ import annotations

import json
import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

from anchor_rm.evaluation import keys
from anchor_rm.evaluation.metrics import difference_standard_error
from anchor_rm.evaluation.report import EvaluationReport
from anchor_rm.evaluation.scores import scores_from_dict
from anchor_rm.method.drift import drift_reduction
from anchor_rm.method.lambda_scale import LambdaRange
from anchor_rm.mlflow_edge import runs
from anchor_rm.mlflow_edge.registry import RegisteredVersion, log_and_register
from anchor_rm.mlflow_edge.writer import PENDING_FILE
from anchor_rm.model.reward_model import export_checkpoint, load_saved, training_device
from anchor_rm.pipeline.config import ProtocolConfig
from anchor_rm.pipeline.experiment import SharedStages, final_report, premise_of
from tuning.search import SELECTION_RULE, TrialOutcome, best_trial, tied_with
from tuning.trainable import TRAINING_STATE, VALIDATION_SCORES

log = logging.getLogger("anchor_rm")


def checkpoint_folder(outcome: TrialOutcome, into: Path) -> tuple[Path, dict | None]:
    """A trial's last checkpoint as a local, ordinary Hugging Face folder (works for local and remote Ray
    storage; an FSDP2 trial's shards are read whole and written as one model, a LoRA trial's adapters merged into
    its base on the CPU: reward_model.export_checkpoint), and the
    scores on every validation set that the trial measured on that model (None in a checkpoint written before
    they were kept). What only training reads (the optimizer's state, twice the model's size; the metrics not
    yet delivered; those scores) is taken out of the local copy: the folder is what the registry stores and
    the service downloads."""
    import ray.train

    folder = export_checkpoint(ray.train.Checkpoint(outcome.checkpoint_path).to_directory(str(into)))
    scores_file = folder / VALIDATION_SCORES
    scores = scores_from_dict(json.loads(scores_file.read_text())) if scores_file.exists() else None
    for name in (TRAINING_STATE, PENDING_FILE, VALIDATION_SCORES):
        (folder / name).unlink(missing_ok=True)
    return folder, scores


def evaluate_outcome(shared: SharedStages, outcome: TrialOutcome, folder: Path, student: str, teacher: str,
                     eval_batch_size: int, train_config: dict, precision: str,
                     selection: dict | None = None, validation_scores: dict | None = None,
                     ood_flag: bool = False) -> tuple[EvaluationReport, dict]:
    """The model in `folder` on the test splits (experiment.final_report): its report and its test scores per set.
    `ood_flag`: fit its OOD flag too and
    save the fit into `folder`, which then serves with it (the registered model; the baselines' reports skip
    it: about 30 s each on 2 cores, M3). It scores on the driver's device: its first GPU where it has one (three
    8B models over the test splits on a CPU would take hours)."""
    rm = load_saved(folder, device=training_device())
    method = outcome.config.get("method")
    info = {"name": f"{student} ({method})", "student": student, "teacher": teacher, "method": method,
            "hyperparameters": {**train_config, **{k: v for k, v in outcome.config.items() if v is not None}},
            "run_id": None}
    report, test_scores = final_report(shared, rm, info, eval_batch_size, precision, selection_splits="val",
                                       selection=selection, validation_scores=validation_scores, ood_flag=ood_flag)
    if rm.density is not None:
        rm.density.save(folder)
    return report, test_scores


def _candidate(outcome: TrialOutcome) -> dict:
    return {"trial_id": outcome.trial_id, **outcome.config, "val_mean_nts": outcome.val_mean_nts,
            "val_id_acc": outcome.val_id_acc}


def selection_summary(selected: TrialOutcome, candidates: list[TrialOutcome], naive: TrialOutcome | None,
                      val_sizes: list[int]) -> dict:
    """The report's `selection` block: the rule, the winner, who tied with it, and whether its validation mean
    NTS is distinguishable from naive W2S's. The standard error of that difference is the widest one for
    the headline targets' validation sizes (accuracies at 50%, the two models independent): a difference
    under 1.96 of them is not told apart from noise."""
    se = math.sqrt(sum(difference_standard_error(50.0, n, 50.0, n) ** 2 for n in val_sizes)) / len(val_sizes)
    naive_nts = None if naive is None or math.isnan(naive.val_mean_nts) else naive.val_mean_nts
    difference = None if naive_nts is None else selected.val_mean_nts - naive_nts
    return {"rule": SELECTION_RULE, "candidates": len(candidates), "selected": _candidate(selected),
            "tied_with": [_candidate(o) for o in tied_with(selected, candidates)],
            "naive_val_mean_nts": naive_nts, "difference_from_naive": difference,
            "difference_standard_error": se,
            "distinguishable_from_naive": (None if difference is None
                                           else selected is not naive and abs(difference) > 1.96 * se)}


def outcome_label(outcome: TrialOutcome) -> str:
    if outcome.config.get("method") == "anchor":
        return f"ANCHOR {outcome.config['anchor_layers']} lambda={outcome.config['anchor_lambda']:.2g}"
    return f"{outcome.config.get('method')} W2S"


def comparison_table(reports: dict[str, EvaluationReport]) -> str:
    """Methods side by side on the test splits (Markdown)."""
    first = next(iter(reports.values()))
    targets = [r.dataset for r in first.ood_splits]
    head = "| model | ID acc | WRG | " + " | ".join(f"NTS {t}" for t in targets) + " | mean NTS | PGR |"
    lines = [head, "|" + "---|" * (5 + len(targets))]
    idr = first.id_split
    lines.append(f"| weak teacher | {idr.teacher_accuracy:.1f} | - | " + " | ".join("-" for _ in targets) + " | - | - |")
    if idr.ceiling_accuracy is not None:
        lines.append(f"| strong ceiling (gold) | {idr.ceiling_accuracy:.1f} | {idr.ceiling_accuracy - idr.teacher_accuracy:+.1f} | "
                     + " | ".join("-" for _ in targets) + " | - | 1.00 |")
    for label, report in reports.items():
        pgr = "-" if report.pgr is None else f"{report.pgr:.2f}"
        lines.append(f"| {label} | {report.id_split.student_accuracy:.1f} | {report.wrg:+.1f} | "
                     + " | ".join(f"{report.nts[t]:+.1f}" for t in targets) + f" | {report.mean_nts:+.2f} | {pgr} |")
    sizes = ", ".join(f"{r.dataset} n={r.n_pairs}" for r in first.splits)
    lines.append("")
    lines.append(f"Test splits ({sizes}); points; selection on validation splits only.")
    return "\n".join(lines)


def drift_rows(baselines: list[TrialOutcome], anchor: list[TrialOutcome]) -> dict:
    """Lambda in drift terms: each trial's last-layer drift on the drift probe after its last epoch, the share of
    naive W2S's it removed (drift.drift_reduction) and its anchor loss's scale (the report's selection block)."""
    naive = next((b for b in baselines if b.config.get("method") == "naive"), None)
    naive_drift = None if naive is None else naive.drift_last
    rows = [{"trial_id": o.trial_id, **{k: o.config.get(k) for k in ("method", "anchor_lambda", "anchor_layers")},
             "val_mean_nts": None if math.isnan(o.val_mean_nts) else o.val_mean_nts, "epochs": o.epochs,
             "drift_last": o.drift_last, "drift_reduction": drift_reduction(o.drift_last, naive_drift),
             "anchor_loss_start": o.anchor_loss_start, "anchor_loss_end": o.anchor_loss_end,
             "w2s_loss_end": o.w2s_loss_end}
            for o in baselines + sorted(anchor, key=lambda o: (str(o.config.get("anchor_layers")),
                                                               o.config.get("anchor_lambda") or 0.0))
            if o.error is None]
    return {"naive_drift_last": naive_drift, "trials": rows}


def nts_lambda_chart(drift: dict, path: Path) -> Path:
    """Validation mean NTS against lambda, one series per layer choice, the baselines (naive W2S is lambda 0) as
    horizontal lines; below it, on the same lambda axis, the share of naive W2S's last-layer drift each trial
    removed (`drift`: drift_rows)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 6.4))
    ax, below = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    rows = [r for r in drift["trials"] if r["method"] == "anchor" and r["val_mean_nts"] is not None]
    for layers, marker in (("last", "o"), ("middle", "s")):
        mine = sorted((r for r in rows if r["anchor_layers"] == layers), key=lambda r: r["anchor_lambda"])
        if not mine:
            continue
        ax.plot([r["anchor_lambda"] for r in mine], [r["val_mean_nts"] for r in mine], marker=marker,
                label=f"ANCHOR {layers}")
        measured = [r for r in mine if r["drift_reduction"] is not None]
        below.plot([r["anchor_lambda"] for r in measured], [100 * r["drift_reduction"] for r in measured],
                   marker=marker, label=f"ANCHOR {layers}")
    for b, style in zip((r for r in drift["trials"] if r["method"] != "anchor"), ("--", ":")):
        if b["val_mean_nts"] is not None:
            ax.axhline(b["val_mean_nts"], linestyle=style, color="grey", label=f"{b['method']} W2S")
    ax.axhline(0, color="black", linewidth=0.5)
    below.axhline(0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_ylabel("mean OOD NTS on validation (points)")
    ax.set_title("NTS and drift removed against lambda (early-stopped trials at their last epoch)")
    ax.legend(fontsize=8)
    below.set_xlabel("anchor lambda")
    below.set_ylabel("naive W2S's last-layer\ndrift removed (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def outcomes_json(baselines: list[TrialOutcome], anchor: list[TrialOutcome], path: Path) -> Path:
    rows = [{"search": "baselines", **o.__dict__} for o in baselines] + [{"search": "anchor", **o.__dict__} for o in anchor]
    path.write_text(json.dumps(rows, indent=2, default=str))
    return path


@dataclass
class FinalResult:
    report: EvaluationReport  # the selected model's, on the test splits
    comparison: str  # the selected model and the baselines side by side (Markdown)
    version: RegisteredVersion


def register_selected(shared: SharedStages, cfg: ProtocolConfig, baselines: list[TrialOutcome],
                      anchor: list[TrialOutcome], registered_name: str, tune_run_id: str,
                      experiment_id: str, lambda_range: LambdaRange | None = None) -> FinalResult:
    """The post-search protocol, in a nested "final-evaluation" run of the active tune run: the best of naive
    W2S and the ANCHOR trials on validation (search.best_trial; the rule and the winner's distance from naive
    W2S go into its report) and the baselines, each evaluated once on the test splits;
    the comparison, the chart and the trials as artifacts; the selected model registered with its report
    under the alias `challenger`. Registration is keyed on the tune run: a driver killed while registering
    and resumed finds its final-evaluation run again and completes that version instead of registering
    another."""
    naive = next((b for b in baselines if b.config.get("method") == "naive"), None)
    candidates = anchor + ([naive] if naive is not None else [])
    selected = best_trial(candidates)
    selection = selection_summary(selected, candidates, naive,
                                  [len(shared.splits.ood[t]["val"]) for t in shared.headline_targets])
    drift = drift_rows(baselines, anchor)
    selection["drift"] = drift
    if lambda_range is not None:
        selection["lambda_range"] = lambda_range.to_dict()
    verdict = {True: "distinguishable from", False: "not distinguishable from", None: "no comparison with"}
    log.info("selected %s (val mean NTS %+.2f; %s naive W2S on validation)", selected.config,
             selected.val_mean_nts, verdict[selection["distinguishable_from_naive"]])
    earlier = runs.find_run(experiment_id, {keys.STAGE_TAG: "final", "mlflow.parentRunId": tune_run_id})
    if earlier is not None:
        log.info("the final evaluation of an earlier driver of this experiment (run %s) is done again in that run",
                 earlier)
    with runs.start_run(run_id=earlier, run_name=None if earlier else "final-evaluation", nested=True) as final_run_id, \
            tempfile.TemporaryDirectory() as tmp:
        runs.set_tags({keys.STAGE_TAG: "final", **shared.tags()})
        train_dict = cfg.student_train.to_dict()
        reports, folders, naive_test = {}, {}, None
        selected_label = f"{outcome_label(selected)} (selected)"
        others = [(outcome_label(b), b) for b in baselines if b.checkpoint_path and b is not selected]
        for label, outcome in [(selected_label, selected)] + others:
            # the registered version's artifact folder is named after this one: "selected", as before
            folder = "selected" if outcome is selected else label.replace(" ", "_")
            folders[label], validation_scores = checkpoint_folder(outcome, Path(tmp) / folder)
            reports[label], test_scores = evaluate_outcome(shared, outcome, folders[label], cfg.student, cfg.teacher,
                                                           cfg.eval_batch_size, train_dict, cfg.precision,
                                                           selection if outcome is selected else None,
                                                           validation_scores, ood_flag=outcome is selected)
            if outcome is naive:
                naive_test = test_scores
        report = reports[selected_label]
        report.model["run_id"] = final_run_id
        # Before any lambda is read: does this run's naive W2S show the failure ANCHOR targets?
        report.premise = premise_of(shared, naive_test)
        log.info("premise: %s", report.premise["summary"])
        comparison = Path(tmp) / "comparison.md"
        comparison.write_text(comparison_table(reports) + "\n")
        chart = nts_lambda_chart(drift, Path(tmp) / "nts_vs_lambda.png")
        trials = outcomes_json(baselines, anchor, Path(tmp) / "trials.json")
        runs.log_report(report)
        version = log_and_register(folders[selected_label], report, registered_name,
                                   extra_artifacts={"comparison.md": str(comparison), "nts_vs_lambda.png": str(chart),
                                                    "trials.json": str(trials)},
                                   registration_key=f"tune-run:{tune_run_id}")
    return FinalResult(report, comparison_table(reports), version)
