"""Does the failure ANCHOR targets happen here? Before any lambda is read, the run's naive W2S student is held against
the paper's premise: weak-to-strong training gains in-distribution while it loses out of distribution.

Two forms, each with a 95% interval from a paired bootstrap over the pairs of each test set (teacher, naive W2S and
ceiling scored on the same pairs, so their differences keep their correlation):
- absolute: WRG > 0 while the mean AOG over the headline targets < 0 (both intervals clear of 0);
- relative: on an OOD target, naive W2S recovers a smaller share of the teacher-to-ceiling gap (its PGR) than on
  ID (the shortfall's interval above 0): it keeps less of what gold training transfers there. Measured only on a
  target where the ceiling's gap over the teacher is clear of 0 (else the share is a ratio of noise).
Beside them, where the run has them: whether the frozen-representation end (a nearly frozen student: a very large
lambda) transfers better OOD than naive W2S, and whether drift predicts the OOD drop across the run's models.
The verdict: present when either form holds on the headline targets, else absent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000


@dataclass(frozen=True)
class SetCorrectness:
    """One test set: which pairs each model ranks right (True: chosen scored strictly above rejected), on the same
    pairs in the same order (scores.SplitScore.correct)."""

    dataset: str
    role: str  # "id" | "ood"
    teacher: np.ndarray
    naive: np.ndarray
    ceiling: np.ndarray | None = None
    frozen: np.ndarray | None = None  # the frozen-representation end, where the run has it

    @classmethod
    def from_strings(cls, dataset: str, role: str, teacher: str, naive: str, ceiling: str | None = None,
                     frozen: str | None = None) -> SetCorrectness:
        def bits(text):
            return None if text is None else np.frombuffer(text.encode(), dtype=np.uint8) == ord("1")

        if teacher is None or naive is None:
            raise ValueError(f"{dataset}: scores recorded before per-pair results were kept")
        sizes = {len(t) for t in (teacher, naive, ceiling, frozen) if t is not None}
        if len(sizes) != 1:
            raise ValueError(f"{dataset}: the models were scored on different numbers of pairs ({sorted(sizes)})")
        return cls(dataset, role, bits(teacher), bits(naive), bits(ceiling), bits(frozen))


def _interval(samples: np.ndarray) -> list[float]:
    finite = samples[np.isfinite(samples)]
    return [float(np.percentile(finite, 2.5)), float(np.percentile(finite, 97.5))] if finite.size else [np.nan, np.nan]


def premise_check(sets: list[SetCorrectness], headline: list[str], *, drift: list[tuple[float, float]] | None = None,
                  resamples: int = RESAMPLES, seed: int = 0, subject: str = "naive W2S") -> dict:
    """The premise check of one run (module docstring). `sets`: the ID test set and the OOD test sets; `headline`:
    the OOD targets the mean AOG averages; `drift`: (drift, OOD drop) of each of the run's models, where measured;
    `subject`: what the summary calls the model checked (evaluate.py checks the model it evaluates). Accuracies in
    points."""
    rng = np.random.default_rng(seed)
    by_name = {s.dataset: s for s in sets}
    id_set = next((s for s in sets if s.role == "id"), None)
    if id_set is None or not headline or any(t not in by_name for t in headline):
        raise ValueError(f"the premise check needs the ID set and every headline target, got {sorted(by_name)} for "
                         f"headline {headline}")
    # One resampling of pair indices per set, shared by the models: paired differences.
    draws = {s.dataset: rng.integers(0, len(s.teacher), size=(resamples, len(s.teacher))) for s in sets}

    def boot(s: SetCorrectness, model: np.ndarray) -> np.ndarray:
        return 100.0 * model[draws[s.dataset]].mean(axis=1)

    def point(model: np.ndarray) -> float:
        return 100.0 * float(model.mean())

    wrg = point(id_set.naive) - point(id_set.teacher)
    wrg_boot = boot(id_set, id_set.naive) - boot(id_set, id_set.teacher)
    aog = {t: point(by_name[t].naive) - point(by_name[t].teacher) for t in headline}
    aog_boot = np.mean([boot(by_name[t], by_name[t].naive) - boot(by_name[t], by_name[t].teacher) for t in headline], axis=0)
    wrg_interval, aog_interval = _interval(wrg_boot), _interval(aog_boot)
    absolute = {"wrg": wrg, "wrg_interval": wrg_interval, "mean_aog": float(np.mean(list(aog.values()))),
                "mean_aog_interval": aog_interval, "aog": aog,
                "present": bool(wrg_interval[0] > 0 and aog_interval[1] < 0)}

    relative = None
    if id_set.ceiling is not None:
        def pgr(s: SetCorrectness) -> tuple[float, np.ndarray, list[float]]:
            gap_boot = boot(s, s.ceiling) - boot(s, s.teacher)
            with np.errstate(divide="ignore", invalid="ignore"):
                share_boot = (boot(s, s.naive) - boot(s, s.teacher)) / gap_boot
            gap = point(s.ceiling) - point(s.teacher)
            share = (point(s.naive) - point(s.teacher)) / gap if gap else float("nan")
            return share, share_boot, _interval(gap_boot)

        id_pgr, id_boot, id_gap = pgr(id_set)
        targets = {}
        for name in headline:
            s = by_name[name]
            if s.ceiling is None:
                continue
            share, share_boot, gap = pgr(s)
            measurable = gap[0] > 0 and id_gap[0] > 0
            shortfall = _interval(id_boot - share_boot) if measurable else [np.nan, np.nan]
            targets[name] = {"pgr": share, "ceiling_gap_interval": gap, "measurable": bool(measurable),
                             "shortfall": id_pgr - share, "shortfall_interval": shortfall,
                             "present": bool(measurable and shortfall[0] > 0)}
        relative = {"id_pgr": id_pgr, "id_ceiling_gap_interval": id_gap, "targets": targets,
                    "present": any(t["present"] for t in targets.values())}

    frozen = None
    if all(by_name[t].frozen is not None for t in headline):
        difference = float(np.mean([point(by_name[t].frozen) - point(by_name[t].naive) for t in headline]))
        difference_boot = np.mean([boot(by_name[t], by_name[t].frozen) - boot(by_name[t], by_name[t].naive)
                                   for t in headline], axis=0)
        interval = _interval(difference_boot)
        frozen = {"mean_ood_difference": difference, "interval": interval, "better": bool(interval[0] > 0)}

    drift_block = None
    if drift is not None and len(drift) >= 3:
        from scipy.stats import pearsonr

        values = np.asarray(drift, dtype=float)
        r = pearsonr(values[:, 0], values[:, 1])
        drift_block = {"models": len(drift), "pearson": float(r.statistic), "p_value": float(r.pvalue)}

    present = absolute["present"] or bool(relative and relative["present"])
    return {"verdict": "present" if present else "absent", "resamples": resamples, "headline_targets": list(headline),
            "absolute": absolute, "relative": relative, "frozen_end": frozen, "drift": drift_block,
            "summary": premise_summary(present, absolute, relative, subject)}


def not_measured(why: str) -> dict:
    """A report's premise block where no check could be made, saying why."""
    return {"verdict": "not measured", "summary": f"the premise check was not made: {why}"}


def jsonable(value):
    """`value` with every float that is not finite (a share of a zero gap) as None: what report.json can hold."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def premise_summary(present: bool, absolute: dict, relative: dict | None, subject: str = "naive W2S") -> str:
    """One line: the verdict and the numbers behind it."""
    a = absolute
    parts = [f"{subject} WRG {a['wrg']:+.1f} [{a['wrg_interval'][0]:+.1f}, {a['wrg_interval'][1]:+.1f}], mean AOG "
             f"{a['mean_aog']:+.1f} [{a['mean_aog_interval'][0]:+.1f}, {a['mean_aog_interval'][1]:+.1f}]"]
    if relative is not None:
        shares = [f"{name} {t['pgr']:.2f}" + ("" if t["measurable"] else " (no clear ceiling gap)")
                  for name, t in relative["targets"].items()]
        parts.append(f"PGR ID {relative['id_pgr']:.2f} against " + ", ".join(shares))
    if present:
        forms = [name for name, form in (("absolute", absolute), ("relative", relative)) if form and form["present"]]
        state = f"present here ({' and '.join(forms)} form)"
    else:
        state = "absent here (neither form beyond its 95% interval)"
    return f"the failure ANCHOR targets is {state}: " + "; ".join(parts)


def instance_premise(instance: dict, resamples: int = RESAMPLES) -> dict:
    """The premise check of one study instance (a study.json record): its naive W2S on its main teacher labels
    against its teacher and ceiling on the test splits; its last-layer ANCHOR student at the largest lambda as the
    frozen end (that lambda, and the share of naive W2S's drift it removes, beside it); drift against the OOD drop
    (WRG minus mean AOG) across its students."""
    headline = list(instance.get("headline_targets") or instance["targets"])
    labels = instance.get("teacher_labels")
    naive = next(s for s in instance["students"] if s["method"] == "naive" and s.get("teacher_labels", labels) == labels)
    anchored = [s for s in instance["students"] if s["method"] == "anchor" and s.get("anchor_layers") == "last"]
    frozen = max(anchored, key=lambda s: s["anchor_lambda"]) if anchored else None
    teacher, ceiling = instance["teacher_scores"]["test"], (instance.get("ceiling_scores") or {}).get("test")

    def correct(scores: dict | None, name: str) -> str | None:
        return None if scores is None else scores[name].get("correct")

    if not headline:
        raise ValueError("no headline target")
    if any(correct(scores, name) is None for scores in (teacher, naive["test"]) for name in [instance["source"], *headline]):
        raise ValueError("scores recorded before per-pair results were kept")
    sets = [SetCorrectness.from_strings(name, "id" if name == instance["source"] else "ood", correct(teacher, name),
                                        correct(naive["test"], name), correct(ceiling, name),
                                        correct(frozen["test"], name) if frozen else None)
            for name in [instance["source"], *headline]]

    def last_drift(student: dict) -> float:
        return float(np.mean([student["drift"][t]["last"]["msd"] for t in headline]))

    def ood_drop(student: dict) -> float:
        wrg = student["test"][instance["source"]]["accuracy"] - teacher[instance["source"]]["accuracy"]
        return wrg - float(np.mean([student["test"][t]["accuracy"] - teacher[t]["accuracy"] for t in headline]))

    measured = [s for s in instance["students"] if s.get("drift")]
    check = premise_check(sets, headline, drift=[(last_drift(s), ood_drop(s)) for s in measured], resamples=resamples,
                          seed=instance["seed"])
    if frozen is not None and check["frozen_end"] is not None:
        check["frozen_end"].update(anchor_lambda=frozen["anchor_lambda"],
                                   drift_removed=1.0 - last_drift(frozen) / last_drift(naive))
    return check


def premise_table(instances: list[dict]) -> list[str]:
    """The premise check per instance, as Markdown: each form with its 95% interval, then the verdict."""
    lines = ["| seed | naive WRG [95%] | naive mean AOG [95%] | PGR ID | PGR per headline target (shortfall [95%]) | "
             "frozen end minus naive, mean OOD [95%] | drift vs OOD drop (Pearson, models) | the failure |",
             "|---|---|---|---:|---|---|---|---|"]
    present = 0
    for instance in instances:
        try:
            c = instance_premise(instance)
        except (ValueError, KeyError, StopIteration) as why:  # an instance without what the check reads
            lines.append(f"| {instance['seed']} | not measured: {why} | | | | | | - |")
            continue
        a, r, f, d = c["absolute"], c["relative"], c["frozen_end"], c["drift"]
        present += c["verdict"] == "present"
        shares = "-" if r is None else ", ".join(
            f"{name} {t['pgr']:.2f} ({t['shortfall_interval'][0]:+.2f}, {t['shortfall_interval'][1]:+.2f})"
            if t["measurable"] else f"{name} {t['pgr']:.2f} (no clear ceiling gap)" for name, t in r["targets"].items())
        drift = "-" if d is None else f"{d['pearson']:+.2f} ({d['models']})"
        frozen = "-" if f is None else (f"{f['mean_ood_difference']:+.1f} [{f['interval'][0]:+.1f}, {f['interval'][1]:+.1f}] "
                                        f"(lambda {f.get('anchor_lambda', float('nan')):g}, "
                                        f"{100 * f.get('drift_removed', float('nan')):.0f}% of naive's drift removed)")
        lines.append(f"| {instance['seed']} | {a['wrg']:+.1f} [{a['wrg_interval'][0]:+.1f}, {a['wrg_interval'][1]:+.1f}] | "
                     f"{a['mean_aog']:+.1f} [{a['mean_aog_interval'][0]:+.1f}, {a['mean_aog_interval'][1]:+.1f}] | "
                     f"{'-' if r is None else format(r['id_pgr'], '.2f')} | {shares} | {frozen} | "
                     f"{drift} | **{c['verdict']}** |")
    lines += ["", f"The failure ANCHOR targets is present on {present} of {len(instances)} seeds: absolute (WRG above 0 "
              "and mean AOG below 0, both beyond their intervals) or relative (a smaller share of the teacher-to-ceiling "
              "gap recovered on a headline target than on ID, beyond its interval). Paired bootstraps over each test "
              f"set's pairs ({RESAMPLES} resamples; anchor_rm/evaluation/premise.py)."]
    return lines
