"""Tables and plots of the preference-shift study (anchor_rm.study): mean and standard deviation over
seeds of every method, the ANCHOR lambda sweep, the settings chosen on validation, the paired comparisons
behind the paper's claims, and drift against OOD drop.

Selection ("tuned") uses validation splits only: the setting with the best validation mean NTS, per seed.
Every figure reported is on test splits.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

from anchor_rm.evaluation.premise import premise_table
from anchor_rm.evaluation.report_files import write_atomically
from anchor_rm.pipeline.study_tables import (PRIMARY, _get, _mean_sd, _n_cell, correlations, gap_table, main_table,
                                             model_metrics, naive_label_modes, paired, primary_comparison, rows_for,
                                             target_table, teacher_table)


def _plot(instances_by_category: dict[str, list[dict]], rows_by_category: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(instances_by_category)

    def figure(name: str, height: float, draw: Callable) -> Path:
        """One panel per category, drawn by draw(ax, category), saved as out/name."""
        fig, axes = plt.subplots(1, len(cats), figsize=(5.5 * len(cats), height), squeeze=False)
        for ax, cat in zip(axes[0], cats):
            draw(ax, cat)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110)
        plt.close(fig)
        write_atomically(out / name, buffer.getvalue())
        return out / name

    def nts_vs_lambda(ax, cat: str) -> None:
        """NTS against lambda per layer choice; lambda 0 (naive) drawn one decade left of the smallest lambda."""
        rows = rows_by_category[cat]
        naive = _mean_sd(_get(next(r for l, r, _ in rows if l == "naive W2S"), "mean_nts"))
        drawn = False
        for choice, marker in (("last", "o"), ("middle", "s")):
            sweep = [(float(l.split("lambda ")[1]), r) for l, r, _ in rows if l.startswith(f"ANCHOR {choice}, lambda ")]
            if not sweep:
                continue
            lams = [lam for lam, _ in sweep]
            xs = [min(lams) / 10] + lams
            stats = [naive] + [_mean_sd(_get(r, "mean_nts")) for _, r in sweep]
            ax.errorbar(xs, [s[0] for s in stats], yerr=[s[1] for s in stats], marker=marker, capsize=3, label=f"ANCHOR {choice}")
            drawn = True
        if not drawn:
            ax.set_title(f"{cat}: no ANCHOR students in this study")
            return
        ax.set_xscale("log")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_title(f"{cat}: test mean NTS vs anchor lambda")
        ax.set_xlabel("anchor lambda (leftmost point: lambda 0, naive W2S)")
        ax.set_ylabel("mean NTS (points), mean ± sd over seeds")
        ax.legend()

    def id_vs_ood(ax, cat: str) -> None:
        """ID against OOD accuracy per method."""
        for label, per_seed, _ in rows_by_category[cat]:
            if "lambda " in label and "tuned" not in label:
                continue
            x, y = _mean_sd(_get(per_seed, "id_acc")), _mean_sd(_get(per_seed, "ood_acc"))
            ax.errorbar([x[0]], [y[0]], xerr=[x[1]], yerr=[y[1]], marker="o", capsize=3, label=label)
        ax.set_title(f"{cat}: ID vs mean OOD test accuracy")
        ax.set_xlabel("ID test accuracy (%)")
        ax.set_ylabel("mean OOD test accuracy (%)")
        ax.legend(fontsize=7)

    def drift_vs_ood_drop(ax, cat: str) -> None:
        """Drift against OOD drop, every W2S student run."""
        for inst in instances_by_category[cat]:
            for s in inst["students"]:
                m = model_metrics(inst, s["test"], s["drift"])
                color = {"naive": "C0", "confidence": "C1"}.get(s["method"], "C2" if s["anchor_layers"] == "last" else "C3")
                ax.scatter(m["drift_last_msd"], m["ood_drop"], color=color, s=18)
        for name, color in (("naive", "C0"), ("confidence", "C1"), ("ANCHOR last", "C2"), ("ANCHOR middle", "C3")):
            ax.scatter([], [], color=color, label=name)
        pearson, spearman, n = correlations(instances_by_category[cat])
        ax.set_title(f"{cat}: drift vs OOD drop (Spearman {spearman:+.2f}, n={n})")
        ax.set_xlabel("last-layer drift: MSD to the pretrained states, OOD test mean")
        ax.set_ylabel("OOD drop: WRG - mean AOG (points)")
        ax.legend(fontsize=7)

    return [figure("nts_vs_lambda.png", 4, nts_vs_lambda), figure("id_vs_ood.png", 4.2, id_vs_ood),
            figure("drift_vs_ood_drop.png", 4, drift_vs_ood_drop)]


def write_study_report(instances: list[dict], out: str | Path) -> list[Path]:
    """tables.md and three PNGs in `out`; returns their paths."""
    out = Path(out)
    by_category: dict[str, list[dict]] = {}
    for inst in instances:
        by_category.setdefault(inst["category"], []).append(inst)
    lines = ["# Preference-shift study: tables", "",
             "Generated by `python pipelines/study.py` (anchor_rm/pipeline/study_report.py). Test splits only; every",
             "'tuned' setting was chosen per seed on validation mean NTS. Cells: mean ± sd over seeds.", ""]
    rows_by_category = {}
    for cat, insts in by_category.items():
        rows = rows_for(insts)
        rows_by_category[cat] = rows
        first = insts[0]
        sizes = ", ".join(f"{name} {_n_cell([m['n'][name] for m in rows[0][1]])}" for name in [first["source"]] + first["targets"])
        lines += [f"## {cat}: source {first['source']}, student {first['student']}, teacher {first['teacher']}", "",
                  f"Seeds: {', '.join(str(i['seed']) for i in insts)}. Test pairs per seed: {sizes}.", ""]
        lines += [f"### {cat}: does the failure ANCHOR targets happen here?", ""] + premise_table(insts) + [""]
        lines += main_table(rows) + [""]
        lines += [f"### {cat}: the weak-to-strong gap and the headline, per seed", ""] + gap_table(insts) + [""]
        lines += teacher_table(insts) + [""]
        lines += [f"### {cat}: per OOD target (AOG and NTS, points)", ""] + target_table(rows, first["targets"]) + [""]
        lines += [f"### {cat}: the primary comparison (fixed before the run)", "",
                  f"{PRIMARY[0]} minus {PRIMARY[1]}, test mean OOD NTS over the headline targets "
                  f"(each seed's; seed {first['seed']}: {', '.join(first.get('headline_targets') or first['targets'])}), "
                  "paired by seed, 95% t interval with n - 1 degrees of freedom; then per seed a paired bootstrap "
                  "over test pairs.", ""]
        lines += primary_comparison(insts, rows) + [""]
        lines += [f"### {cat}: paired comparisons (per seed, same splits and teacher)", ""]
        anchor_rows = [label for label, _, _ in rows if label.startswith("ANCHOR") and "tuned" in label]
        for a in anchor_rows:
            for b in ("naive W2S", "confidence W2S (alpha tuned on val)"):
                if b in {label for label, _, _ in rows}:
                    lines.append(f"- {paired(rows, a, b)}")
        if len(anchor_rows) == 2:
            lines.append(f"- {paired(rows, anchor_rows[0], anchor_rows[1])}")
        lines.append(f"- {paired(rows, 'naive W2S', 'weak teacher', 'id_acc')}")
        modes = naive_label_modes(insts)
        for i, a in enumerate(modes):
            for b in modes[i + 1:]:
                for key in ("id_acc", "mean_nts"):
                    lines.append(f"- {paired(rows, f'naive W2S, {a} teacher labels', f'naive W2S, {b} teacher labels', key)}")
        pearson, spearman, n = correlations(insts)
        lines += [f"- drift (last layer, MSD) vs OOD drop over {n} student runs: Pearson {pearson:+.2f}, Spearman {spearman:+.2f}", ""]
    paths = _plot(by_category, rows_by_category, out)
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in paths] + [""]
    table_path = out / "tables.md"
    write_atomically(table_path, "\n".join(lines).encode())
    return [table_path, *paths]
