"""Precision picked by the hardware: auto is bf16 only where bf16 is native and faster, an explicit bf16 on
an emulating CPU warns once with the measured slowdown, bf16 scoring keeps the reward head in fp32, and SDPA
attention runs in fp32 on a CPU under bf16 autocast."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch

from anchor_rm.data.records import PreferencePair
from anchor_rm.model import precision
from anchor_rm.model.encoding import RewardEncoder, collate
from anchor_rm.model.scoring import RewardScorer, encode_pairs
from anchor_rm.pipeline.config import ProtocolConfig


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be a CPU with the given native-bf16 flags and measured bf16/fp32 matmul time ratio."""
    def make(flags, slowdown):
        monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: flags)
        monkeypatch.setattr(precision, "bf16_matmul_slowdown", lambda: slowdown)
        precision.resolve_precision.cache_clear()
    yield make
    precision.resolve_precision.cache_clear()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, slowdown, expected", [
    ([], 70.0, "fp32"),                 # AVX2-only: emulated bf16, never picked
    (["avx512_bf16"], 0.25, "bf16"),    # native and faster
    (["amx_bf16"], 0.3, "bf16"),
    (["avx512_bf16"], 1.4, "fp32"),     # native but measured slower here: not worth it
    (None, 0.5, "bf16"),                # flags unknown (not Linux): the measurement decides
    (None, 60.0, "fp32"),
])
def test_auto_picks_bf16_only_where_native_and_faster(cpu, flags, slowdown, expected, caplog):
    cpu(flags, slowdown)
    with caplog.at_level(logging.INFO, logger="anchor_rm"):
        assert precision.resolve_precision("auto") == expected
        assert precision.resolve_precision("auto") == expected
    assert sum("precision auto ->" in r.message for r in caplog.records) == 1  # decided and logged once


@pytest.mark.timeout(60)
def test_explicit_choices_are_honoured_and_bf16_on_an_emulating_cpu_warns_once_with_the_slowdown(cpu):
    cpu([], 71.0)
    assert precision.resolve_precision("fp32") == "fp32"
    with pytest.warns(UserWarning, match=r"71x the time of fp32.*--precision auto would pick fp32"):
        assert precision.resolve_precision("bf16") == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precision.resolve_precision("bf16") == "bf16"  # once per process, not on every call
    cpu(["avx512_bf16"], 0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precision.resolve_precision("bf16") == "bf16"  # native: no warning


@pytest.mark.timeout(60)
def test_bad_precision_is_named():
    with pytest.raises(ValueError, match=r"precision must be one of auto, fp32, bf16, got 'fp16'"):
        precision.check_precision("fp16")
    with pytest.raises(ValueError, match="precision must be one of"):
        ProtocolConfig(precision="half")


@pytest.mark.timeout(60)
def test_the_protocol_resolves_once_for_every_stage(cpu):
    cpu([], 70.0)
    cfg = ProtocolConfig()
    assert cfg.resolve_precision() == "fp32"
    assert (cfg.precision, cfg.teacher_train.precision, cfg.student_train.precision) == ("fp32", "fp32", "fp32")
    assert cfg.resolve_precision("bf16") == "bf16" and cfg.student_train.precision == "bf16"


@pytest.mark.timeout(60)
def test_the_matmul_measurement_is_real_and_says_which_is_faster():
    ratio = precision.bf16_matmul_slowdown.__wrapped__(size=64, repeats=2)
    assert ratio > 0 and np.isfinite(ratio)


@pytest.mark.timeout(120)
def test_bf16_scoring_keeps_the_reward_head_in_fp32(tiny_bert, minilm_tokenizer):
    """A bf16 reward has 8 bits of mantissa: at a reward near 4 its steps are 1/64, so close rewards tie
    exactly. With the head in fp32 the reward is the fp32 head on the bf16 backbone's output: close to the
    fp32 reward, and not rounded to bf16."""
    model = tiny_bert(0)
    with torch.no_grad():
        model.classifier.bias.fill_(4.0)
    encoder = RewardEncoder(minilm_tokenizer, 64, decoder=False)
    pairs = [PreferencePair(f"question {i}", f"answer {i} is good", f"answer {i} is bad", "synthetic") for i in range(40)]
    encoded = encode_pairs(encoder, pairs)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):  # what plain autocast gives
        batch = collate(encoded.chosen + encoded.rejected, minilm_tokenizer.pad_token_id)
        batch.pop("anchor_mask")
        plain = model(**batch).logits[:, 0].float().numpy()
    assert len(np.unique(plain)) <= 2  # every reward rounded onto the same one or two bf16 values

    chosen, rejected = RewardScorer(model, encoder, 8, precision="bf16").score_pairs(encoded)
    fp32_chosen, _ = RewardScorer(model, encoder, 8, precision="fp32").score_pairs(encoded)
    rewards = np.concatenate([chosen, rejected])
    assert len(np.unique(rewards)) > 60  # they keep their differences
    np.testing.assert_allclose(chosen, fp32_chosen, atol=1e-3)
    assert not np.array_equal(chosen, fp32_chosen)  # the backbone really ran in bf16
    assert all(not m._forward_hooks for m in model.modules())  # the hook is gone afterwards


@pytest.mark.timeout(120)
@pytest.mark.parametrize("architecture", ["bert", "llama"])
def test_cpu_attention_runs_in_fp32_under_bf16_autocast_with_padding_still_masked(architecture, minilm_tokenizer):
    """use_cpu_fp32_attention: under bf16 autocast on a CPU the SDPA kernel gets fp32 inputs; padded positions
    stay masked (an attention name registered without a mask function gets no mask at all: the padded row's
    reward would change); gradients reach the projections; without autocast nothing changes."""
    from helpers import tiny_bert, tiny_llama

    model = (tiny_bert if architecture == "bert" else tiny_llama)(minilm_tokenizer, 0)
    reference = (tiny_bert if architecture == "bert" else tiny_llama)(minilm_tokenizer, 0)
    precision.use_cpu_fp32_attention(model)
    assert model.config._attn_implementation == precision.CPU_FP32_ATTENTION
    assert reference.config._attn_implementation == "sdpa"
    pad = minilm_tokenizer.pad_token_id
    ids = torch.tensor([[101, 2054, 2003, 1037, 2204, 3437, 102], [101, 2054, 2003, 102, pad, pad, pad]])
    mask = (ids != pad).long()
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                      lambda q, k, v, *args, **kwargs: seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
                      or real_sdpa(q, k, v, *args, **kwargs))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            both = model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
            alone = model(input_ids=ids[1:, :4], attention_mask=mask[1:, :4]).logits[:, 0].float()
            plain = reference(input_ids=ids, attention_mask=mask).logits[:, 0].float()
    fp32 = (torch.float32, torch.float32, torch.float32, False)
    assert len(seen) == 6 and set(seen[:4]) == {fp32}  # our model's 4 calls: fp32 inputs, autocast off
    assert all(call[3] for call in seen[4:])  # transformers' own SDPA: under autocast (bf16 kernel)
    torch.testing.assert_close(both[1], alone[0], atol=2e-2, rtol=0)  # padding masked (bf16 logits)
    torch.testing.assert_close(both, plain, atol=5e-2, rtol=0)  # the same model up to bf16 rounding
    both.sum().backward()
    queries = [p for n, p in model.named_parameters() if "q_proj" in n or "query" in n]
    assert queries and all(p.grad is not None and p.grad.abs().sum() > 0 for p in queries)
    with torch.no_grad():  # no autocast: exactly transformers' SDPA
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                                   reference(input_ids=ids, attention_mask=mask).logits, atol=0, rtol=0)


@pytest.mark.timeout(60)
def test_only_sdpa_models_change_attention(minilm_tokenizer):
    from helpers import tiny_bert

    model = tiny_bert(minilm_tokenizer, 0)
    model.set_attn_implementation("eager")
    precision.use_cpu_fp32_attention(model)
    assert model.config._attn_implementation == "eager"


@pytest.mark.timeout(60)
def test_service_setting_names_a_bad_precision():
    from service.config import SettingsError, load_settings

    assert load_settings({"ANCHOR_RM_PRECISION": "fp32"}).precision == "fp32"
    assert load_settings({}).precision == "auto"
    with pytest.raises(SettingsError, match="ANCHOR_RM_PRECISION='fp64': expected auto, fp32 or bf16"):
        load_settings({"ANCHOR_RM_PRECISION": "fp64"})


@pytest.mark.timeout(60)
def test_pipelines_name_a_bad_precision_flag(capsys):
    from anchor_rm.cli import train

    with pytest.raises(SystemExit):
        train.build_parser().parse_args(["--precision", "fp16"])
    assert "invalid choice: 'fp16'" in capsys.readouterr().err
