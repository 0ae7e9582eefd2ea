"""The figures docs/results.md cites about the harmless study, recomputed from the committed study.json files
(not a test: nothing is trained or scored).

    .venv/bin/python bench/study_checks.py              # every section
    .venv/bin/python bench/study_checks.py --items 1,7  # some of them
    .venv/bin/python bench/study_checks.py --study docs/results/harmless-full-5-seeds/study.json --items 2,4,5,7,9

Reads docs/results/harmless-5-seeds/study.json (the current protocol: harmless, 5 seeds) and
docs/results/study.json (the previous protocol). Metrics, the validation pick of the 'tuned' rows and the
paired t intervals are those of anchor_rm/pipeline/study_report.py (model_metrics, rows_for, tuned, val_mean_nts,
paired), so they are the figures tables.md shows. What the project has no function for is computed here:
the covariance split of a variance over seeds, per-pair outcome counts, exact ties in the validation pick,
a correlation over seeds.

Prints plain text: the primary comparison (as tables.md gives it), then one section per item:
  1  HHH harmless: split sizes, teacher and ceiling accuracies, the share of the seed-to-seed variance it
     carries, its part of the primary comparison, the pairs on which the two students differ
  2  WRG of every W2S student per seed
  3  what study.json stores per split; the ID accuracies the protocol-gap tables of docs/results.md show;
     naive W2S's WRG against the teacher's mean abs(q - 0.5) (taken from those tables: no committed file has it)
  4  the lambda sweep, paired by seed
  5  confidence W2S against the teacher per seed
  6  previous protocol: harmless ceiling minus teacher on ID test
  7  the validation pick per seed and layer choice, exact ties, and the rows had ties gone to the largest lambda
  8  seed 2: naive W2S against ANCHOR last at lambda 1e-5, pair by pair
  9  training time (train_seconds)
  10 each headline target's part of the primary comparison (its mean and its share of the variance over seeds)
Accuracies and differences are in points.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from anchor_rm.evaluation.metrics import CHANCE, SIGNAL_STANDARD_ERRORS, accuracy_standard_error  # noqa: E402
from anchor_rm.pipeline import study_tables as sr  # noqa: E402

STUDY = ROOT / "docs" / "results" / "harmless-5-seeds" / "study.json"
PREVIOUS = ROOT / "docs" / "results" / "study.json"
HH, HHH = "hh-harmless-base", "hhh-harmless"
NAIVE, TUNED_LAST, TUNED_MIDDLE = "naive W2S", "ANCHOR last (lambda tuned on val)", "ANCHOR middle (lambda tuned on val)"
CONFIDENCE = "confidence W2S (alpha tuned on val)"
# The teacher's mean abs(q - 0.5) on student-train, seeds 0-4: docs/results.md's harmless protocol-gap tables
# (bench/protocol_gap.py's printed table). No committed file holds them; study.json stores no soft labels.
DOC_MARGINS = {0: 0.025, 1: 0.015, 2: 0.026, 3: 0.025, 4: 0.012}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", default="1,2,3,4,5,6,7,8,9", help="comma-separated items to print (default: all)")
    parser.add_argument("--study", type=Path, default=STUDY,
                        help="the study.json to read (default: %(default)s); items 1, 3 and 8 are about that study's "
                             "HHH harmless and teacher margins, and item 6 always reads the previous protocol's")
    return parser.parse_args(argv)


def load(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())["instances"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"{path}: not a study.json that pipelines/study.py wrote ({type(exc).__name__}: {exc})")


def seeds_text(values, digits: int = 2, sign: bool = True) -> str:
    return ", ".join(f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}" for v in values)


def with_targets(rows):
    """rows_for's rows with each per-target AOG and NTS, and the ID penalty, as keys of their own, so that
    study_report.paired can compare them: 'nts hh-harmless-base', 'aog hhh-harmless', 'id_penalty', ..."""
    for _, per_seed, _ in rows:
        for m in per_seed:
            for name in m.get("nts") or {}:
                m[f"nts {name}"], m[f"aog {name}"] = m["nts"][name], m["aog"][name]
                m["id_penalty"] = m["aog"][name] - m["nts"][name]  # max(0, teacher ID - student ID)
    return rows


def by_label(rows) -> dict[str, list[dict]]:
    return {label: per_seed for label, per_seed, _ in rows}


def covariance_share(total: np.ndarray, part: np.ndarray) -> float:
    """cov(total, part) / var(total) over seeds: the parts of a sum have shares that add up to 1."""
    return float(np.cov(total, part, ddof=1)[0, 1] / np.var(total, ddof=1))


def student(inst: dict, setting: str) -> dict:
    return next(s for s in inst["students"] if s["setting"] == setting)


def outcomes(scores: dict, name: str) -> np.ndarray:
    return np.frombuffer(scores[name]["correct"].encode(), np.uint8) - 48


def differing(a: dict, b: dict, split: str, names=None) -> int:
    """Pairs of `split` that one student gets right and the other wrong."""
    return sum(int((outcomes(a[split], n) != outcomes(b[split], n)).sum()) for n in (names or a[split]))


def primary(h5, rows) -> None:
    print("== the primary comparison (study_report.primary_comparison, as tables.md) ==")
    for line in sr.primary_comparison(h5, rows):
        print(line)


def item1(h5, rows) -> None:
    print("== item 1: HHH harmless and the noise ==")
    sizes = [inst["split_sizes"][HHH] for inst in h5]
    print("HHH val pairs per seed (0-4):", ", ".join(str(s["val"]) for s in sizes))
    print("HHH test pairs per seed:", ", ".join(str(s["test"]) for s in sizes))
    print("HHH val + test per seed:", ", ".join(str(s["val"] + s["test"]) for s in sizes))
    print("standard error of one accuracy at chance on the test pairs:",
          seeds_text([accuracy_standard_error(CHANCE, s["test"]) for s in sizes], 1, sign=False))
    teacher = [inst["teacher_scores"]["test"][HHH]["accuracy"] for inst in h5]
    ceiling = [inst["ceiling_scores"]["test"][HHH]["accuracy"] for inst in h5]
    print(f"teacher HHH test accuracy: {seeds_text(teacher, 1, sign=False)}; below chance ({CHANCE:g}) on "
          f"{sum(a < CHANCE for a in teacher)} of {len(h5)} seeds")
    print(f"ceiling HHH test accuracy: {seeds_text(ceiling, 1, sign=False)}; below chance on seeds "
          f"{[inst['seed'] for inst, a in zip(h5, ceiling) if a < CHANCE]}")
    print(f"ceiling HHH val accuracy, and whether it is above chance by more than {SIGNAL_STANDARD_ERRORS:g} standard "
          "errors (metrics.choose_headline_targets' signal rule):")
    for inst in h5:
        n, acc = inst["split_sizes"][HHH]["val"], inst["ceiling_scores"]["val"][HHH]["accuracy"]
        margin = SIGNAL_STANDARD_ERRORS * accuracy_standard_error(CHANCE, n)
        print(f"  seed {inst['seed']}: {acc:.1f} on {n} val pairs; needs more than {CHANCE + margin:.1f} "
              f"({margin:.1f} above chance): {'passes' if acc - CHANCE > margin else 'does not pass'}")

    per_label = by_label(rows)
    print("share of the seed-to-seed variance of mean NTS = (NTS HH + NTS HHH) / 2 that each half carries "
          "(cov(mean NTS, half) / var(mean NTS), ddof 1):")
    for label in (NAIVE, TUNED_LAST):
        total = np.array([m["mean_nts"] for m in per_label[label]])
        hh, hhh = (np.array([m[f"nts {t}"] / 2 for m in per_label[label]]) for t in (HH, HHH))
        print(f"  {label}: mean NTS per seed {seeds_text(total)}; sd {np.std(total, ddof=1):.2f}, variance "
              f"{np.var(total, ddof=1):.1f}; HHH share {covariance_share(total, hhh):.0%}, HH share "
              f"{covariance_share(total, hh):.0%}")
    diff = {key: np.array([a[key] - b[key] for a, b in zip(per_label[TUNED_LAST], per_label[NAIVE])])
            for key in ("mean_nts", f"nts {HH}", f"nts {HHH}", f"aog {HH}", f"aog {HHH}", "id_penalty")}
    total = diff["mean_nts"]
    print(f"  primary difference ({TUNED_LAST} minus {NAIVE}): per seed {seeds_text(total)}; HHH share "
          f"{covariance_share(total, diff[f'nts {HHH}'] / 2):.0%}, HH share {covariance_share(total, diff[f'nts {HH}'] / 2):.0%}")
    print("  for comparison, other splits of the primary difference's variance:")
    for key in (f"aog {HHH}", f"nts {HHH}"):
        print(f"    var({key.split()[0].upper()} HHH / 2) / var(difference), its covariances dropped: "
              f"{np.var(diff[key] / 2, ddof=1) / np.var(total, ddof=1):.0%}")
    print(f"    three-way covariance shares: AOG HH / 2 {covariance_share(total, diff[f'aog {HH}'] / 2):.0%}, "
          f"AOG HHH / 2 {covariance_share(total, diff[f'aog {HHH}'] / 2):.0%}, "
          f"ID penalty {covariance_share(total, -diff['id_penalty']):.0%}")
    print(f"the primary difference's mean {total.mean():+.2f} split by NTS halves: HHH {np.mean(diff[f'nts {HHH}'] / 2):+.2f}, "
          f"HH {np.mean(diff[f'nts {HH}'] / 2):+.2f}")
    print(f"  split by AOG halves and the ID penalty: HHH {np.mean(diff[f'aog {HHH}'] / 2):+.2f}, "
          f"HH {np.mean(diff[f'aog {HH}'] / 2):+.2f}, ID penalty {np.mean(-diff['id_penalty']):+.2f}")
    print("HHH test pairs on which tuned ANCHOR last and naive W2S differ (ANCHOR right / naive right):")
    total_pairs = 0
    for inst in h5:
        a, b = sr.tuned(inst, sr._is("anchor", "last")), sr.tuned(inst, sr._is("naive"))
        x, y = outcomes(a["test"], HHH), outcomes(b["test"], HHH)
        only_a, only_b = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
        total_pairs += only_a + only_b
        print(f"  seed {inst['seed']} ({a['setting']}): {only_a + only_b} ({only_a} / {only_b})")
    print(f"  in all: {total_pairs}")
    print("HH harmless-base alone:", sr.paired(rows, TUNED_LAST, NAIVE, f"nts {HH}"))


def w2s_wrg(inst: dict) -> dict[str, float]:
    return {s["setting"]: sr.model_metrics(inst, s["test"])["wrg"] for s in inst["students"]}


def item2(h5) -> None:
    print("== item 2: WRG (student minus teacher, ID test) of the W2S students per seed ==")
    # Seeds 0-1 and 2-4: the split issue 26 asked about; later seeds (the 10-seed run) apart, then all of them.
    last = max(inst["seed"] for inst in h5)
    groups = {"seeds 0-1": [], "seeds 2-4": []} | ({f"seeds 5-{last}": []} if last >= 5 else {}) | {"all seeds": []}
    for inst in h5:
        wrg = w2s_wrg(inst)
        above = [v for v in wrg.values() if v > 0]
        group = "seeds 0-1" if inst["seed"] <= 1 else "seeds 2-4" if inst["seed"] <= 4 else f"seeds 5-{last}"
        groups[group] += list(wrg.values())
        groups["all seeds"] += list(wrg.values())
        print(f"seed {inst['seed']}: {len(above)} of {len(wrg)} above the teacher; range {min(wrg.values()):+.2f} to "
              f"{max(wrg.values()):+.2f}; " + ", ".join(f"{k} {v:+.2f}" for k, v in wrg.items()))
    for name, values in groups.items():
        if not values:
            continue
        above = [v for v in values if v > 0]
        print(f"{name}: {len(above)} of {len(values)} above the teacher; range {min(values):+.2f} to {max(values):+.2f}"
              + (f"; of those above, {min(above):+.2f} to {max(above):+.2f}" if above else ""))


def item3(h5, rows) -> None:
    print("== item 3: the teacher's soft labels and naive W2S's WRG ==")
    fields = sorted({k for inst in h5 for split in ("val", "test") for s in inst["teacher_scores"][split].values() for k in s})
    print("fields study.json stores per split:", ", ".join(fields), "(no soft labels, no margin)")
    print("study.json's ID accuracies, the columns of docs/results.md's harmless protocol-gap tables "
          "(teacher val, ceiling val, gap val | teacher test, ceiling test, gap test):")
    for inst in h5:
        acc = {f"{model} {split}": inst[f"{model}_scores"][split][inst["source"]]["accuracy"]
               for model in ("teacher", "ceiling") for split in ("val", "test")}
        print(f"  seed {inst['seed']}: " + " | ".join(
            f"{acc[f'teacher {split}']:.1f}, {acc[f'ceiling {split}']:.1f}, "
            f"{acc[f'ceiling {split}'] - acc[f'teacher {split}']:+.1f}" for split in ("val", "test")))
    margins = np.array([DOC_MARGINS[inst["seed"]] for inst in h5])
    wrg = np.array([m["wrg"] for m in by_label(rows)[NAIVE]])
    print(f"teacher mean abs(q - 0.5) per seed (docs/results.md, no committed file): {seeds_text(margins, 3, sign=False)}; "
          f"range {margins.min():.3f}-{margins.max():.3f}")
    print(f"naive W2S WRG per seed: {seeds_text(wrg)}")
    print(f"correlation over the {len(h5)} seeds: Pearson r {np.corrcoef(margins, wrg)[0, 1]:+.2f}, "
          f"Spearman {spearmanr(margins, wrg).statistic:+.2f}")


def item4(h5, rows) -> None:
    print("== item 4: the lambda sweep, test mean NTS paired by seed (study_report.paired) ==")
    per_label = by_label(rows)
    for layer in ("last", "middle"):
        prefix = f"ANCHOR {layer}, lambda "
        sweep = {label[len(prefix):]: label for label in per_label if label.startswith(prefix)}  # the study's lambdas
        pairs = [(sweep["0.001"], sweep["0.0001"]), (sweep["0.001"], sweep["1e-05"])]
        pairs += [(label, NAIVE) for label in sweep.values()]  # every lambda against naive W2S
        for a, b in pairs:
            diffs = [x["mean_nts"] - y["mean_nts"] for x, y in zip(per_label[a], per_label[b])]
            print(f"{sr.paired(rows, a, b)}; sd of the difference {np.std(diffs, ddof=1):.2f}")
    print("seed-to-seed mean ± sd of each row's mean NTS:")
    for label in [NAIVE] + [l for l in per_label if l.startswith("ANCHOR") and "lambda " in l and "tuned" not in l]:
        print(f"  {label}: {sr._cell(sr._get(per_label[label], 'mean_nts'), 2)}")
    for label, _, chosen in rows:
        if label in (TUNED_LAST, TUNED_MIDDLE):
            print(f"{label} chose, seeds {', '.join(str(i['seed']) for i in h5)}: {'; '.join(chosen)}")


def item5(h5, rows) -> None:
    print("== item 5: confidence W2S against the teacher on ID test ==")
    per_label = by_label(rows)
    conf, naive = per_label[CONFIDENCE], per_label[NAIVE]
    for inst, m in zip(h5, conf):
        print(f"seed {inst['seed']}: confidence W2S {m['id_acc']:.2f}, teacher "
              f"{inst['teacher_scores']['test'][inst['source']]['accuracy']:.2f}, WRG {m['wrg']:+.2f}")
    wrg = [m["wrg"] for m in conf]
    print(f"confidence W2S WRG per seed {seeds_text(wrg)}: {sum(w > 0 for w in wrg)} seed(s) above the teacher, "
          f"{sum(w < 0 for w in wrg)} below; WRG {sr._cell(wrg)}, ID acc {sr._acc_cell(sr._get(conf, 'id_acc'))}")
    print(f"naive W2S WRG {sr._cell(sr._get(naive, 'wrg'))}")


def item6(previous) -> None:
    print("== item 6: previous protocol, harmless ceiling minus teacher on ID test ==")
    rows = sr.rows_for([inst for inst in previous if inst["category"] == "harmless"])
    per_label = by_label(rows)
    diffs = [c["id_acc"] - t["id_acc"] for c, t in zip(per_label["strong ceiling (gold labels)"], per_label["weak teacher"])]
    print(sr.paired(rows, "strong ceiling (gold labels)", "weak teacher", "id_acc"))
    print(f"per seed sd of the difference: {np.std(diffs, ddof=1):.2f}")


def first_and_last_pick(inst: dict, layer: str) -> tuple[list[tuple[dict, float]], dict, dict]:
    """Each candidate with its validation mean NTS (study_report.val_mean_nts); study_report.tuned's pick
    (the first best, in study.json order); and the last best, the pick had ties gone the other way."""
    keep = sr._is("anchor", layer)
    scored = [(s, sr.val_mean_nts(inst, s)) for s in inst["students"] if keep(s, sr.main_labels(inst))]
    best = max(v for _, v in scored)
    last = [s for s, v in scored if v == best][-1]
    return scored, sr.tuned(inst, keep), last


def item7(h5, rows) -> None:
    print("== item 7: the validation pick and exact ties (study_report.tuned: max, so the first best wins) ==")
    other = {}
    for layer in ("last", "middle"):
        other[layer] = []
        for inst in h5:
            scored, pick, last = first_and_last_pick(inst, layer)
            best = max(v for _, v in scored)
            tied = [s for s, v in scored if v == best]
            print(f"seed {inst['seed']} {layer}: " + ", ".join(f"{s['anchor_lambda']:g} {v:+.4f}" for s, v in scored)
                  + f" -> {pick['anchor_lambda']:g}" + (f"; EXACT TIE at the best: {[s['anchor_lambda'] for s in tied]}"
                                                         if len(tied) > 1 else ""))
            if len(tied) > 1:
                source = inst["source"]
                print(f"  teacher val ID {inst['teacher_scores']['val'][source]['accuracy']:.2f}; tied candidates' val "
                      "accuracies: " + "; ".join(f"{s['anchor_lambda']:g}: " + ", ".join(
                          f"{n} {s['val'][n]['accuracy']:.2f}" for n in s["val"]) for s in tied))
                print("  their test mean NTS: " + ", ".join(
                    f"{s['anchor_lambda']:g} {sr.model_metrics(inst, s['test'])['mean_nts']:+.2f}" for s in tied))
            other[layer].append(last)
    ties_last = [(f"ANCHOR {layer} (ties to the largest lambda)",
                  [sr.model_metrics(inst, s["test"]) for inst, s in zip(h5, other[layer])],
                  [s["setting"] for s in other[layer]]) for layer in ("last", "middle")]
    both = rows + ties_last
    per_label = by_label(both)
    print("as committed (ties to the first, smallest lambda):")
    print(f"  {TUNED_MIDDLE}: mean NTS {sr._cell(sr._get(per_label[TUNED_MIDDLE], 'mean_nts'), 2)}")
    print(f"  {sr.paired(both, TUNED_MIDDLE, NAIVE)}")
    print(f"  {sr.paired(both, TUNED_LAST, TUNED_MIDDLE)}")
    print("had ties gone to the largest lambda:")
    for label, per_seed, chosen in ties_last:
        print(f"  {label}: mean NTS {sr._cell(sr._get(per_seed, 'mean_nts'), 2)}; chose {'; '.join(chosen)}")
    print(f"  {sr.paired(both, ties_last[1][0], NAIVE)}")
    print(f"  {sr.paired(both, ties_last[0][0], ties_last[1][0])}")


def item8(h5) -> None:
    print("== item 8: seed 2, naive W2S against ANCHOR last at lambda 1e-5 ==")
    inst = next(i for i in h5 if i["seed"] == 2)
    naive, anchor = student(inst, "naive"), sr.tuned(inst, sr._is("anchor", "last"))
    print(f"seed 2's tuned ANCHOR last: {anchor['setting']}")
    for split in ("test", "val"):
        for name in naive[split]:
            print(f"  {split} {name}: {len(naive[split][name]['correct'])} pairs, {differing(naive, anchor, split, [name])} "
                  f"outcomes differ; accuracy {naive[split][name]['accuracy']:.1f} / {anchor[split][name]['accuracy']:.1f}")
    print(f"  test pairs in all: {sum(len(naive['test'][n]['correct']) for n in naive['test'])}")
    for name in naive["drift"]:
        print(f"  drift MSD {name}: " + "; ".join(
            f"{layer} {naive['drift'][name][layer]['msd']:.6f} / {anchor['drift'][name][layer]['msd']:.6f}"
            for layer in ("last", "middle")))
    print("test outcomes (all three sets) that lambda 1e-5 changes against naive W2S, per seed:")
    for inst in h5:
        base, total = student(inst, "naive"), sum(len(v["correct"]) for v in student(inst, "naive")["test"].values())
        counts = {layer: differing(base, student(inst, f"anchor {layer} lambda=1e-05"), "test") for layer in ("last", "middle")}
        print(f"  seed {inst['seed']}: last {counts['last']}, middle {counts['middle']} of {total}")


def item9(h5) -> None:
    print("== item 9: training time (train_seconds: the training loop only) ==")
    seconds = [s["train_seconds"] for inst in h5 for s in inst["students"]]
    print(f"students: {len(seconds)}; train_seconds sum {sum(seconds):,.1f} s; per student {min(seconds):.1f}-{max(seconds):.1f} s")
    print("per seed: " + ", ".join(f"seed {inst['seed']} {sum(s['train_seconds'] for s in inst['students']):.0f} s" for inst in h5))


def item10(h5, rows) -> None:
    print("== item 10: each headline target's part of the primary comparison (mean NTS = mean over the headline) ==")
    per_label = by_label(rows)
    headlines = [inst.get("headline_targets") or [] for inst in h5]
    if not all(headlines):
        print("a seed records no headline targets: not split")
        return
    targets = list(dict.fromkeys(t for h in sorted(headlines, key=len, reverse=True) for t in h))
    print(f"headline targets: {', '.join(targets)}")
    usual = max(headlines, key=headlines.count)
    for inst, h in zip(h5, headlines):
        if h != usual:
            print(f"  seed {inst['seed']}'s headline: {', '.join(h)} (most seeds': {', '.join(usual)})")
    for label in (NAIVE, TUNED_LAST):
        print(f"  {label}: " + "; ".join(
            f"NTS {t} per seed {seeds_text([m[f'nts {t}'] for m in per_label[label]])}" for t in targets))
    # A target's part of a seed's mean NTS: its difference over that seed's headline size, 0 where it is not in
    # that seed's headline; the parts add up to the seed's difference of mean NTS.
    part = {t: np.array([(a[f"nts {t}"] - b[f"nts {t}"]) / len(h) if t in h else 0.0
                         for a, b, h in zip(per_label[TUNED_LAST], per_label[NAIVE], headlines)]) for t in targets}
    total = sum(part.values())
    print(f"{TUNED_LAST} minus {NAIVE}, mean NTS per seed {seeds_text(total)} (mean {total.mean():+.2f}, "
          f"sd {np.std(total, ddof=1):.2f}); per target (its difference over the seed's headline size, 0 where "
          f"not in it):")
    for t in targets:
        print(f"  {t}: per seed {seeds_text(part[t])}; its part of the mean {part[t].mean():+.2f}; "
              f"share of the variance {covariance_share(total, part[t]):.0%}")
    for t in targets:
        print(f"  {t} alone (every seed): {sr.paired(rows, TUNED_LAST, NAIVE, f'nts {t}')}")


def main(argv=None) -> int:
    args = parse_args(argv)
    items = {x.strip() for x in args.items.split(",") if x.strip()}
    if not items <= {str(i) for i in range(1, 11)}:
        raise SystemExit(f"--items: expected numbers 1-10, got {args.items!r}")
    items = {int(x) for x in items}
    h5 = load(args.study)
    rows = with_targets(sr.rows_for(h5))
    shown = args.study.resolve()
    print(f"{shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown}: {len(h5)} seeds ({', '.join(str(i['seed']) for i in h5)}), "
          f"{sum(len(i['students']) for i in h5)} students")
    print()
    primary(h5, rows)
    sections = {1: lambda: item1(h5, rows), 2: lambda: item2(h5), 3: lambda: item3(h5, rows),
                4: lambda: item4(h5, rows), 5: lambda: item5(h5, rows), 6: lambda: item6(load(PREVIOUS)),
                7: lambda: item7(h5, rows), 8: lambda: item8(h5), 9: lambda: item9(h5),
                10: lambda: item10(h5, rows)}
    for item in sorted(items):
        print()
        sections[item]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
