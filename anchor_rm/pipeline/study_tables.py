"""The tables of the preference-shift study (pipeline/study.py): mean and standard deviation over seeds of every
method, the ANCHOR lambda sweep, the settings chosen on validation, the paired comparisons behind the paper's
claims with their intervals, and drift against OOD drop. study_report.py writes them with the plots.

Selection ("tuned") uses validation splits only: the setting with the best validation mean NTS, per seed.
Every figure reported is on test splits."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from anchor_rm.evaluation.keys import validation_metrics
from anchor_rm.evaluation.metrics import accuracy_standard_error, transfer_metrics
from anchor_rm.evaluation.scores import scores_from_dict


Metrics = dict  # one model in one protocol instance: id_acc, wrg, aog{}, nts{}, mean_nts, pgr, drift, ...


def _accuracies(scores: dict) -> dict[str, float]:
    return {name: s["accuracy"] for name, s in scores.items()}


def model_metrics(instance: dict, test_scores: dict, drift: dict | None = None) -> Metrics:
    """Transfer metrics of one model's test scores against the same instance's teacher (and ceiling)."""
    source = instance["source"]
    teacher = _accuracies(instance["teacher_scores"]["test"])
    student = _accuracies(test_scores)
    ceiling = instance["ceiling_scores"]
    ceiling_acc = {source: ceiling["test"][source]["accuracy"]} if ceiling else None
    tm = transfer_metrics(teacher, student, source, ceiling_acc, headline_targets=instance.get("headline_targets"))
    targets = list(tm.aog)
    out = {"id_acc": tm.id_acc_student, "n_id": test_scores[source]["n_pairs"], "wrg": tm.wrg, "aog": tm.aog,
           "nts": tm.nts, "mean_nts": tm.mean_nts, "pgr": tm.pgr_id,
           "ood_acc": float(np.mean([student[t] for t in targets])),
           "mean_aog": float(np.mean(list(tm.aog.values()))),
           "n": {name: s["n_pairs"] for name, s in test_scores.items()}}
    out["ood_drop"] = out["wrg"] - out["mean_aog"]  # ID gain over the teacher that does not carry over OOD
    if drift:
        for choice in ("last", "middle"):
            out[f"drift_{choice}_msd"] = float(np.mean([drift[t][choice]["msd"] for t in targets]))
            out[f"drift_{choice}_cos"] = float(np.mean([drift[t][choice]["cosine"] for t in targets]))
    return out


def teacher_metrics(instance: dict) -> Metrics:
    scores = instance["teacher_scores"]["test"]
    source = instance["source"]
    targets = [t for t in scores if t != source]
    return {"id_acc": scores[source]["accuracy"], "n_id": scores[source]["n_pairs"],
            "ood_acc": float(np.mean([scores[t]["accuracy"] for t in targets])),
            "n": {name: s["n_pairs"] for name, s in scores.items()}}


def val_mean_nts(instance: dict, student: dict) -> float:
    teacher_val = scores_from_dict(instance["teacher_scores"]["val"])
    return validation_metrics(instance["source"], teacher_val, scores_from_dict(student["val"]),
                              instance.get("headline_targets"))["val/mean_nts"]


def tuned(instance: dict, keep: Callable[[dict], bool]) -> dict:
    """The student with the best validation mean NTS among those `keep` accepts."""
    candidates = [s for s in instance["students"] if keep(s, main_labels(instance))]
    if not candidates:
        raise ValueError(f"{instance['category']} seed {instance['seed']}: no student to select from")
    return max(candidates, key=lambda s: val_mean_nts(instance, s))


def main_labels(instance: dict) -> str:
    """The teacher labels every method of the instance trained on (study.json before they existed: raw)."""
    return instance.get("teacher_labels", "raw")


def _is(method: str, layers: str | None = None, lam: float | None = None,
        labels: str | None = None) -> Callable[[dict], bool]:
    """Students of `method` (and layer choice, lambda); trained on `labels`, by default the instance's main ones
    (a student records them as teacher_labels; one recorded before they existed trained on raw labels)."""
    def keep(s: dict, main: str = "raw") -> bool:
        return (s["method"] == method and (layers is None or s["anchor_layers"] == layers)
                and (lam is None or math.isclose(s["anchor_lambda"], lam))
                and s.get("teacher_labels", "raw") == (labels or main))
    return keep


def has(instance: dict, keep: Callable[..., bool]) -> bool:
    return any(keep(s, main_labels(instance)) for s in instance["students"])


def naive_label_modes(instances: Sequence[dict]) -> list[str]:
    """The kinds of teacher labels every instance has a naive W2S student on, when there are several."""
    found = [{s.get("teacher_labels", "raw") for s in inst["students"] if s["method"] == "naive"} for inst in instances]
    common = sorted(set.intersection(*found)) if found else []
    return common if len(common) > 1 else []


def rows_for(instances: Sequence[dict]) -> list[tuple[str, list[Metrics], list[str]]]:
    """(row label, metrics per seed, the setting chosen per seed) for one category's instances."""
    first = instances[0]
    layer_choices = sorted({s["anchor_layers"] for s in first["students"] if s["method"] == "anchor"},
                           key=lambda c: (c != "last", c))
    lambdas = sorted({s["anchor_lambda"] for s in first["students"] if s["method"] == "anchor"})

    def student_row(label: str, pick: Callable[[dict], dict]):
        chosen = [pick(inst) for inst in instances]
        return (label, [model_metrics(inst, s["test"], s["drift"]) for inst, s in zip(instances, chosen)],
                [s["setting"] for s in chosen])

    rows = [("weak teacher", [teacher_metrics(inst) for inst in instances], [inst["teacher"] for inst in instances])]
    if all(inst["ceiling_scores"] for inst in instances):
        rows.append(("strong ceiling (gold labels)", [model_metrics(inst, inst["ceiling_scores"]["test"]) for inst in instances],
                     [inst["student"] for inst in instances]))
    rows.append(student_row("naive W2S", lambda inst: tuned(inst, _is("naive"))))
    for labels in naive_label_modes(instances):
        rows.append(student_row(f"naive W2S, {labels} teacher labels", lambda inst, m=labels: tuned(inst, _is("naive", labels=m))))
    if all(has(inst, _is("confidence")) for inst in instances):
        rows.append(student_row("confidence W2S (alpha tuned on val)", lambda inst: tuned(inst, _is("confidence"))))
    for choice in layer_choices:
        rows.append(student_row(f"ANCHOR {choice} (lambda tuned on val)", lambda inst, c=choice: tuned(inst, _is("anchor", c))))
    for choice in layer_choices:
        for lam in lambdas:
            rows.append(student_row(f"ANCHOR {choice}, lambda {lam:g}",
                                    lambda inst, c=choice, v=lam: tuned(inst, _is("anchor", c, v))))
    return rows


def _mean_sd(values: Sequence[float | None]) -> tuple[float, float] | None:
    vals = [v for v in values if v is not None]
    if len(vals) != len(values) or not vals:
        return None
    return float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0


def _cell(values: Sequence[float | None], digits: int = 1) -> str:
    stats = _mean_sd(values)
    return "-" if stats is None else f"{stats[0]:+.{digits}f} ± {stats[1]:.{digits}f}"


def _acc_cell(values: Sequence[float]) -> str:
    stats = _mean_sd(values)
    return "-" if stats is None else f"{stats[0]:.1f} ± {stats[1]:.1f}"


def _n_cell(ns: Sequence[int]) -> str:
    return str(min(ns)) if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}"


def _get(per_seed: list[Metrics], key: str, sub: str | None = None) -> list[float | None]:
    return [(m.get(key) or {}).get(sub) if sub else m.get(key) for m in per_seed]


def main_table(rows) -> list[str]:
    lines = ["| model | ID acc (n) | WRG | mean AOG | mean NTS | PGR | drift last: MSD / cos | chosen on val |",
             "|---|---|---|---|---|---|---|---|"]
    for label, per_seed, chosen in rows:
        drift = "-"
        if per_seed[0].get("drift_last_msd") is not None:
            msd, cos = _mean_sd(_get(per_seed, "drift_last_msd")), _mean_sd(_get(per_seed, "drift_last_cos"))
            drift = f"{msd[0]:.3g} ± {msd[1]:.2g} / {cos[0]:.3f}"
        choice = "; ".join(chosen) if "tuned" in label else "-"
        pgr = "-" if label.startswith("strong ceiling") else _cell(_get(per_seed, "pgr"), 2)  # 1 by definition
        lines.append(f"| {label} | {_acc_cell(_get(per_seed, 'id_acc'))} ({_n_cell(_get(per_seed, 'n_id'))}) | "
                     f"{_cell(_get(per_seed, 'wrg'))} | {_cell(_get(per_seed, 'mean_aog'))} | "
                     f"{_cell(_get(per_seed, 'mean_nts'), 2)} | {pgr} | {drift} | {choice} |")
    return lines


def teacher_table(instances: Sequence[dict]) -> list[str]:
    """Per seed: the teacher's calibration on ID validation, raw and temperature-scaled, the temperature, which
    labels the students got, and the W2S budget (with the search's validation ID accuracies when one ran)."""
    lines = ["| seed | temperature (gold pairs) | ECE raw -> scaled | mean abs(q - 0.5) raw -> scaled | students' labels "
             "| budget: lr, epochs (search: naive W2S val ID acc by labels lr/epochs) |", "|---|---|---|---|---|---|"]
    for inst in instances:
        c = inst.get("teacher_calibration") or {}
        fit, scaled = c.get("temperature_fit"), c.get("calibrated")
        temperature = f"{fit['temperature']:.3g} ({fit['n_pairs']})" if fit else "-"
        ece = f"{c['ece']:.3f} -> {scaled['ece']:.3f}" if scaled else (f"{c['ece']:.3f}" if c else "-")
        margin = (f"{c['mean_margin']:.3f} -> {scaled['mean_margin']:.3f}" if scaled
                  else (f"{c['mean_margin']:.3f}" if c else "-"))
        budget = inst.get("budget")
        if budget:
            search = "; ".join(f"{b.get('teacher_labels', '')} {b['learning_rate']:g}/{b['epochs']}: {b['val_id_acc']:.1f}"
                               for b in budget["searched"])
            budget_cell = f"{budget['learning_rate']:g}, {budget['epochs']}" + (f" ({search})" if search else "")
        else:
            budget_cell = "-"
        lines.append(f"| {inst['seed']} | {temperature} | {ece} | {margin} | {main_labels(inst)} | {budget_cell} |")
    preferred = budget_preference(instances)
    if preferred:
        lines += ["", "Naive W2S validation ID accuracy by teacher labels and budget, mean over the seeds: " + "; ".join(
            f"{labels} {lr:g}/{epochs}: {acc:.2f}" for (labels, lr, epochs), acc in preferred) +
            f". Validation prefers {preferred[0][0][0]} labels at learning rate {preferred[0][0][1]:g}, "
            f"{preferred[0][0][2]} epochs."]
    return lines


def id_gap(instance: dict) -> tuple[float, float, float] | None:
    """The strong ceiling minus the weak teacher in ID test accuracy (points), with a 95% normal interval:
    paired over the test pairs when both carry per-pair outcomes, else from the two binomial standard errors.
    None without a ceiling."""
    ceiling = (instance.get("ceiling_scores") or {}).get("test")
    if not ceiling:
        return None
    source = instance["source"]
    t, c = instance["teacher_scores"]["test"][source], ceiling[source]
    gap = c["accuracy"] - t["accuracy"]
    if t.get("correct") and c.get("correct") and len(t["correct"]) == len(c["correct"]):
        d = (np.frombuffer(c["correct"].encode(), np.uint8).astype(float)
             - np.frombuffer(t["correct"].encode(), np.uint8).astype(float))
        se = 100 * float(np.std(d, ddof=1)) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    else:
        se = math.hypot(accuracy_standard_error(t["accuracy"], t["n_pairs"]),
                        accuracy_standard_error(c["accuracy"], c["n_pairs"]))
    return gap, gap - 1.96 * se, gap + 1.96 * se


def gap_table(instances: Sequence[dict]) -> list[str]:
    """Per seed: the weak-to-strong gap the protocol gives (ceiling minus teacher on ID test, with its interval
    and verdict), and which OOD targets the headline averages and which are flagged, and why: what every row of
    that seed stands on."""
    lines = ["| seed | teacher ID acc (n) | ceiling ID acc | gap: ceiling minus teacher (95% CI) | gap | headline targets "
             "| flagged targets |", "|---|---|---|---|---|---|---|"]
    unclear = []
    for inst in instances:
        source = inst["source"]
        teacher = inst["teacher_scores"]["test"][source]
        gap = id_gap(inst)
        if gap is None:
            ceiling_cell = gap_cell = verdict = "-"
        else:
            ceiling_cell = f"{inst['ceiling_scores']['test'][source]['accuracy']:.1f}"
            gap_cell = f"{gap[0]:+.1f} ({gap[1]:+.1f} to {gap[2]:+.1f})"
            verdict = "clear" if gap[1] > 0 else ("ceiling below" if gap[2] < 0 else "within noise")
            if verdict != "clear":
                unclear.append(str(inst["seed"]))
        flags = "; ".join(f"{t}: {why}" for t, why in (inst.get("target_flags") or {}).items()) or "-"
        headline = ", ".join(inst.get("headline_targets") or inst["targets"])
        if inst.get("headline_note"):
            headline += f" ({inst['headline_note']})"
        lines.append(f"| {inst['seed']} | {teacher['accuracy']:.1f} ({teacher['n_pairs']}) | {ceiling_cell} | {gap_cell} "
                     f"| {verdict} | {headline} | {flags} |")
    clear = len(instances) - len(unclear)
    lines += ["", f"The gap is clear (its 95% interval above zero) on {clear} of {len(instances)} seeds"
              + (f"; on seed(s) {', '.join(unclear)} this category's weak-to-strong rows stand on a protocol without a "
                 "clear gap." if unclear else ".")]
    return lines


def budget_preference(instances: Sequence[dict]) -> list[tuple[tuple[str, float, int], float]]:
    """((labels, learning rate, epochs), mean validation ID accuracy of naive W2S over the seeds), best first,
    for the settings every seed's budget search tried; [] without a search."""
    per_seed = [{(b.get("teacher_labels", "raw"), b["learning_rate"], b["epochs"]): b["val_id_acc"]
                 for b in (inst.get("budget") or {}).get("searched", [])} for inst in instances]
    common = [k for k in per_seed[0] if all(k in seed for seed in per_seed)] if per_seed else []
    # Rounded: equal pair counts summed in another order must tie, and a tie keeps the search's order.
    means = [(k, round(float(np.mean([seed[k] for seed in per_seed])), 9)) for k in common]
    return sorted(means, key=lambda item: -item[1])


def target_table(rows, targets: list[str]) -> list[str]:
    head = " | ".join(f"AOG {t} | NTS {t}" for t in targets)
    lines = [f"| model | OOD acc (mean of targets) | {head} |", "|---|---|" + "---|" * (2 * len(targets))]
    for label, per_seed, _ in rows:
        if label == "weak teacher":
            continue
        cells = " | ".join(f"{_cell(_get(per_seed, 'aog', t))} | {_cell(_get(per_seed, 'nts', t))}" for t in targets)
        lines.append(f"| {label} | {_acc_cell(_get(per_seed, 'ood_acc'))} | {cells} |")
    return lines


# Two-sided 95% Student-t quantiles by degrees of freedom: with three seeds a difference needs about
# 4.3 standard errors before it counts, not the 2 a large sample would need.
def t95(degrees_of_freedom: int) -> float:
    """The two-sided 95% quantile of Student's t (scipy), for any degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.975, degrees_of_freedom))


def paired(rows, a: str, b: str, key: str = "mean_nts") -> str:
    """a minus b per seed (same splits and teacher), with the mean, its standard error and a 95% t interval:
    the comparisons behind the claims."""
    by_label = {label: per_seed for label, per_seed, _ in rows}
    diffs = np.array([x[key] - y[key] for x, y in zip(by_label[a], by_label[b])])
    text = f"{a} minus {b}, {key}: {diffs.mean():+.2f} (per seed {', '.join(f'{d:+.2f}' for d in diffs)}"
    if len(diffs) < 2:
        return text + "; one seed: no interval)"
    se = float(np.std(diffs, ddof=1) / math.sqrt(len(diffs)))
    half = t95(len(diffs) - 1) * se
    verdict = "within noise" if abs(diffs.mean()) <= half else ("higher" if diffs.mean() > 0 else "lower")
    return text + f"; SE {se:.2f}, 95% CI {diffs.mean() - half:+.2f} to {diffs.mean() + half:+.2f}) -> {verdict}"


PRIMARY = ("ANCHOR last (lambda tuned on val)", "naive W2S")  # fixed before the study ran: issue 13, item 5


def paired_bootstrap(instance: dict, a: dict, b: dict, resamples: int = 2000, seed: int = 0) -> tuple[float, float, float] | None:
    """Student `a` minus student `b` in test mean OOD NTS within one instance, with a 95% percentile interval
    from resampling the test pairs of every split (the same resample for both models: paired). The teacher's
    accuracies are held at their values. None when the scores carry no per-pair outcomes."""
    source = instance["source"]
    names = [source, *instance["targets"]]
    if any(s["test"][name].get("correct") is None for s in (a, b) for name in names):
        return None
    teacher = _accuracies(instance["teacher_scores"]["test"])
    headline = instance.get("headline_targets")
    bits = {name: (np.frombuffer(a["test"][name]["correct"].encode(), np.uint8) - 48,
                   np.frombuffer(b["test"][name]["correct"].encode(), np.uint8) - 48) for name in names}

    def mean_nts(acc: dict[str, float]) -> float:
        return transfer_metrics(teacher, acc, source, headline_targets=headline).mean_nts

    observed = mean_nts(_accuracies(a["test"])) - mean_nts(_accuracies(b["test"]))
    rng = np.random.default_rng(seed)
    diffs = np.empty(resamples)
    for i in range(resamples):
        acc_a, acc_b = {}, {}
        for name, (bits_a, bits_b) in bits.items():
            index = rng.integers(0, len(bits_a), len(bits_a))
            acc_a[name], acc_b[name] = 100 * bits_a[index].mean(), 100 * bits_b[index].mean()
        diffs[i] = mean_nts(acc_a) - mean_nts(acc_b)
    low, high = np.percentile(diffs, [2.5, 97.5])
    return float(observed), float(low), float(high)


def primary_comparison(instances: Sequence[dict], rows) -> list[str]:
    """The one comparison fixed before the run, its t interval over seeds and a bootstrap per seed."""
    a, b = PRIMARY
    labels = {label for label, _, _ in rows}
    if a not in labels or b not in labels:
        return [f"- not run: the study has no {a if a not in labels else b} row"]
    lines = [f"- {paired(rows, a, b)}"]
    for inst in instances:
        boot = paired_bootstrap(inst, tuned(inst, _is("anchor", "last")), tuned(inst, _is("naive")))
        if boot is None:
            lines.append(f"  - seed {inst['seed']}: no per-pair outcomes stored, no bootstrap")
            continue
        verdict = "within noise" if boot[1] <= 0 <= boot[2] else ("higher" if boot[0] > 0 else "lower")
        lines.append(f"  - seed {inst['seed']}: {boot[0]:+.2f}, paired bootstrap over test pairs (2,000 resamples) "
                     f"95% interval {boot[1]:+.2f} to {boot[2]:+.2f} -> {verdict}")
    return lines


def correlations(instances: Sequence[dict]) -> tuple[float, float, int]:
    """Pearson and Spearman correlation of last-layer drift (OOD mean) with OOD drop over every student run."""
    metrics = [model_metrics(inst, s["test"], s["drift"]) for inst in instances for s in inst["students"]]
    x = np.array([m["drift_last_msd"] for m in metrics])
    y = np.array([m["ood_drop"] for m in metrics])
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return float("nan"), float("nan"), len(x)
    from scipy.stats import pearsonr, spearmanr

    return float(pearsonr(x, y).statistic), float(spearmanr(x, y).statistic), len(x)  # Spearman: ties at mean rank
