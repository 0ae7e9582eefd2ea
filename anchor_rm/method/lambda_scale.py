"""Lambda in drift terms: where the anchor search looks, calibrated for the student at hand.

Lambda does not carry across models or loss definitions: the anchor loss is a mean squared distance per hidden
unit, and its size follows the hidden states' scale (MiniLM-L6's 384 small units, SmolLM2's 576 after its final
norm, a Llama's 4,096) and how far a given learning rate moves them. A lambda tuned for one student says nothing
for another. So the search range is calibrated per run: the student trains naive W2S for a few steps; then, on
one batch, the gradient of the W2S loss and the gradient of the anchor loss (at each layer choice, against the
student's own states before it trained) are taken over the trainable parameters, and lambda_grad = |grad W2S| /
|grad anchor| is the lambda at which the anchor term pulls back as hard as the W2S term pushes, at that drift.

A balance of the losses themselves (W2S loss / anchor loss) misleads by orders of magnitude: the anchor loss is
quadratic in the drift, which after a few steps is a small part of naive W2S's final drift. lambda_grad is
no drift-removal point either: one batch's W2S gradient is mostly noise that averages out over steps, while the
anchor's pulls back coherently, so a lambda far below lambda_grad already holds the features. On MiniLM-L6
(harmless protocol, 8 steps at 1e-4) lambda_grad was 0.26-1.2 (fixed labels q = 0.55-0.7; bench/anchor_scale.py,
M7), while naive W2S's last-layer drift fell 4% at lambda 1e-4, 64% at 1e-2 and 98.5% at 10 (docs/results.md):
about 50% near 5e-3 and 90% near 0.3. So the search spans lambda_grad x SPAN, SPAN read off that curve: an
offset fitted on one student, in a unit that follows the student's scale. What each trial removed of naive W2S's
drift is measured, not assumed (each trial's drift on the probe after every epoch, the report's selection block
and the NTS-against-lambda chart), and the decoder study checks the span on SmolLM2.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Sequence

import numpy as np
import torch

from anchor_rm.data.records import PreferencePair
from anchor_rm.method.drift import DRIFT_PROBE_PAIRS, evaluate_with_drift, evaluation_reference
from anchor_rm.method.losses import anchor_loss, resolve_anchor_layers, soft_bradley_terry_loss
from anchor_rm.method.stages import train_on_pairs
from anchor_rm.method.training import TrainConfig
from anchor_rm.model.encoding import collate
from anchor_rm.model.precision import autocast
from anchor_rm.model.reward_model import RewardModel
from anchor_rm.model.scoring import capture_hidden_states, fp32_reward_head, reward_forward

log = logging.getLogger("anchor_rm")

CALIBRATION_STEPS = 8  # naive W2S steps before the gradients are compared
# The search range in units of lambda_grad, from MiniLM-L6's measured curve (module docstring): about 2% to 90% of
# naive W2S's last-layer drift removed there; the decoder study (docs/results.md) measures it on SmolLM2.
SPAN = (1e-4, 1.0)
# Where no calibration runs (a sharded student the driver cannot hold): the range MiniLM-L6 was searched over.
UNCALIBRATED_RANGE = (1e-6, 10.0)


@dataclass(frozen=True)
class LambdaRange:
    """The anchor search's lambda range per layer choice and where it came from."""

    ranges: dict[str, tuple[float, float]]  # layer choice -> (low, high)
    method: str  # "calibrated", "given" (--lambda-range) or "uncalibrated"
    lambda_grad: dict[str, float] | None = None  # layer choice -> |grad W2S| / |grad anchor| (calibrated)
    drift: dict[str, float] | None = None  # layer choice -> MSD on the drift probe after the calibration steps
    w2s_loss: float | None = None  # the W2S loss over the calibration's last steps
    steps: int = 0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ranges"] = {choice: list(bounds) for choice, bounds in self.ranges.items()}
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "LambdaRange":
        return cls(**{**d, "ranges": {choice: tuple(bounds) for choice, bounds in d["ranges"].items()}})

    def describe(self) -> str:
        bounds = ", ".join(f"{choice} {lo:.3g}..{hi:.3g}" for choice, (lo, hi) in self.ranges.items())
        if self.method == "calibrated":
            balance = ", ".join(f"{choice} {b:.3g}" for choice, b in (self.lambda_grad or {}).items())
            return (f"lambda_grad x {SPAN[0]:g}..{SPAN[1]:g}: {bounds} (lambda_grad {balance}, after "
                    f"{self.steps} naive W2S steps)")
        return f"{bounds} ({self.method})"


def fixed_range(layer_choices: Sequence[str], low: float, high: float, method: str) -> LambdaRange:
    if not 0 < low < high:
        raise ValueError(f"a lambda range needs 0 < low < high, not {low}..{high}")
    return LambdaRange({choice: (low, high) for choice in layer_choices}, method)


def calibrate_lambda(rm: RewardModel, student_train: Sequence[PreferencePair], soft_labels: Sequence[float] | None,
                     train_cfg: TrainConfig, layer_choices: Sequence[str], *, steps: int = CALIBRATION_STEPS,
                     batch_size: int = 32) -> LambdaRange:
    """Trains `rm` (the pretrained student, changed in place: throw it away after) as naive W2S for `steps` steps
    on the first pairs of student-train; then, on one batch of the drift probe's pairs, lambda_grad = |grad of the
    W2S loss| / |grad of the anchor loss| over the trainable parameters, per layer choice, the anchor loss taken
    against the states that batch had before training (module docstring). Also records the drift on the probe."""
    started = time.perf_counter()
    depth = rm.model.config.num_hidden_layers
    layer_sets = {choice: resolve_anchor_layers(choice, depth) for choice in layer_choices}
    layers = sorted({layer for chosen in layer_sets.values() for layer in chosen})
    probe = list(student_train[:DRIFT_PROBE_PAIRS])
    labels = [0.5] * len(student_train) if soft_labels is None else list(soft_labels)
    gradient_batch = _GradientBatch(rm, probe[:train_cfg.batch_size], labels[:train_cfg.batch_size], layers,
                                    train_cfg.precision)
    with torch.no_grad():
        reference = evaluation_reference(rm.model, rm, probe, layers, batch_size=batch_size,
                                         precision=train_cfg.precision)
    n = min(len(student_train), steps * train_cfg.batch_size)
    config = replace(train_cfg, method="naive", anchor_lambda=0.0, epochs=1, warmup_fraction=0.0)
    logs = []
    train_on_pairs(rm, student_train[:n], None if soft_labels is None else labels[:n], config, on_step=logs.append)
    if not logs:
        raise ValueError("the lambda calibration ran no step: student-train is empty")
    _, drift = evaluate_with_drift(rm, probe, reference, layer_sets, batch_size=batch_size, precision=train_cfg.precision)
    w2s = float(np.mean([entry.w2s_loss for entry in logs[-max(1, len(logs) // 2):]]))
    msd = {choice: drift[choice].msd for choice in layer_choices}
    balance = gradient_batch.lambda_grad(layer_sets)
    if not all(np.isfinite(b) and b > 0 for b in balance.values()):
        raise ValueError(f"the student did not move in {len(logs)} calibration steps (lambda_grad {balance}); give "
                         f"the search's range with --lambda-range")
    ranges = {choice: (b * SPAN[0], b * SPAN[1]) for choice, b in balance.items()}
    # No time in it: the report carries it, and two runs of one seed must give the same report.
    result = LambdaRange(ranges, "calibrated", balance, msd, w2s, len(logs))
    log.info("lambda range: %s; drift after the calibration %s, W2S loss %.4f, %.0f s", result.describe(),
             {c: f"{v:.3g}" for c, v in msd.items()}, w2s, time.perf_counter() - started)
    return result


class _GradientBatch:
    """One batch of pairs, its states at `layers` taken when built (the pretrained student's), and later the two
    gradients on it: of the W2S loss (soft labels) and of the anchor loss against those states."""

    def __init__(self, rm: RewardModel, pairs: Sequence[PreferencePair], labels: Sequence[float], layers: list[int],
                 precision: str):
        encoded = rm.encode(pairs)
        self.rm, self.layers, self.precision, self.n = rm, layers, precision, len(encoded)
        self.q = torch.tensor([labels[i] for i in range(len(encoded))], dtype=torch.float32)
        self.batch = collate(encoded.chosen + encoded.rejected, rm.encoder.pad_token_id)
        self.pretrained = {layer: states.detach() for layer, states in self._forward(grad=False)[1].items()}

    def _forward(self, grad: bool):
        model = self.rm.model
        device = next(model.parameters()).device
        batch = {k: v.to(device) for k, v in self.batch.items()}
        was_training = model.training
        model.eval()  # no dropout: the two passes differ by the training steps alone
        try:
            with torch.set_grad_enabled(grad), autocast(self.precision, device.type), fp32_reward_head(model), \
                    capture_hidden_states(model, self.layers) as caught:
                rewards = reward_forward(model, batch).logits[:, 0].float()
            return rewards, {layer: caught[layer].float() for layer in self.layers}, batch["anchor_mask"]
        finally:
            model.train(was_training)

    def lambda_grad(self, layer_sets: dict[str, list[int]]) -> dict[str, float]:
        params = [p for p in self.rm.model.parameters() if p.requires_grad]
        rewards, states, mask = self._forward(grad=True)
        w2s = soft_bradley_terry_loss(rewards[: self.n] - rewards[self.n:], self.q.to(rewards.device))

        def norm(loss: torch.Tensor) -> float:
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            return float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None)))

        w2s_norm = norm(w2s)
        out = {}
        for choice, chosen in layer_sets.items():
            anchor = anchor_loss([states[layer] for layer in chosen],
                                 [self.pretrained[layer].to(states[layer].device) for layer in chosen], mask)
            anchor_norm = norm(anchor)
            out[choice] = w2s_norm / anchor_norm if anchor_norm > 0 else float("inf")
        return out
