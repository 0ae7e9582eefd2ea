"""The losses, each a small function of tensors.

    L(i) = L_w2s(i) + lambda * L_anchor(i)

Rewards come in pairs: `margin = r(x, y_chosen) - r(x, y_rejected)`, and the model's probability that the
chosen response is preferred is sigmoid(margin) (Bradley-Terry).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def soft_bradley_terry_loss(margin: torch.Tensor, target_prob: torch.Tensor) -> torch.Tensor:
    """Cross-entropy between soft labels q and sigmoid(margin), averaged over pairs.

    q = 1 everywhere is the ordinary (gold) Bradley-Terry loss -log sigmoid(margin).
    """
    return F.binary_cross_entropy_with_logits(margin, target_prob.to(margin.dtype))


def confidence_w2s_loss(margin: torch.Tensor, teacher_prob: torch.Tensor, alpha: float) -> torch.Tensor:
    """Burns et al. (2023)'s auxiliary confidence loss, adapted to pairs.

    (1 - alpha) * CE(q, p) + alpha * CE(hard(p), p), where hard(p) is the student's own prediction made
    hard. Their threshold keeps classes balanced within a batch; for pairs the two classes are the two
    orderings of the same pair, balanced by construction, so the threshold is 0.5 (margin > 0). The
    hardened target carries no gradient: it lets the student trust itself where it disagrees with a weak
    teacher instead of imitating the teacher's errors.
    """
    hard = (margin.detach() > 0).to(margin.dtype)
    return (1.0 - alpha) * soft_bradley_terry_loss(margin, teacher_prob) + alpha * soft_bradley_terry_loss(
        margin, hard
    )


def confidence_alpha(step: int, total_steps: int, max_alpha: float, warmup_fraction: float = 0.2) -> float:
    """Burns et al. warm alpha up linearly from 0 over the first 20% of training: early on the student's
    own predictions are noise and should not be reinforced."""
    warmup = max(1, int(total_steps * warmup_fraction))
    return max_alpha * min(1.0, step / warmup)


def anchor_loss(
    student_states: list[torch.Tensor] | tuple[torch.Tensor, ...],
    reference_states: list[torch.Tensor] | tuple[torch.Tensor, ...],
    anchor_mask: torch.Tensor,
) -> torch.Tensor:
    """MSE between student and frozen-reference hidden states on anchored positions (the response tokens and
    the position the reward head reads, see encoding.py), one value per batch.

    Each state is [batch, tokens, hidden] at one anchored layer; anchor_mask is [batch, tokens] with 1 on
    anchored positions. Prompt and padding positions are multiplied by 0 before anything is summed, so they
    cannot change the value. Per sequence: the mean over its response tokens and the hidden dimension;
    then the mean over sequences and over layers, so a long response does not outweigh a short one.
    """
    if len(student_states) != len(reference_states) or not student_states:
        raise ValueError(
            f"anchor_loss needs the same non-zero number of student and reference layers, "
            f"got {len(student_states)} and {len(reference_states)}"
        )
    mask = anchor_mask.to(student_states[0].dtype)
    tokens_per_sequence = mask.sum(dim=1).clamp(min=1.0)
    per_layer = []
    for student, reference in zip(student_states, reference_states):
        squared = (student - reference.to(student.dtype)).pow(2).mean(dim=-1)  # [batch, tokens]
        per_sequence = (squared * mask).sum(dim=1) / tokens_per_sequence
        per_layer.append(per_sequence.mean())
    return torch.stack(per_layer).mean()


def resolve_anchor_layers(spec: str | list[int] | tuple[int, ...], num_hidden_layers: int) -> list[int]:
    """Layer choice -> indices into a transformers `hidden_states` tuple (0 = embeddings, L = last layer).

    "last" -> [L]; "middle" -> the layers at 50% and 75% of depth, rounded half up ([3, 5] for L = 6,
    [15, 23] for L = 30); an explicit list ("2,4" or [2, 4]) is taken as given, each in 1..L.
    """
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "last":
            return [num_hidden_layers]
        if text == "middle":
            return sorted({max(1, int(num_hidden_layers * f + 0.5)) for f in (0.5, 0.75)})
        try:
            layers = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise ValueError(
                f"anchor_layers must be 'last', 'middle' or a comma-separated list of layer numbers, got {spec!r}"
            ) from None
    else:
        layers = [int(x) for x in spec]
    if not layers:
        raise ValueError("anchor_layers names no layer")
    bad = [x for x in layers if not 1 <= x <= num_hidden_layers]
    if bad:
        raise ValueError(f"anchor_layers {bad} out of range: this model has layers 1..{num_hidden_layers}")
    return sorted(set(layers))


def check_layer_settings(frozen_layers: int, anchor_layer_specs: Sequence, num_hidden_layers: int) -> None:
    """Frozen layers within the model, and below every anchored layer of each spec (a search's choices, or
    one run's): checked where the model's config is first read, not minutes later inside a trial."""
    if not 0 <= frozen_layers < num_hidden_layers:
        raise ValueError(f"frozen_layers must be in 0..{num_hidden_layers - 1} for a model of {num_hidden_layers} "
                         f"layers, got {frozen_layers}")
    for spec in anchor_layer_specs:
        layers = resolve_anchor_layers(spec, num_hidden_layers)
        if frozen_layers and frozen_layers >= min(layers):
            raise ValueError(f"frozen_layers {frozen_layers} would freeze anchored layer {min(layers)} "
                             f"(anchor_layers {spec!r} -> {layers}): freeze fewer layers")
