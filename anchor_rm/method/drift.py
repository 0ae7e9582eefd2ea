"""Representation drift: how far a trained student's hidden states moved from its frozen pretrained copy.

The mechanism ANCHOR targets: weak-label training pulls the student's representations away from the
pretrained ones, and the paper blames that drift for the OOD drop. Drift is measured like the anchor term,
on the anchored positions (response tokens and the position the reward head reads): per sequence, the mean squared distance (over tokens and the hidden dimension)
and the mean cosine similarity between student and reference states; then the mean over sequences and
over the layers of a layer choice. The student's states come from the same forward pass that scores it
(scoring.HiddenStatesHook); the reference's are computed once per evaluation set (reference_cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from anchor_rm.data.records import PreferencePair
from anchor_rm.evaluation.scores import SplitScore, evaluate_pairs
from anchor_rm.method.reference_cache import ReferenceStates, compute_reference_states, encoded_digest
from anchor_rm.model.reward_model import RewardModel


@dataclass(frozen=True)
class Drift:
    msd: float  # mean squared distance per hidden unit, anchored positions
    cosine: float  # mean cosine similarity, anchored positions
    n_sequences: int


class DriftMeter:
    """A scoring hook that compares each scored sequence's states with the reference's cached states.

    `layer_sets` names groups of hidden-state indices, e.g. {"last": [6], "middle": [3, 5]}.
    """

    def __init__(self, reference: ReferenceStates, layer_sets: Mapping[str, Sequence[int]]):
        missing = sorted({layer for layers in layer_sets.values() for layer in layers} - set(reference.layers))
        if missing:
            raise ValueError(f"reference states hold layers {reference.layers}, not {missing}")
        self.reference = reference
        self.layer_sets = {name: list(layers) for name, layers in layer_sets.items()}
        self.msd: dict[int, list[float]] = {layer: [] for layers in self.layer_sets.values() for layer in layers}
        self.cosine: dict[int, list[float]] = {layer: [] for layer in self.msd}

    def __call__(self, batch_indices: list[int], hidden_states: tuple[torch.Tensor, ...], anchor_mask: torch.Tensor) -> None:
        mask = anchor_mask.bool().cpu()
        for layer in self.msd:
            states = hidden_states[layer].float().cpu()
            for row, seq in enumerate(batch_indices):
                student = states[row][mask[row]]
                reference = self.reference.row(layer, seq).float()
                if student.shape != reference.shape:
                    raise ValueError(f"sequence {seq}: student has {tuple(student.shape)} response states, "
                                     f"the reference cache {tuple(reference.shape)}; they were encoded differently")
                if len(student) == 0:
                    continue
                self.msd[layer].append(float((student - reference).pow(2).mean()))
                self.cosine[layer].append(float(torch.nn.functional.cosine_similarity(student, reference, dim=-1).mean()))

    def result(self) -> dict[str, Drift]:
        out = {}
        for name, layers in self.layer_sets.items():
            out[name] = Drift(float(np.mean([np.mean(self.msd[layer]) for layer in layers])),
                              float(np.mean([np.mean(self.cosine[layer]) for layer in layers])),
                              len(self.msd[layers[0]]))
        return out


def evaluation_reference(reference: torch.nn.Module, rm: RewardModel, pairs: Sequence[PreferencePair],
                         layers: Sequence[int], *, batch_size: int = 32, precision: str = "auto") -> ReferenceStates:
    """The frozen reference's response-token states on an evaluation set, as `rm` encodes it."""
    return compute_reference_states(reference, rm.encode(pairs), sorted(set(layers)), rm.encoder.pad_token_id,
                                    batch_size=batch_size, precision=precision)


def evaluate_with_drift(rm: RewardModel, pairs: Sequence[PreferencePair], reference: ReferenceStates,
                        layer_sets: Mapping[str, Sequence[int]], *, batch_size: int = 32,
                        precision: str = "auto") -> tuple[SplitScore, dict[str, Drift]]:
    """Accuracy on `pairs` and the drift per layer set, in one scoring pass."""
    if encoded_digest(rm.encode(pairs)) != reference.digest:
        raise ValueError("the reference states were computed on other pairs or another encoding of them")
    meter = DriftMeter(reference, layer_sets)
    score = evaluate_pairs(rm, pairs, batch_size, precision=precision, hidden_states_hook=meter,
                           label="scoring, with drift")
    return score, meter.result()


# Lambda in drift terms (tune.py): every trial measures its last-layer drift after each epoch on the same fixed
# pairs of student-train, so that the report can say what share of naive W2S's drift each lambda removed.
DRIFT_PROBE_PAIRS = 64


@dataclass(frozen=True)
class DriftProbe:
    """Fixed pairs and the pretrained model's last-layer states on them: what `measure` compares a student with."""

    pairs: list[PreferencePair]
    reference: ReferenceStates
    layer: int  # the last layer's index into hidden_states

    def measure(self, rm: RewardModel, *, batch_size: int = 32, precision: str = "auto") -> float:
        """The student's last-layer drift (mean squared distance per hidden unit, anchored positions) on the probe."""
        _, drift = evaluate_with_drift(rm, self.pairs, self.reference, {"last": [self.layer]}, batch_size=batch_size,
                                       precision=precision)
        return drift["last"].msd


def drift_probe(rm: RewardModel, student_train: Sequence[PreferencePair], *, batch_size: int = 32,
                precision: str = "auto") -> DriftProbe:
    """The probe on the first DRIFT_PROBE_PAIRS pairs of student-train (a seeded shuffle already), its reference
    states read from `rm` itself: call it before the student trains, or on a LoRA student at any time (its adapters
    are switched off for the pass: lora.adapters_off). A sharded student needs every worker to call it."""
    from contextlib import nullcontext

    from anchor_rm.model.lora import adapters_off, is_adapted

    pairs = list(student_train[:DRIFT_PROBE_PAIRS])
    layer = rm.model.config.num_hidden_layers
    was_training = rm.model.training
    with torch.no_grad(), (adapters_off(rm.model) if is_adapted(rm.model) else nullcontext()):
        reference = evaluation_reference(rm.model, rm, pairs, [layer], batch_size=batch_size, precision=precision)
    rm.model.train(was_training)
    return DriftProbe(pairs, reference, layer)


def drift_reduction(drift: float | None, naive_drift: float | None) -> float | None:
    """The share of naive W2S's drift a student removed: 1 - drift / naive drift (0: as naive, 1: none left);
    None where either was not measured or naive did not drift."""
    if drift is None or naive_drift is None or not naive_drift > 0 or drift != drift:
        return None
    return 1.0 - drift / naive_drift
