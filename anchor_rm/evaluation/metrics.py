"""Transfer metrics for weak-to-strong reward models.

Every accuracy here is in *points* (0..100), as are the gains built from them, so that a reader can
compare a WRG of 3.0 with a standard error of 2.3 without converting units.

    WRG          = Acc_student(ID) - Acc_teacher(ID)
    AOG(target)  = Acc_student(target) - Acc_teacher(target)
    NTS(target)  = AOG(target) - max(0, Acc_teacher(ID) - Acc_student(ID))
    PGR          = (Acc_student - Acc_teacher) / (Acc_ceiling - Acc_teacher)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np


def _as_reward_vector(name: str, rewards: Sequence[float] | np.ndarray) -> np.ndarray:
    vector = np.asarray(rewards, dtype=np.float64)
    if vector.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of rewards, got shape {vector.shape}")
    # A NaN reward compares False against everything and would silently count as a wrong pair;
    # it always means a broken forward pass, so it must not become an accuracy.
    if np.isnan(vector).any():
        raise ValueError(f"{name}: contains NaN rewards")
    return vector


def _as_reward_pairs(chosen_rewards, rejected_rewards) -> tuple[np.ndarray, np.ndarray]:
    chosen = _as_reward_vector("chosen_rewards", chosen_rewards)
    rejected = _as_reward_vector("rejected_rewards", rejected_rewards)
    if chosen.shape != rejected.shape:
        raise ValueError(
            f"chosen_rewards and rejected_rewards differ in length: {chosen.shape[0]} != {rejected.shape[0]}"
        )
    if chosen.shape[0] == 0:
        raise ValueError("no pairs: accuracy of an empty set is undefined")
    return chosen, rejected


def _check_points(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or not 0.0 <= value <= 100.0:
        raise ValueError(f"{name}: expected an accuracy in points (0..100), got {value!r}")
    return value


def pairwise_accuracy(
    chosen_rewards: Sequence[float] | np.ndarray, rejected_rewards: Sequence[float] | np.ndarray
) -> float:
    """Percentage of pairs whose chosen response scores strictly above the rejected one.

    An exact tie counts as wrong: a tie expresses no preference, and counting it as right (or as half)
    would reward a model that collapses to a constant score. Truncation that cuts both responses away
    produces exactly such ties (scoring.encode_pairs drops the pairs it made identical), and a bf16 reward
    rounds close rewards into ties (scoring.fp32_reward_head): either must cost accuracy, not hide.
    """
    chosen, rejected = _as_reward_pairs(chosen_rewards, rejected_rewards)
    return float(100.0 * np.mean(chosen > rejected))


def tie_rate(
    chosen_rewards: Sequence[float] | np.ndarray, rejected_rewards: Sequence[float] | np.ndarray
) -> float:
    """Percentage (points) of pairs scored exactly equal; reported beside accuracy because ties are
    counted wrong, so a high tie rate explains a low accuracy."""
    chosen, rejected = _as_reward_pairs(chosen_rewards, rejected_rewards)
    return float(100.0 * np.mean(chosen == rejected))


def accuracy_standard_error(accuracy_points: float, n_pairs: int) -> float:
    """Binomial standard error of an accuracy, in points: 100 * sqrt(p (1 - p) / n)."""
    accuracy_points = _check_points("accuracy_points", accuracy_points)
    if isinstance(n_pairs, bool) or int(n_pairs) != n_pairs or n_pairs < 1:
        raise ValueError(f"n_pairs: expected an int >= 1, got {n_pairs!r}")
    p = accuracy_points / 100.0
    return 100.0 * math.sqrt(p * (1.0 - p) / int(n_pairs))


def weak_to_strong_gain(student_id_acc: float, teacher_id_acc: float) -> float:
    """WRG: how far the student rises above its teacher in-distribution."""
    return _check_points("student_id_acc", student_id_acc) - _check_points("teacher_id_acc", teacher_id_acc)


def ood_gain(student_target_acc: float, teacher_target_acc: float) -> float:
    """AOG: how far the student rises above its teacher on one OOD target."""
    return _check_points("student_target_acc", student_target_acc) - _check_points(
        "teacher_target_acc", teacher_target_acc
    )


def net_transfer_score(aog: float, teacher_id_acc: float, student_id_acc: float) -> float:
    """NTS: the OOD gain, less any ID accuracy the student lost against its teacher.

    Only a loss is charged (max(0, .)); an ID gain is not added, so a method cannot buy NTS by
    overfitting the source domain.
    """
    aog = float(aog)
    if not math.isfinite(aog):
        raise ValueError(f"aog: expected a finite number of points, got {aog!r}")
    id_loss = _check_points("teacher_id_acc", teacher_id_acc) - _check_points("student_id_acc", student_id_acc)
    return aog - max(0.0, id_loss)


def mean_net_transfer_score(nts_by_target: Mapping[str, float]) -> float:
    """Mean NTS over the OOD targets: the tuning objective."""
    if not nts_by_target:
        raise ValueError("nts_by_target is empty: mean NTS needs at least one OOD target")
    return float(sum(float(v) for v in nts_by_target.values()) / len(nts_by_target))


def performance_gap_recovered(student_acc: float, teacher_acc: float, ceiling_acc: float) -> float | None:
    """PGR (Burns et al. 2023): the fraction of the teacher-to-ceiling gap the student closes.

    Returns None when ceiling == teacher: the gap is zero, the ratio has no meaning, and reporting
    0, inf or NaN would each suggest a result that was never measured. When the ceiling is below the
    teacher the ratio is still returned, but its sign reads inverted; callers should show the raw
    accuracies beside it.
    """
    student = _check_points("student_acc", student_acc)
    teacher = _check_points("teacher_acc", teacher_acc)
    ceiling = _check_points("ceiling_acc", ceiling_acc)
    if ceiling == teacher:
        return None
    return (student - teacher) / (ceiling - teacher)


@dataclass
class TransferMetrics:
    id_acc_teacher: float
    id_acc_student: float
    wrg: float
    aog: dict[str, float]  # OOD target -> AOG, points
    nts: dict[str, float]  # OOD target -> NTS, points
    mean_nts: float  # over the headline targets
    pgr_id: float | None  # None without an ID ceiling accuracy, or when ceiling == teacher


def transfer_metrics(
    teacher_acc: Mapping[str, float],
    student_acc: Mapping[str, float],
    id_name: str,
    ceiling_acc: Mapping[str, float] | None = None,
    headline_targets: Sequence[str] | None = None,
) -> TransferMetrics:
    """All transfer metrics from per-dataset accuracies (points), keyed by dataset name.

    `id_name` names the in-distribution dataset; every other key is an OOD target. Teacher and student
    must cover the same datasets: a target one of them was not evaluated on would otherwise drop out of
    the mean NTS silently. `headline_targets` (default: every target) are the ones the mean NTS averages:
    a target on which even the strong ceiling is below chance carries no transfer signal for this student
    (see `choose_headline_targets`); AOG and NTS are still given for every target.
    """
    if set(teacher_acc) != set(student_acc):
        raise ValueError(
            "teacher_acc and student_acc cover different datasets: "
            f"teacher only {sorted(set(teacher_acc) - set(student_acc))}, "
            f"student only {sorted(set(student_acc) - set(teacher_acc))}"
        )
    if id_name not in teacher_acc:
        raise ValueError(f"id_name {id_name!r} is not among the datasets {sorted(teacher_acc)}")
    targets = [name for name in teacher_acc if name != id_name]
    if not targets:
        raise ValueError("no OOD targets: transfer metrics need at least one dataset besides the ID one")

    teacher_id = _check_points(f"teacher_acc[{id_name!r}]", teacher_acc[id_name])
    student_id = _check_points(f"student_acc[{id_name!r}]", student_acc[id_name])
    aog = {name: ood_gain(student_acc[name], teacher_acc[name]) for name in targets}
    nts = {name: net_transfer_score(aog[name], teacher_id, student_id) for name in targets}
    headline = list(targets if headline_targets is None else headline_targets)
    unknown = [name for name in headline if name not in nts]
    if unknown or not headline:
        raise ValueError(f"headline_targets must be a non-empty subset of the OOD targets {targets}, got {headline}")

    pgr_id = None
    if ceiling_acc is not None and ceiling_acc.get(id_name) is not None:
        pgr_id = performance_gap_recovered(student_id, teacher_id, ceiling_acc[id_name])

    return TransferMetrics(
        id_acc_teacher=teacher_id,
        id_acc_student=student_id,
        wrg=weak_to_strong_gain(student_id, teacher_id),
        aog=aog,
        nts=nts,
        mean_nts=mean_net_transfer_score({name: nts[name] for name in headline}),
        pgr_id=pgr_id,
    )


CHANCE = 50.0  # points: a pairwise accuracy a coin reaches


# The headline mean NTS (what Tune maximises and promotion gates on) averages only targets that can tell:
# enough pairs that one accuracy's noise does not decide it (HHH harmless, about 29 test pairs with a standard
# error near 9 points, carried 83% of the variance of the harmless study's primary comparison), and a strong
# ceiling clearly above chance on validation (below that, a gain over the teacher measures nothing this
# student can transfer). Decided on validation accuracies and split sizes, never on test accuracies.
HEADLINE_MIN_PAIRS = {"val": 200, "test": 400}
SIGNAL_STANDARD_ERRORS = 2.0


@dataclass(frozen=True)
class HeadlineChoice:
    targets: list[str]  # what the headline mean NTS averages
    flags: dict[str, str]  # target -> why it is flagged (left out, or kept only by the fallback)
    note: str | None = None  # set when no target passed every check and a fallback chose


def choose_headline_targets(sizes: Mapping[str, Mapping[str, int]], ceiling_val: Mapping[str, float] | None,
                            targets: Sequence[str], counter: Mapping[str, str] | None = None) -> HeadlineChoice:
    """The OOD targets the headline mean NTS averages: at least HEADLINE_MIN_PAIRS validation and test pairs
    (`sizes`: target -> {"val": n, "test": n}), and, where the strong ceiling was measured (`ceiling_val`:
    target -> its validation accuracy), the ceiling above chance by more than SIGNAL_STANDARD_ERRORS standard
    errors of a chance accuracy on that many pairs. Every other target stays in the report, flagged with why.

    When no target passes, the headline still needs one: the targets of headline size (their missing signal
    flagged), else every target; `note` says which, so that a reader takes the figure for noise. `counter`: targets
    that measure the category's other side (catalog.COUNTER_TARGETS: over-refusal), flagged with their reason and
    never in the headline."""
    counter = {name: why for name, why in (counter or {}).items() if name in targets}
    if len(counter) == len(targets):  # nothing else to average: the counter targets are all there is
        counter = {}
    targets = [name for name in targets if name not in counter]
    too_small, no_signal = {}, {}
    for name in targets:
        n_val, n_test = sizes[name]["val"], sizes[name]["test"]
        if n_val < HEADLINE_MIN_PAIRS["val"] or n_test < HEADLINE_MIN_PAIRS["test"]:
            too_small[name] = (f"too small for the headline: {n_val} validation and {n_test} test pairs, under "
                               f"{HEADLINE_MIN_PAIRS['val']} and {HEADLINE_MIN_PAIRS['test']}")
        elif ceiling_val is not None and ceiling_val.get(name) is not None:
            margin = SIGNAL_STANDARD_ERRORS * accuracy_standard_error(CHANCE, n_val)
            if ceiling_val[name] - CHANCE <= margin:
                no_signal[name] = (f"no clear transfer signal: the strong ceiling scores {ceiling_val[name]:.1f} on "
                                   f"its {n_val} validation pairs, not above chance by {SIGNAL_STANDARD_ERRORS:g} "
                                   f"standard errors ({margin:.1f} points)")
    flags = {**too_small, **no_signal, **counter}
    passed = [name for name in targets if name not in flags]
    if passed:
        return HeadlineChoice(passed, flags)
    sized = [name for name in targets if name not in too_small]
    if sized:
        return HeadlineChoice(sized, flags, "no target of headline size shows a clear transfer signal: the headline "
                                            "averages the targets of headline size anyway; read it as noise")
    return HeadlineChoice(list(targets), flags, "no target has headline size: the headline averages every target; "
                                                "read it as noise")


def _probabilities(q: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    q = np.asarray(q, dtype=float)
    if q.ndim != 1 or q.size == 0 or not np.all(np.isfinite(q)) or np.any((q < 0) | (q > 1)):
        raise ValueError(f"{name}: expected a non-empty 1-D sequence of probabilities in [0, 1], got shape {q.shape}")
    return q


def calibration(q: Sequence[float] | np.ndarray, bins: int = 10) -> dict[str, float]:
    """How a teacher's soft labels q = P(chosen preferred), on gold pairs (chosen is the better response),
    match how often it is right.

    - `ece`: expected calibration error over `bins` equal-width bins of the confidence max(q, 1 - q) in
      [0.5, 1]: sum over bins of (share of pairs) * |accuracy - mean confidence|, as a fraction;
    - `mean_margin`: mean |q - 0.5|, how far from indifferent the labels are (0: every label 0.5);
    - `accuracy` (points; q = 0.5 counts as wrong, as a tie does) and `mean_confidence`;
    - `information_nats`: what the labels say (label_information).
    """
    q = _probabilities(q, "q")
    if isinstance(bins, bool) or int(bins) != bins or bins < 1:
        raise ValueError(f"bins: expected an int >= 1, got {bins!r}")
    confidence = np.maximum(q, 1.0 - q)
    correct = q > 0.5
    which = np.minimum(((confidence - 0.5) * 2 * bins).astype(int), bins - 1)  # confidence 1.0 in the top bin
    ece = sum(abs(correct[which == b].mean() - confidence[which == b].mean()) * np.count_nonzero(which == b)
              for b in range(bins) if np.any(which == b)) / q.size
    return {"n_pairs": int(q.size), "bins": int(bins), "ece": float(ece), "mean_margin": float(np.mean(np.abs(q - 0.5))),
            "accuracy": float(100.0 * correct.mean()), "mean_confidence": float(confidence.mean()),
            "information_nats": label_information(q)}


def label_information(q: Sequence[float] | np.ndarray) -> float:
    """How much soft labels q say, in nats per pair: the mean of ln 2 - H(q_i), the binary entropy's distance from
    indifference (KL(q_i || 1/2)). 0: every label is 0.5, a student learns nothing from them; ln 2 = 0.693: every
    label is 0 or 1. Whether they say it rightly is `calibration`'s accuracy."""
    q = np.clip(_probabilities(q, "q"), 1e-12, 1 - 1e-12)
    entropy = -(q * np.log(q) + (1 - q) * np.log(1 - q))
    return float(np.mean(np.log(2.0) - entropy))


def _logits(q: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    q = np.clip(_probabilities(q, name), 1e-12, 1 - 1e-12)
    return np.log(q) - np.log1p(-q)


TEMPERATURE_BOUNDS = (1e-3, 1e3)


def fit_temperature(q_gold: Sequence[float] | np.ndarray) -> dict[str, float]:
    """Temperature scaling (Guo et al. 2017) of a teacher's soft labels q = sigmoid(margin) on gold pairs
    (chosen is the better response): the T in TEMPERATURE_BOUNDS minimising the mean negative log-likelihood
    -log sigmoid(margin / T). T < 1 sharpens labels that sit too close to 0.5, T > 1 softens overconfident ones;
    the ranking (and so the teacher's accuracy) does not change. Returns `temperature` and the NLL before and
    after (nats per pair). Fit it on gold pairs that neither the teacher nor any student trains on."""
    from scipy.optimize import minimize_scalar

    margins = _logits(q_gold, "q_gold")

    def nll(log_t: float) -> float:
        return float(np.mean(np.logaddexp(0.0, -margins / np.exp(log_t))))

    low, high = (math.log(b) for b in TEMPERATURE_BOUNDS)
    best = minimize_scalar(nll, bounds=(low, high), method="bounded", options={"xatol": 1e-6})
    log_t = float(best.x) if nll(float(best.x)) < nll(0.0) else 0.0  # never worse than T = 1
    return {"temperature": math.exp(log_t), "n_pairs": int(margins.size), "nll_raw": nll(0.0), "nll_calibrated": nll(log_t)}


def apply_temperature(q: Sequence[float] | np.ndarray, temperature: float) -> np.ndarray:
    """sigmoid(logit(q) / T), elementwise; q = 0.5 (no opinion) stays 0.5."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected a finite number > 0, got {temperature!r}")
    return 1.0 / (1.0 + np.exp(-_logits(q, "q") / temperature))


def difference_standard_error(a_points: float, n_a: int, b_points: float, n_b: int) -> float:
    """Standard error of a - b for two accuracies, in points, treating them as independent (a conservative
    bound for two models scored on the same pairs, whose errors are positively correlated)."""
    return math.hypot(accuracy_standard_error(a_points, n_a), accuracy_standard_error(b_points, n_b))
