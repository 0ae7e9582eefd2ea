"""Lambda in drift terms (anchor_rm/method/lambda_scale.py, drift.DriftProbe): the search range is calibrated for the
student from its own drift, and every trial's drift is measured on the same fixed pairs against the states the
student had before it trained (a LoRA student's, with its adapters off, at any time)."""

import pytest
import torch

from anchor_rm.data.records import PreferencePair
from anchor_rm.method.drift import DRIFT_PROBE_PAIRS, drift_probe
from anchor_rm.method.lambda_scale import SPAN, LambdaRange, calibrate_lambda, fixed_range
from anchor_rm.method.stages import train_on_pairs
from anchor_rm.method.training import TrainConfig
from anchor_rm.model.encoding import RewardEncoder
from anchor_rm.model.lora import add_adapters
from anchor_rm.model.reward_model import RewardModel
from helpers import tiny_llama, tiny_reward_model

pytestmark = pytest.mark.timeout(120)


def _pairs(n=80):
    return [PreferencePair(f"question number {i}", f"good answer {i % 7}", f"bad answer {i % 5}", "toy")
            for i in range(n)]


def _config(**kw):
    return TrainConfig(**{"method": "naive", "epochs": 1, "batch_size": 8, "learning_rate": 1e-3, "precision": "fp32",
                          **kw})


def test_the_calibration_spans_lambda_grad_per_layer_choice_and_follows_the_w2s_push(minilm_tokenizer):
    """lambda_grad = |grad W2S| / |grad anchor| on one batch: labels further from what the student says push harder,
    so the same student after the same steps gets a larger lambda_grad from q = 0.95 than from q = 0.55."""
    found = {}
    for q in (0.55, 0.95):
        rm, pairs = tiny_reward_model(minilm_tokenizer), _pairs()
        found[q] = calibrate_lambda(rm, pairs, [q] * len(pairs), _config(), ["last", "middle"], steps=4)
    calibrated = found[0.95]
    assert calibrated.method == "calibrated" and calibrated.steps == 4 and set(calibrated.ranges) == {"last", "middle"}
    for choice in ("last", "middle"):
        assert calibrated.drift[choice] > 0  # it trained, so it drifted from the states it started with
        grad = calibrated.lambda_grad[choice]
        assert calibrated.ranges[choice] == pytest.approx((grad * SPAN[0], grad * SPAN[1]))
        assert grad > found[0.55].lambda_grad[choice] > 0
    assert LambdaRange.from_dict(calibrated.to_dict()) == calibrated  # what the tune run's tag carries back on --resume
    assert "lambda_grad" in calibrated.describe()


def test_a_given_range_is_checked():
    assert fixed_range(["last"], 1e-3, 1.0, "given").ranges == {"last": (1e-3, 1.0)}
    with pytest.raises(ValueError, match="0 < low < high"):
        fixed_range(["last"], 1.0, 1e-3, "given")


def test_the_probe_reads_no_drift_before_training_and_some_after(minilm_tokenizer):
    rm, pairs = tiny_reward_model(minilm_tokenizer), _pairs()
    probe = drift_probe(rm, pairs, precision="fp32")
    assert len(probe.pairs) == min(len(pairs), DRIFT_PROBE_PAIRS) and probe.layer == 2
    assert probe.measure(rm, precision="fp32") == pytest.approx(0.0, abs=1e-12)
    train_on_pairs(rm, pairs, [0.9] * len(pairs), _config())
    assert probe.measure(rm, precision="fp32") > 0


def test_a_lora_students_probe_is_its_pretrained_states_even_after_training(minilm_tokenizer):
    """A resumed LoRA trial measures the probe's reference with its adapters off: the same states as before it
    trained, so its drift figures continue those of its first epochs."""
    def student():
        model = add_adapters(tiny_llama(minilm_tokenizer), 4, 8.0)
        return RewardModel(model, minilm_tokenizer, RewardEncoder(minilm_tokenizer, 32, decoder=True), "tiny-llama")

    rm, pairs = student(), _pairs()
    before = drift_probe(rm, pairs, precision="fp32")
    train_on_pairs(rm, pairs, [0.9] * len(pairs), _config(lora_rank=4, lora_alpha=8.0, lora_learning_rate=1e-2))
    after = drift_probe(rm, pairs, precision="fp32")
    layer = before.layer
    for seq in range(2 * len(before.pairs)):
        assert torch.allclose(before.reference.row(layer, seq), after.reference.row(layer, seq), atol=1e-6)
    assert before.measure(rm, precision="fp32") > 0 and rm.model.training
