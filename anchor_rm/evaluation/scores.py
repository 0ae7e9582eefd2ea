"""A reward model measured on preference pairs through the one scoring path: pairwise accuracy and ties per set
(`SplitScore`, with which pairs it ranks right), the OOD flag's scores from the same pass, the protocol's
evaluation sets per split and the report rows built from them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from anchor_rm.data.records import PreferencePair
from anchor_rm.data.splits import ProtocolSplits
from anchor_rm.evaluation.metrics import pairwise_accuracy, tie_rate
from anchor_rm.evaluation.report import SplitResult
from anchor_rm.model.ood_flag import DensityFit, FlaggedSet, fit_density
from anchor_rm.model.reward_model import RewardModel
from anchor_rm.model.scoring import HiddenStatesHook

log = logging.getLogger("anchor_rm")


@dataclass(frozen=True)
class SplitScore:
    accuracy: float  # points
    n_pairs: int
    tie_rate: float  # points
    identical_after_truncation: int
    # One character per evaluated pair, in order: "1" where the chosen response scored strictly above the
    # rejected one. What a paired bootstrap over pairs resamples (study_report); None in scores stored
    # before it was kept.
    correct: str | None = None


def evaluate_pairs(rm: RewardModel, pairs: Sequence[PreferencePair], batch_size: int = 32, *, precision: str = "auto",
                   hidden_states_hook: HiddenStatesHook | None = None, label: str = "scoring") -> SplitScore:
    """Pairwise accuracy on `pairs`; the hook (see scoring) sees chosen + rejected sequences' states. `label` names
    the progress lines of a long pass."""
    return evaluate_pairs_with_ood(rm, pairs, batch_size, precision=precision, hidden_states_hook=hidden_states_hook,
                                   ood_flag=False, label=label)[0]


def evaluate_pairs_with_ood(rm: RewardModel, pairs: Sequence[PreferencePair], batch_size: int = 32, *,
                            precision: str = "auto", hidden_states_hook: HiddenStatesHook | None = None,
                            ood_flag: bool = True, label: str = "scoring") -> tuple[SplitScore, tuple[np.ndarray, np.ndarray] | None]:
    """`evaluate_pairs`, and where the model has an OOD flag's density (and `ood_flag`), the ood scores of the
    chosen and of the rejected responses of the evaluated pairs, from the same forward pass."""
    encoded = rm.encode(pairs)
    if len(encoded) == 0:
        raise ValueError("no pair left to evaluate after truncation")
    rewards, ood = rm.scorer(batch_size, precision, ood_flag=ood_flag).rewards_and_ood(
        encoded.chosen + encoded.rejected, hidden_states_hook, label)
    chosen, rejected = rewards[: len(encoded)], rewards[len(encoded):]
    correct = "".join("1" if c > r else "0" for c, r in zip(chosen, rejected))
    score = SplitScore(pairwise_accuracy(chosen, rejected), len(encoded), tie_rate(chosen, rejected),
                       encoded.identical_after_truncation, correct)
    return score, None if ood is None else (ood[: len(encoded)], ood[len(encoded):])


def flagged_set(dataset: str, role: str, score: SplitScore, ood: tuple[np.ndarray, np.ndarray]) -> FlaggedSet:
    """An evaluated set as the OOD flag's measurement takes it (ood_flag.measure_sets)."""
    return FlaggedSet(dataset, role, np.array([c == "1" for c in score.correct], dtype=bool), ood[0], ood[1])


def fit_ood_flag(rm: RewardModel, fit_pairs: Sequence[PreferencePair], threshold_pairs: Sequence[PreferencePair], *,
                 fit_split: str, threshold_split: str, batch_size: int = 32, precision: str = "auto") -> DensityFit:
    """The OOD flag's density of `rm`'s representation on both responses of `fit_pairs` (student-train), its
    threshold from `threshold_pairs` (ID validation); set on `rm` (saved with it from then on) and returned."""
    scorer = rm.scorer(batch_size, precision, ood_flag=False)
    fit, threshold = rm.encode(fit_pairs), rm.encode(threshold_pairs)
    rm.density = fit_density(scorer.features(fit.chosen + fit.rejected),
                             scorer.features(threshold.chosen + threshold.rejected),
                             fit_split=fit_split, threshold_split=threshold_split)
    log.info("OOD flag: density of %d %s sequences (%d dimensions, shrinkage %.3f), threshold %.3f from %s",
             rm.density.n_fit, fit_split, rm.density.dimensions, rm.density.shrinkage, rm.density.threshold,
             threshold_split)
    return rm.density


def evaluation_sets(splits: ProtocolSplits, split: str) -> list[tuple[str, str, list[PreferencePair]]]:
    """(dataset, role, pairs) for the ID split and each OOD target, on "val" or "test"."""
    if split not in ("val", "test"):
        raise ValueError(f"split must be 'val' or 'test', got {split!r}")
    source_pairs = splits.id_val if split == "val" else splits.id_test
    return [(splits.source, "id", source_pairs)] + [(t, "ood", parts[split]) for t, parts in splits.ood.items()]


def evaluate_model(rm: RewardModel, splits: ProtocolSplits, split: str, batch_size: int = 32, *,
                   precision: str = "auto") -> dict[str, SplitScore]:
    return {name: evaluate_pairs(rm, pairs, batch_size, precision=precision, label=f"scoring {name} ({split})")
            for name, _, pairs in evaluation_sets(splits, split)}


def split_results(
    splits: ProtocolSplits,
    split: str,
    student: dict[str, SplitScore],
    teacher: dict[str, SplitScore],
    ceiling: dict[str, SplitScore] | None = None,
) -> list[SplitResult]:
    """Report rows: teacher and student accuracy (and the ceiling's) per evaluation set."""
    rows = []
    for name, role, _ in evaluation_sets(splits, split):
        rows.append(
            SplitResult(
                dataset=name,
                role=role,
                split=split,
                n_pairs=student[name].n_pairs,
                teacher_accuracy=teacher[name].accuracy,
                student_accuracy=student[name].accuracy,
                ceiling_accuracy=ceiling[name].accuracy if ceiling else None,
                student_tie_rate=student[name].tie_rate,
            )
        )
    return rows


def scores_to_dict(scores: dict[str, SplitScore]) -> dict[str, dict]:
    return {name: s.__dict__.copy() for name, s in scores.items()}


def scores_from_dict(raw: dict[str, dict]) -> dict[str, SplitScore]:
    return {name: SplitScore(**fields) for name, fields in raw.items()}
