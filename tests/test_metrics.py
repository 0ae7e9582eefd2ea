"""Metrics pinned on hand-computed numbers (all in points)."""

import math

import numpy as np
import pytest

from anchor_rm.evaluation.metrics import (TransferMetrics, accuracy_standard_error, mean_net_transfer_score,
                                          net_transfer_score, ood_gain, pairwise_accuracy, performance_gap_recovered,
                                          tie_rate, transfer_metrics, weak_to_strong_gain)


def test_pairwise_accuracy_counts_ties_as_wrong():
    chosen = [1.0, 2.0, 0.5, 3.0]
    rejected = [0.0, 2.0, 0.7, 3.0]  # right, tie, wrong, tie
    assert pairwise_accuracy(chosen, rejected) == 25.0
    assert tie_rate(chosen, rejected) == 50.0


def test_pairwise_accuracy_accepts_numpy_and_is_strict():
    chosen = np.array([0.3, 0.2, 0.9, -1.0, 5.0], dtype=np.float32)
    rejected = np.array([0.1, 0.4, 0.8, -2.0, 5.0], dtype=np.float32)
    assert pairwise_accuracy(chosen, rejected) == pytest.approx(60.0)
    assert tie_rate(chosen, rejected) == pytest.approx(20.0)
    assert pairwise_accuracy([2.0], [1.0]) == 100.0
    assert pairwise_accuracy([1.0], [2.0]) == 0.0


def test_constant_scorer_gets_zero_not_chance():
    assert pairwise_accuracy([0.0] * 10, [0.0] * 10) == 0.0
    assert tie_rate([0.0] * 10, [0.0] * 10) == 100.0


@pytest.mark.parametrize("function", [pairwise_accuracy, tie_rate])
def test_pairwise_inputs_are_checked(function):
    with pytest.raises(ValueError, match="differ in length"):
        function([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="no pairs"):
        function([], [])
    with pytest.raises(ValueError, match="NaN"):
        function([1.0, float("nan")], [0.0, 0.0])
    with pytest.raises(ValueError, match="1-D"):
        function([[1.0, 2.0]], [[0.0, 0.0]])


def test_accuracy_standard_error():
    # 100 * sqrt(0.5 * 0.5 / 100) = 5.0
    assert accuracy_standard_error(50.0, 100) == pytest.approx(5.0)
    # 100 * sqrt(0.8 * 0.2 / 400) = 2.0
    assert accuracy_standard_error(80.0, 400) == pytest.approx(2.0)
    # about 2.3 points at ~470 pairs near chance: 100 * sqrt(0.25 / 470)
    assert accuracy_standard_error(50.0, 470) == pytest.approx(2.306, abs=1e-3)
    assert accuracy_standard_error(100.0, 10) == 0.0
    with pytest.raises(ValueError, match="n_pairs"):
        accuracy_standard_error(50.0, 0)
    with pytest.raises(ValueError, match="points"):
        accuracy_standard_error(150.0, 10)


def test_gains_and_net_transfer_score():
    # Teacher ID 60, student ID 55; on the target teacher 50, student 58.
    assert weak_to_strong_gain(55.0, 60.0) == -5.0
    aog = ood_gain(58.0, 50.0)
    assert aog == 8.0
    assert net_transfer_score(aog, teacher_id_acc=60.0, student_id_acc=55.0) == 3.0
    # An ID gain is not added: student ID 65 -> NTS equals AOG.
    assert net_transfer_score(aog, teacher_id_acc=60.0, student_id_acc=65.0) == 8.0
    assert net_transfer_score(-2.0, teacher_id_acc=70.0, student_id_acc=60.0) == -12.0


def test_gains_reject_values_outside_points():
    with pytest.raises(ValueError, match="student_id_acc"):
        weak_to_strong_gain(101.0, 60.0)
    with pytest.raises(ValueError, match="teacher_target_acc"):
        ood_gain(50.0, float("nan"))
    with pytest.raises(ValueError, match="aog"):
        net_transfer_score(float("inf"), 60.0, 55.0)


def test_mean_net_transfer_score():
    assert mean_net_transfer_score({"a": 3.0, "b": -1.0, "c": 4.0}) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least one OOD target"):
        mean_net_transfer_score({})


def test_performance_gap_recovered():
    assert performance_gap_recovered(65.0, 60.0, 70.0) == pytest.approx(0.5)
    assert performance_gap_recovered(60.0, 60.0, 70.0) == 0.0
    assert performance_gap_recovered(75.0, 60.0, 70.0) == pytest.approx(1.5)
    assert performance_gap_recovered(55.0, 60.0, 70.0) == pytest.approx(-0.5)
    assert performance_gap_recovered(65.0, 60.0, 60.0) is None


def test_transfer_metrics_end_to_end():
    teacher = {"hh": 60.0, "uf": 50.0, "online": 62.0}
    student = {"hh": 55.0, "uf": 58.0, "online": 61.0}
    metrics = transfer_metrics(teacher, student, id_name="hh", ceiling_acc={"hh": 70.0})
    assert isinstance(metrics, TransferMetrics)
    assert metrics.id_acc_teacher == 60.0 and metrics.id_acc_student == 55.0
    assert metrics.wrg == -5.0
    assert metrics.aog == {"uf": 8.0, "online": -1.0}
    assert metrics.nts == {"uf": 3.0, "online": -6.0}
    assert metrics.mean_nts == pytest.approx(-1.5)
    assert metrics.pgr_id == pytest.approx(-0.5)


def test_transfer_metrics_without_ceiling_and_with_id_gain():
    metrics = transfer_metrics({"hh": 60.0, "uf": 50.0}, {"hh": 65.0, "uf": 58.0}, id_name="hh")
    assert metrics.wrg == 5.0
    assert metrics.nts == {"uf": 8.0}
    assert metrics.mean_nts == 8.0
    assert metrics.pgr_id is None
    # A ceiling on OOD targets only leaves the ID PGR undefined.
    assert transfer_metrics({"hh": 60.0, "uf": 50.0}, {"hh": 65.0, "uf": 58.0}, "hh", {"uf": 70.0}).pgr_id is None


def test_transfer_metrics_checks_its_inputs():
    with pytest.raises(ValueError, match="different datasets"):
        transfer_metrics({"hh": 60.0, "uf": 50.0}, {"hh": 65.0}, id_name="hh")
    with pytest.raises(ValueError, match="id_name 'x'"):
        transfer_metrics({"hh": 60.0, "uf": 50.0}, {"hh": 65.0, "uf": 58.0}, id_name="x")
    with pytest.raises(ValueError, match="no OOD targets"):
        transfer_metrics({"hh": 60.0}, {"hh": 65.0}, id_name="hh")
    assert math.isfinite(transfer_metrics({"hh": 0.0, "uf": 100.0}, {"hh": 100.0, "uf": 0.0}, "hh").mean_nts)


def _underconfident_teacher(scale: float, n: int = 4000, seed: int = 0):
    """Gold pairs (chosen first) scored by a teacher whose margins are the true log-odds times `scale`."""
    rng = np.random.default_rng(seed)
    true = rng.normal(0.8, 1.0, n)  # log-odds that the first response is the better one
    first_better = rng.random(n) < 1 / (1 + np.exp(-true))
    margins = np.where(first_better, true, -true) * scale  # reoriented so that the chosen response comes first
    return 1 / (1 + np.exp(-margins))


def test_temperature_scaling_recovers_how_underconfident_a_teacher_is():
    from anchor_rm.evaluation.metrics import apply_temperature, calibration, fit_temperature

    q = _underconfident_teacher(scale=0.1)  # labels ten times too close to 0.5
    fit = fit_temperature(q)
    assert fit["temperature"] == pytest.approx(0.1, rel=0.1) and fit["n_pairs"] == 4000
    assert fit["nll_calibrated"] < fit["nll_raw"]
    scaled = apply_temperature(q, fit["temperature"])
    assert calibration(scaled)["ece"] < calibration(q)["ece"] / 3
    assert calibration(scaled)["mean_margin"] > 5 * calibration(q)["mean_margin"]
    assert (scaled > 0.5).tolist() == (q > 0.5).tolist()  # the ranking, so the accuracy, is the same
    assert fit_temperature(_underconfident_teacher(scale=1.0, seed=1))["temperature"] == pytest.approx(1.0, rel=0.1)
    assert apply_temperature([0.5, 0.5], 0.01).tolist() == [0.5, 0.5]  # no opinion stays no opinion
    # no information at all: nothing beats T = 1, which is kept
    assert fit_temperature([0.5] * 10) == {"temperature": 1.0, "n_pairs": 10, "nll_raw": pytest.approx(math.log(2)),
                                          "nll_calibrated": pytest.approx(math.log(2))}
    with pytest.raises(ValueError, match="q_gold: expected"):
        fit_temperature([1.5])
    for bad in (0.0, -1.0, float("inf"), "2"):
        with pytest.raises(ValueError, match="temperature: expected"):
            apply_temperature([0.6], bad)


def test_calibration_of_soft_labels_on_gold_pairs():
    from anchor_rm.evaluation.metrics import calibration

    # perfectly calibrated in each bin: 0.75 confidence right 3 times in 4; 0.95 right 19 in 20 (as 0.95 says)
    q = [0.75, 0.75, 0.75, 0.25] + [0.95] * 19 + [0.05]
    c = calibration(q, bins=10)
    assert c["ece"] == pytest.approx(0.0) and c["n_pairs"] == 24 and c["bins"] == 10
    assert c["mean_margin"] == pytest.approx((4 * 0.25 + 20 * 0.45) / 24)
    assert c["accuracy"] == pytest.approx(100 * 22 / 24)
    # overconfident: says 0.9 and is right half the time -> ECE 0.4; indifferent labels: margin 0, accuracy 0
    assert calibration([0.9, 0.1] * 5)["ece"] == pytest.approx(0.4)
    flat = calibration([0.5] * 8)
    assert flat["mean_margin"] == 0.0 and flat["accuracy"] == 0.0 and flat["ece"] == pytest.approx(0.5)
    assert calibration([1.0, 0.0])["ece"] == pytest.approx(0.5)  # confidence 1.0 lands in the top bin
    for bad in ([], [1.2], [float("nan")], [[0.5]]):
        with pytest.raises(ValueError, match="q: expected"):
            calibration(bad)
    with pytest.raises(ValueError, match="bins"):
        calibration([0.6], bins=0)


def test_label_information_is_what_soft_labels_say_in_nats():
    from anchor_rm.evaluation.metrics import calibration, label_information

    assert label_information([0.5, 0.5]) == pytest.approx(0.0, abs=1e-12)  # indifferent: nothing to learn
    assert label_information([0.0, 1.0, 1.0]) == pytest.approx(np.log(2), rel=1e-9)  # hard labels: ln 2 each
    assert label_information([0.3]) == pytest.approx(label_information([0.7]))  # wrong or right, it says as much
    q = [0.55, 0.48, 0.6]
    expected = np.mean([np.log(2) + p * np.log(p) + (1 - p) * np.log(1 - p) for p in q])
    assert label_information(q) == pytest.approx(expected) and calibration(q)["information_nats"] == pytest.approx(expected)
    with pytest.raises(ValueError):
        label_information([1.2])
