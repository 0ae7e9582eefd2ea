"""The premise check (anchor_rm/evaluation/premise.py): does naive W2S show the failure ANCHOR targets, in its absolute form
(WRG > 0, mean AOG < 0) or its relative one (a smaller share of the teacher-to-ceiling gap recovered OOD than ID),
each beyond its bootstrap interval."""

import numpy as np
import pytest

from anchor_rm.evaluation.premise import SetCorrectness, premise_check

pytestmark = pytest.mark.timeout(60)


def _right(n: int, points: float, seed: int) -> np.ndarray:
    """n pairs of which `points`% are ranked right, in a seeded order."""
    correct = np.zeros(n, dtype=bool)
    correct[: round(n * points / 100)] = True
    return np.random.default_rng(seed).permutation(correct)


def _set(name, role, teacher, naive, ceiling=None, frozen=None, n=2000):
    return SetCorrectness(name, role, _right(n, teacher, 1), _right(n, naive, 2),
                          None if ceiling is None else _right(n, ceiling, 3), None if frozen is None else _right(n, frozen, 4))


def test_a_student_that_gains_id_and_loses_ood_shows_the_absolute_form():
    check = premise_check([_set("src", "id", 60, 70, 80), _set("a", "ood", 60, 50, 70), _set("b", "ood", 62, 55, 70)],
                          ["a", "b"])
    assert check["verdict"] == "present" and check["absolute"]["present"]
    assert check["absolute"]["wrg"] == pytest.approx(10.0) and check["absolute"]["mean_aog"] == pytest.approx(-8.5)
    lo, hi = check["absolute"]["mean_aog_interval"]
    assert lo < -8.5 < hi < 0 and "is present here (absolute and relative form)" in check["summary"]


def test_a_smaller_share_of_the_gap_recovered_ood_is_the_relative_form():
    # ID: teacher 60, naive 70, ceiling 80 (PGR 0.5); OOD: teacher 60, naive 62, ceiling 80 (PGR 0.1)
    check = premise_check([_set("src", "id", 60, 70, 80), _set("a", "ood", 60, 62, 80)], ["a"])
    assert not check["absolute"]["present"] and check["relative"]["present"] and check["verdict"] == "present"
    target = check["relative"]["targets"]["a"]
    assert target["pgr"] == pytest.approx(0.1) and check["relative"]["id_pgr"] == pytest.approx(0.5)
    assert target["shortfall_interval"][0] > 0 and target["measurable"]


def test_a_student_that_transfers_as_far_as_it_gains_shows_no_failure():
    check = premise_check([_set("src", "id", 60, 70, 80), _set("a", "ood", 60, 70, 80)], ["a"])
    assert check["verdict"] == "absent" and not check["relative"]["present"] and "is absent here (neither form beyond its 95% interval)" in check["summary"]


def test_a_target_without_a_clear_ceiling_gap_is_not_measured_and_noise_is_no_failure():
    check = premise_check([_set("src", "id", 60, 70, 80), _set("a", "ood", 60, 59, 60.5, n=300)], ["a"])
    assert not check["relative"]["targets"]["a"]["measurable"] and check["verdict"] == "absent"
    assert not check["absolute"]["present"]  # a one-point AOG on 300 pairs: inside its interval
    assert "no clear ceiling gap" in check["summary"]


def test_the_frozen_end_and_drift_are_reported_where_the_run_has_them():
    check = premise_check([_set("src", "id", 60, 70, 80, frozen=62), _set("a", "ood", 60, 58, 80, frozen=66)], ["a"],
                          drift=[(0.1, 1.0), (0.2, 2.5), (0.3, 2.9), (0.4, 4.2)])
    assert check["frozen_end"]["better"] and check["frozen_end"]["mean_ood_difference"] == pytest.approx(8.0)
    assert check["drift"]["models"] == 4 and check["drift"]["pearson"] > 0.9
    assert premise_check([_set("src", "id", 60, 70), _set("a", "ood", 60, 58)], ["a"])["frozen_end"] is None


def test_models_scored_on_other_pairs_or_a_missing_set_are_refused():
    with pytest.raises(ValueError, match="different numbers of pairs"):
        SetCorrectness.from_strings("a", "ood", "1010", "101")
    with pytest.raises(ValueError, match="needs the ID set and every headline target"):
        premise_check([_set("a", "ood", 60, 58)], ["a"])
    s = SetCorrectness.from_strings("src", "id", "1100", "1110", "1111")
    assert s.naive.tolist() == [True, True, True, False]


def _scores(points_by_set: dict, seed: int, n: int = 1000) -> dict:
    return {name: {"accuracy": points, "n_pairs": n, "correct": "".join("1" if c else "0" for c in _right(n, points, seed))}
            for name, points in points_by_set.items()}


def test_a_study_instance_is_checked_from_its_record_and_tabled():
    """From a study.json record: its naive W2S on the main labels, the largest-lambda last-layer ANCHOR student as
    the frozen end (with the share of naive's drift it removes), drift against the OOD drop across its students."""
    from anchor_rm.evaluation.premise import instance_premise, premise_table

    def student(method, points, msd, lam=0.0, labels="calibrated"):
        return {"method": method, "teacher_labels": labels, "anchor_lambda": lam,
                "anchor_layers": "last" if method == "anchor" else None, "test": _scores(points, 2),
                "drift": {t: {"last": {"msd": msd}} for t in ("a", "b")}}

    instance = {"seed": 0, "source": "src", "targets": ["a", "b"], "headline_targets": ["a", "b"],
                "teacher_labels": "calibrated", "teacher_scores": {"test": _scores({"src": 60, "a": 60, "b": 62}, 1)},
                "ceiling_scores": {"test": _scores({"src": 80, "a": 70, "b": 70}, 3)},
                "students": [student("naive", {"src": 70, "a": 50, "b": 55}, 0.10),
                             student("naive", {"src": 71, "a": 70, "b": 71}, 0.11, labels="raw"),
                             student("anchor", {"src": 66, "a": 58, "b": 60}, 0.05, lam=1.0),
                             student("anchor", {"src": 62, "a": 61, "b": 63}, 0.01, lam=10.0)]}
    check = instance_premise(instance)
    assert check["verdict"] == "present" and check["absolute"]["wrg"] == pytest.approx(10.0)
    assert check["frozen_end"]["anchor_lambda"] == 10.0 and check["frozen_end"]["drift_removed"] == pytest.approx(0.9)
    assert check["drift"]["models"] == 4
    old = {**instance, "seed": 1, "teacher_scores": {"test": {k: {**v, "correct": None} for k, v in
                                                             instance["teacher_scores"]["test"].items()}}}
    table = "\n".join(premise_table([instance, old]))
    assert "| 0 | +10.0 [" in table and "**present** |" in table
    assert "| 1 | not measured: scores recorded before per-pair results were kept" in table
    assert "present on 1 of 2 seeds" in table


def test_an_experiments_report_carries_the_check_of_its_naive_w2s_or_says_why_not():
    """experiment.premise_of: the run's naive W2S on the test splits beside its teacher and ceiling (what tune.py's
    selected version and a naive train.py run carry), as JSON a report holds (no NaN); "not measured" with why."""
    from types import SimpleNamespace

    from anchor_rm.evaluation.report_summary import headline_tags
    from anchor_rm.evaluation.scores import scores_from_dict
    from anchor_rm.pipeline.experiment import premise_of
    from test_report import example_report

    points = {"teacher": {"src": 60, "a": 60}, "ceiling": {"src": 80, "a": 60}, "naive": {"src": 70, "a": 50}}
    scores = {who: scores_from_dict({k: {**v, "tie_rate": 0.0, "identical_after_truncation": 0}
                                     for k, v in _scores(p, seed).items()})
              for seed, (who, p) in enumerate(points.items())}
    shared = SimpleNamespace(splits=SimpleNamespace(source="src"), headline_targets=["a"],
                             teacher_scores=lambda split: scores["teacher"], ceiling_scores=lambda split: scores["ceiling"])
    check = premise_of(shared, scores["naive"])
    assert check["verdict"] == "present" and check["absolute"]["present"]
    assert check["relative"]["targets"]["a"]["pgr"] is None  # the ceiling's gap on "a" is 0: a NaN share, as null
    report = example_report(premise=check)
    assert report.to_dict()["premise"]["verdict"] == "present" and headline_tags(report)["premise"] == "present"
    assert premise_of(shared, None)["verdict"] == "not measured"
    old = scores_from_dict({k: {**v, "correct": None} for k, v in
                            {n: s.__dict__ for n, s in scores["naive"].items()}.items()})
    assert "before per-pair results were kept" in premise_of(shared, old)["summary"]


def test_only_an_anchor_version_is_tagged_with_an_anchor_lambda_and_layer():
    """/model's headline shows the version's tags: a naive W2S version trained with the config's default lambda
    must not claim one."""
    from anchor_rm.evaluation.report import build_report
    from anchor_rm.evaluation.report_summary import headline_tags
    from test_report import split_rows

    def tags(method: str) -> dict:
        info = {"name": "anchor-rm-harmless", "student": "s", "teacher": "t", "method": method, "run_id": "r",
                "hyperparameters": {"anchor_lambda": 0.01, "anchor_layers": "last"}}
        return headline_tags(build_report(info, split_rows(), selection_splits="val", figure_splits="test"))

    assert tags("anchor")["anchor_lambda"] == "0.01" and tags("anchor")["anchor_layers"] == "last"
    for method in ("naive", "confidence"):
        assert tags(method)["method"] == method and not {"anchor_lambda", "anchor_layers"} & set(tags(method))
