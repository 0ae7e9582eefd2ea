"""The out-of-distribution flag: how far a scored (prompt, response) lies from what the reward model learned on.

A Gaussian density of the student's representation, fitted at registration on student-train: the last layer's
hidden states averaged over the positions the anchor term covers (the response tokens and the position the
reward head reads; `scoring.RewardScorer.features`). ANCHOR keeps these states near the pretrained model's,
which is what makes a distance in that space mean something. Its covariance is Ledoit-Wolf shrunk (a few
hundred fitting sequences against hundreds or thousands of dimensions), and kept compact for any model size:
the top `max_components` eigenvectors exactly, the remaining dimensions as one shared variance (their mean
eigenvalue: probabilistic PCA). At most 256 x hidden-size floats, 4 MB for a 4,096-wide model.

`ood_score` is the squared Mahalanobis distance divided by the dimension (about 1 for a typical student-train
sequence, larger further away). A sequence is `in_domain` when its score is at most the threshold: by default
the 95th percentile of the scores of ID validation sequences, so about 5% of in-distribution text is flagged
by construction. What the flag measures about the model (does it fire on OOD targets, is the model wrong where
it fires) is measured in each version's report (`measure_sets`): AUROC against ID test, accuracy on flagged and
unflagged pairs.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

REPRESENTATION = "last layer, mean over the response tokens and the reward head's position"
ARRAYS_FILE, INFO_FILE = "ood_flag.npz", "ood_flag.json"
DEFAULT_QUANTILE = 0.95
MAX_COMPONENTS = 256
RECENT_PAIRS = 1000  # the service's gauge: the share flagged among this many last judged pairs


@dataclass(frozen=True)
class DensityFit:
    """A fitted density and its threshold; `score` and `in_domain` are what scoring calls per batch."""

    mean: np.ndarray  # (d,)
    basis: np.ndarray  # (k, d): orthonormal rows, the shrunk covariance's top eigenvectors
    variances: np.ndarray  # (k,): their eigenvalues
    residual_variance: float  # the mean of the other d - k eigenvalues (unused when k = d)
    shrinkage: float  # Ledoit-Wolf's weight of the scaled identity, 0..1
    n_fit: int  # sequences the density was fitted on
    fit_split: str
    threshold: float
    quantile: float
    threshold_split: str
    reference_scores: np.ndarray  # the threshold split's scores: any set's AUROC against it (evaluate.py)

    @property
    def dimensions(self) -> int:
        return int(self.mean.shape[0])

    def score(self, features: np.ndarray) -> np.ndarray:
        """Squared Mahalanobis distance per dimension, one per row of `features` (n, d).

        Computed with torch, in float64: numpy's BLAS has its own thread pool, whose threads spin after a call
        and took CPU from the next forward pass on a small machine (the flag cost 9% of scoring time on 2
        cores; bench/ood_flag_overhead.py), while torch's run in the pool the forward pass uses."""
        import torch

        features = np.asarray(features)
        if features.ndim != 2 or features.shape[1] != self.dimensions:
            raise ValueError(f"features of shape {features.shape}; the density was fitted on {self.dimensions} "
                             "dimensions (a different model?)")
        x = torch.as_tensor(features, dtype=torch.float64)
        mean, basis = self._tensors()
        centred = x - mean
        projected = centred @ basis.T
        distance = (projected ** 2 / torch.as_tensor(self.variances)).sum(dim=1)
        if self.basis.shape[0] < self.dimensions:
            rest = ((centred ** 2).sum(dim=1) - (projected ** 2).sum(dim=1)).clamp(min=0.0)
            distance += rest / self.residual_variance
        return (distance / self.dimensions).numpy()

    def _tensors(self):
        """The mean and basis as float64 torch tensors, made once."""
        import torch

        if "_torch" not in self.__dict__:
            object.__setattr__(self, "_torch", (torch.as_tensor(self.mean, dtype=torch.float64),
                                                torch.as_tensor(self.basis, dtype=torch.float64)))
        return self.__dict__["_torch"]

    def in_domain(self, scores: np.ndarray) -> np.ndarray:
        return np.asarray(scores) <= self.threshold

    def describe(self) -> dict[str, Any]:
        """What /model and the report say about the fit."""
        return {"representation": REPRESENTATION, "fit_split": self.fit_split, "n_fit": self.n_fit,
                "dimensions": self.dimensions, "components": int(self.basis.shape[0]),
                "shrinkage": float(self.shrinkage), "threshold": float(self.threshold),
                "threshold_quantile": float(self.quantile), "threshold_split": self.threshold_split,
                "n_threshold": int(len(self.reference_scores))}

    def save(self, folder: str | Path) -> None:
        """ood_flag.npz (arrays, float32) and ood_flag.json (the rest) into a model folder."""
        folder = Path(folder)
        np.savez(folder / ARRAYS_FILE, mean=self.mean.astype(np.float32), basis=self.basis.astype(np.float32),
                 variances=self.variances.astype(np.float32), reference_scores=self.reference_scores.astype(np.float32))
        info = {**self.describe(), "residual_variance": float(self.residual_variance)}
        (folder / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def load_density(folder: str | Path) -> DensityFit | None:
    """The fit saved in a model folder, or None for a model registered without one."""
    folder = Path(folder)
    if not (folder / INFO_FILE).exists():
        return None
    try:
        info = json.loads((folder / INFO_FILE).read_text())
        with np.load(folder / ARRAYS_FILE) as arrays:
            mean, basis = arrays["mean"].astype(np.float64), arrays["basis"].astype(np.float64)
            variances, reference = arrays["variances"].astype(np.float64), arrays["reference_scores"].astype(np.float64)
        fit = DensityFit(mean, basis, variances, float(info["residual_variance"]), float(info["shrinkage"]),
                         int(info["n_fit"]), str(info["fit_split"]), float(info["threshold"]),
                         float(info["threshold_quantile"]), str(info["threshold_split"]), reference)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{folder}: the OOD flag's fit ({INFO_FILE}, {ARRAYS_FILE}) cannot be read: {exc}") from None
    if basis.shape != (len(variances), len(mean)) or not np.all(variances > 0) or not fit.residual_variance > 0:
        raise ValueError(f"{folder / ARRAYS_FILE}: basis {basis.shape}, {len(variances)} variances and a mean of "
                         f"{len(mean)} do not fit together (or a variance is not positive)")
    return fit


def ledoit_wolf(features: np.ndarray) -> tuple[np.ndarray, float]:
    """The Ledoit-Wolf (2004) shrunk covariance of the rows of `features` (centred here) and its shrinkage:
    (1 - s) * sample covariance + s * mean variance * I, s chosen to minimise the expected squared error.
    The same estimate as sklearn.covariance.ledoit_wolf (tests/test_ood_flag.py checks it), without the
    dependency."""
    x = features - features.mean(axis=0)
    n, d = x.shape
    sample = x.T @ x / n
    mu = np.trace(sample) / d
    delta = ((sample - mu * np.eye(d)) ** 2).sum() / d
    x2 = x ** 2
    beta = min(((x2.T @ x2) / n - sample ** 2).sum() / (d * n), delta)
    shrinkage = 0.0 if delta == 0 else beta / delta
    covariance = (1 - shrinkage) * sample
    covariance.flat[:: d + 1] += shrinkage * mu
    return covariance, float(shrinkage)


def fit_density(features: np.ndarray, threshold_features: np.ndarray, *, fit_split: str, threshold_split: str,
                quantile: float = DEFAULT_QUANTILE, max_components: int = MAX_COMPONENTS) -> DensityFit:
    """Fit on `features` (n, d), set the threshold at `quantile` of `threshold_features`' scores."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or len(features) < 2:
        raise ValueError(f"the OOD flag needs at least 2 fitting sequences, got {features.shape[0] if features.ndim else 0}")
    if not 0 < quantile < 1:
        raise ValueError(f"threshold quantile must be between 0 and 1, got {quantile}")
    if len(threshold_features) == 0:
        raise ValueError("the OOD flag's threshold needs at least one sequence")
    if not np.isfinite(features).all():
        raise ValueError("the representation holds NaN or infinite values: the model's hidden states overflowed")
    covariance, shrinkage = ledoit_wolf(features)
    eigenvalues, eigenvectors = np.linalg.eigh(covariance)  # ascending
    eigenvalues, eigenvectors = eigenvalues[::-1], eigenvectors[:, ::-1]
    floor = max(float(eigenvalues[0]) * 1e-9, 1e-12)  # numerically zero directions of a degenerate fit
    eigenvalues = np.maximum(eigenvalues, floor)
    k = min(max_components, len(eigenvalues))
    residual = float(eigenvalues[k:].mean()) if k < len(eigenvalues) else 1.0
    unscored = DensityFit(features.mean(axis=0), eigenvectors[:, :k].T.copy(), eigenvalues[:k].copy(), residual,
                          shrinkage, len(features), fit_split, math.inf, quantile, threshold_split, np.zeros(0))
    reference = unscored.score(threshold_features)
    return DensityFit(unscored.mean, unscored.basis, unscored.variances, residual, shrinkage, len(features), fit_split,
                      float(np.quantile(reference, quantile)), quantile, threshold_split, reference)


# ---------------------------------------------------------------------------------------------------
# What the flag measures: the report's `ood_flag` block.

def auroc(positive: np.ndarray, negative: np.ndarray) -> tuple[float, float]:
    """P(a positive's score > a negative's), ties half (Mann-Whitney), and its Hanley-McNeil (1982) standard
    error. Here positives are an OOD target's sequences and negatives the reference's: 0.5 is a flag blind to
    the shift, 1.0 one that separates it. The two responses of a pair are not independent, so the standard
    error is somewhat optimistic."""
    positive, negative = np.asarray(positive, dtype=np.float64), np.asarray(negative, dtype=np.float64)
    n1, n2 = len(positive), len(negative)
    if n1 == 0 or n2 == 0:
        raise ValueError(f"AUROC needs both sets non-empty, got {n1} and {n2} scores")
    values = np.concatenate([positive, negative])
    order = np.argsort(values, kind="stable")
    _, inverse, counts = np.unique(values[order], return_inverse=True, return_counts=True)
    ranks = np.empty(len(values))
    ranks[order] = (np.cumsum(counts) - (counts - 1) / 2)[inverse]  # 1-based, ties at their average rank
    area = float((ranks[:n1].sum() - n1 * (n1 + 1) / 2) / (n1 * n2))
    q1, q2 = area / (2 - area), 2 * area ** 2 / (1 + area)
    variance = (area * (1 - area) + (n1 - 1) * (q1 - area ** 2) + (n2 - 1) * (q2 - area ** 2)) / (n1 * n2)
    return area, math.sqrt(max(variance, 0.0))


def _accuracy(correct: np.ndarray) -> tuple[float | None, float | None]:
    if len(correct) == 0:
        return None, None
    p = float(np.mean(correct))
    return 100 * p, 100 * math.sqrt(p * (1 - p) / len(correct))


@dataclass(frozen=True)
class FlaggedSet:
    """One evaluation set as the flag saw it: each pair's correctness and both responses' ood scores."""

    dataset: str
    role: str  # id | ood
    correct: np.ndarray  # bool, one per pair
    chosen_scores: np.ndarray
    rejected_scores: np.ndarray


def measure_set(fit: DensityFit, scored: FlaggedSet, reference: np.ndarray | None) -> dict[str, Any]:
    """One row of the block: the share of sequences flagged, AUROC against `reference` (None: this set is the
    reference), and the accuracy on pairs where either response is flagged against the others."""
    sequences = np.concatenate([scored.chosen_scores, scored.rejected_scores])
    flagged_pairs = ~(fit.in_domain(scored.chosen_scores) & fit.in_domain(scored.rejected_scores))
    area, area_se = (None, None) if reference is None else auroc(sequences, reference)
    acc_f, se_f = _accuracy(scored.correct[flagged_pairs])
    acc_u, se_u = _accuracy(scored.correct[~flagged_pairs])
    return {"dataset": scored.dataset, "role": scored.role, "n_sequences": int(len(sequences)),
            "flagged_fraction": float(np.mean(~fit.in_domain(sequences))),
            "mean_score": float(np.mean(sequences)), "auroc": area, "auroc_se": area_se,
            "n_pairs": int(len(scored.correct)), "flagged_pairs": int(flagged_pairs.sum()),
            "accuracy_flagged": acc_f, "accuracy_flagged_se": se_f,
            "accuracy_unflagged": acc_u, "accuracy_unflagged_se": se_u}


def measure_sets(fit: DensityFit, sets: Sequence[FlaggedSet], reference: FlaggedSet | None = None) -> dict[str, Any]:
    """The report's `ood_flag` block: the fit, and a row per set. AUROC separates each set's sequences from
    `reference`'s (protocol reports: ID test, which is also a row, with auroc null); without one, from the
    threshold split's scores stored with the fit (evaluate.py on any data)."""
    if reference is not None:
        negatives = np.concatenate([reference.chosen_scores, reference.rejected_scores])
        against = f"{reference.dataset} ({reference.role}, the report's split)"
    else:
        negatives, against = fit.reference_scores, f"{fit.threshold_split} (stored with the fit)"
    rows = [measure_set(fit, s, None if s is reference else negatives) for s in sets]
    return {**fit.describe(), "auroc_reference": against, "sets": rows}


def block_markdown(block: dict[str, Any]) -> list[str]:
    """report.md's section on the flag."""
    lines = ["## Out-of-distribution flag", "",
             f"Density of the student's representation ({block['representation']}) fitted on {block['n_fit']} "
             f"{block['fit_split']} sequences ({block['dimensions']} dimensions, {block['components']} kept exactly, "
             f"Ledoit-Wolf shrinkage {block['shrinkage']:.3f}); a response is flagged when its ood_score exceeds "
             f"{block['threshold']:.3f}, the {100 * block['threshold_quantile']:.0f}th percentile on "
             f"{block['threshold_split']} ({block['n_threshold']} sequences). AUROC: each set's responses against "
             f"{block['auroc_reference']}. A pair is flagged when either response is.", "",
             "| set | role | flagged responses | AUROC | accuracy flagged (pairs) | accuracy unflagged (pairs) |",
             "|---|---|---|---|---|---|"]
    for row in block["sets"]:
        area = "-" if row["auroc"] is None else f"{row['auroc']:.3f} ± {row['auroc_se']:.3f}"
        flagged = ("-" if row["accuracy_flagged"] is None
                   else f"{row['accuracy_flagged']:.1f} ± {row['accuracy_flagged_se']:.1f} ({row['flagged_pairs']})")
        unflagged = ("-" if row["accuracy_unflagged"] is None else
                     f"{row['accuracy_unflagged']:.1f} ± {row['accuracy_unflagged_se']:.1f} "
                     f"({row['n_pairs'] - row['flagged_pairs']})")
        lines.append(f"| {row['dataset']} | {row['role']} | {100 * row['flagged_fraction']:.1f}% | {area} | "
                     f"{flagged} | {unflagged} |")
    lines += ["", "Accuracies in points with their standard errors; the flag says a pair is unlike student-train, "
              "not that its reward is wrong."]
    return lines


class RecentShare:
    """The share of flagged pairs among the last `window` judged: what the service's gauge exports, so that a
    dashboard sees the policy drift away from the training data as it happens."""

    def __init__(self, window: int = RECENT_PAIRS):
        self._flags: deque[bool] = deque(maxlen=window)
        self._flagged = 0

    def add(self, flagged: Iterable[bool]) -> float:
        for flag in flagged:
            if len(self._flags) == self._flags.maxlen:
                self._flagged -= self._flags[0]
            self._flags.append(bool(flag))
            self._flagged += bool(flag)
        return self._flagged / len(self._flags) if self._flags else 0.0
