"""Lambda in drift terms: where the anchor search looks, calibrated for the student at hand.

Lambda does not carry across models or loss definitions: the anchor loss is a mean squared distance per hidden
unit, and its size follows the hidden states' scale (MiniLM-L6's 384 small units, SmolLM2's 576 after its final
norm, a Llama's 4,096) and how far a given learning rate moves them. A lambda tuned for one student says nothing
for another. So the search range is calibrated per run: the student trains naive W2S for a few steps, its drift
at each layer choice is measured against its own pretrained states (the anchor term's mean squared distance,
drift.DriftProbe's pairs), and lambda_balance = W2S loss / drift is the lambda at which the anchor term would
equal the W2S term at that drift. The search spans lambda_balance x SPAN, from nearly naive to nearly frozen
features; what each trial removed of naive W2S's drift is measured, not assumed (each trial's drift on the probe
after every epoch, the report's selection block and the NTS-against-lambda chart).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Sequence

import numpy as np
import torch

from anchor_rm.data import PreferencePair
from anchor_rm.drift import DRIFT_PROBE_PAIRS, evaluate_with_drift, evaluation_reference
from anchor_rm.losses import resolve_anchor_layers
from anchor_rm.training import TrainConfig
from anchor_rm.workflow import RewardModel, train_on_pairs

log = logging.getLogger("anchor_rm")

CALIBRATION_STEPS = 8  # naive W2S steps before the drift is measured
SPAN = (1e-2, 1e2)  # the search range, in units of lambda_balance
# Where no calibration runs (a sharded student the driver cannot hold): the range MiniLM-L6 was searched over.
UNCALIBRATED_RANGE = (1e-6, 10.0)


@dataclass(frozen=True)
class LambdaRange:
    """The anchor search's lambda range per layer choice and where it came from."""

    ranges: dict[str, tuple[float, float]]  # layer choice -> (low, high)
    method: str  # "calibrated", "given" (--lambda-range) or "uncalibrated"
    balance: dict[str, float] | None = None  # layer choice -> lambda_balance (calibrated)
    drift: dict[str, float] | None = None  # layer choice -> MSD after the calibration steps
    w2s_loss: float | None = None  # the W2S loss over the calibration's last steps
    steps: int = 0
    seconds: float = 0.0

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
            balance = ", ".join(f"{choice} {b:.3g}" for choice, b in (self.balance or {}).items())
            return (f"lambda_balance x {SPAN[0]:g}..{SPAN[1]:g}: {bounds} (lambda_balance {balance}, from "
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
    on the first pairs of student-train, then measures its drift at each layer choice on the drift probe's pairs
    against the states it had before training; lambda_balance = W2S loss (mean of the last steps) / drift."""
    started = time.perf_counter()
    depth = rm.model.config.num_hidden_layers
    layer_sets = {choice: resolve_anchor_layers(choice, depth) for choice in layer_choices}
    probe = list(student_train[:DRIFT_PROBE_PAIRS])
    layers = sorted({layer for layers in layer_sets.values() for layer in layers})
    with torch.no_grad():
        reference = evaluation_reference(rm.model, rm, probe, layers, batch_size=batch_size,
                                         precision=train_cfg.precision)
    n = min(len(student_train), steps * train_cfg.batch_size)
    config = replace(train_cfg, method="naive", anchor_lambda=0.0, epochs=1, warmup_fraction=0.0)
    logs = []
    train_on_pairs(rm, student_train[:n], None if soft_labels is None else soft_labels[:n], config, on_step=logs.append)
    if not logs:
        raise ValueError("the lambda calibration ran no step: student-train is empty")
    _, drift = evaluate_with_drift(rm, probe, reference, layer_sets, batch_size=batch_size, precision=train_cfg.precision)
    w2s = float(np.mean([entry.w2s_loss for entry in logs[-max(1, len(logs) // 2):]]))
    msd = {choice: drift[choice].msd for choice in layer_choices}
    balance = {choice: w2s / value if value > 0 else float("inf") for choice, value in msd.items()}
    if not all(np.isfinite(b) for b in balance.values()):
        raise ValueError(f"the student did not drift in {len(logs)} calibration steps (drift {msd}); give the "
                         f"search's range with --lambda-range")
    ranges = {choice: (b * SPAN[0], b * SPAN[1]) for choice, b in balance.items()}
    result = LambdaRange(ranges, "calibrated", balance, msd, w2s, len(logs), time.perf_counter() - started)
    log.info("lambda range: %s; drift after the calibration %s, W2S loss %.4f, %.0f s", result.describe(),
             {c: f"{v:.3g}" for c, v in msd.items()}, w2s, result.seconds)
    return result
