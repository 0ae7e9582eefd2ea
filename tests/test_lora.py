"""LoRA students (anchor_rm/model/lora.py): the adapters-off reference is the pretrained model, its anchor loss is the
loss against a separate frozen copy, and a LoRA student saves as an ordinary folder (merged) plus its adapters."""

import copy

import pytest
import torch

from anchor_rm.data.records import PreferencePair
from anchor_rm.method.training import TrainConfig, train_reward_model
from anchor_rm.model.encoding import RewardEncoder
from anchor_rm.model.lora import add_adapters, adapters_off, is_adapted
from anchor_rm.model.scoring import encode_pairs, reward_forward
from helpers import tiny_llama


def _pairs(n=24):
    return [PreferencePair(f"question number {i}", f"good answer {i % 7}", f"bad answer {i % 5}", "toy") for i in range(n)]


def _anchor_run(model, encoded, pad, reference=None, **overrides):
    config = TrainConfig(**{"method": "anchor", "anchor_lambda": 1.0, "anchor_layers": "middle", "epochs": 2,
                            "batch_size": 8, "learning_rate": 5e-3, "precision": "fp32", "lora_rank": 4,
                            "lora_alpha": 8.0, **overrides})
    logs = []
    train_reward_model(model, encoded, [0.9] * len(encoded), config, reference=reference, pad_token_id=pad,
                       on_step=logs.append)
    return logs


def _adapters_off_matches_a_frozen_copy(base, encoder, pad, **overrides):
    """Trains the same LoRA student twice, against its adapters-off self and against a frozen copy of the
    pretrained model: every step's anchor loss agrees, it is 0 at step 0 and grows."""
    frozen = copy.deepcopy(base).eval()
    encoded = encode_pairs(encoder, _pairs())
    a, b = add_adapters(copy.deepcopy(base), 4, 8.0), add_adapters(copy.deepcopy(base), 4, 8.0)
    b.load_state_dict(a.state_dict())  # the same adapter initialisation
    assert all(torch.count_nonzero(p) == 0 for n, p in a.named_parameters() if ".lora_B." in n)
    itself = _anchor_run(a, encoded, pad, **overrides)
    against_copy = _anchor_run(b, encoded, pad, reference=frozen, **overrides)
    assert itself[0].anchor_loss == 0.0 and itself[-1].anchor_loss > 1e-6
    for mine, theirs in zip(itself, against_copy):
        assert mine.anchor_loss == pytest.approx(theirs.anchor_loss, rel=1e-5, abs=1e-9)
    # After training, the adapters-off model still computes the pretrained model's hidden states exactly.
    batch = {k: v for k, v in encoder.tokenizer(["a question", "another one"], return_tensors="pt", padding=True).items()
             if k in ("input_ids", "attention_mask")}
    with torch.no_grad(), adapters_off(a):
        off = reward_forward(a, batch, output_hidden_states=True).hidden_states
    with torch.no_grad():
        pretrained = reward_forward(frozen, batch, output_hidden_states=True).hidden_states
        on = reward_forward(a, batch, output_hidden_states=True).hidden_states
    for x, y in zip(off, pretrained):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    assert not torch.allclose(on[-1], pretrained[-1], atol=1e-4)  # with its adapters on, it has moved


def test_the_adapters_off_reference_of_a_tiny_llama_is_its_frozen_copy(minilm_tokenizer):
    _adapters_off_matches_a_frozen_copy(tiny_llama(minilm_tokenizer), RewardEncoder(minilm_tokenizer, 32, decoder=True),
                                        minilm_tokenizer.pad_token_id)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_adapters_off_reference_of_smollm2_is_its_frozen_copy():
    from anchor_rm.model.reward_model import load_pretrained

    rm = load_pretrained("smollm2-135m", 32, seed=0)
    _adapters_off_matches_a_frozen_copy(rm.model, rm.encoder, rm.encoder.pad_token_id, epochs=1, batch_size=8,
                                        learning_rate=1e-3)


def test_a_lora_student_trains_only_adapters_and_head_and_the_adapters_at_their_own_rate(minilm_tokenizer):
    model = add_adapters(tiny_llama(minilm_tokenizer), 4, 8.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or ".modules_to_save." in n for n in trainable)
    encoded = encode_pairs(RewardEncoder(minilm_tokenizer, 32, decoder=True), _pairs())
    _anchor_run(model, encoded, minilm_tokenizer.pad_token_id, method="naive", anchor_lambda=0.0, epochs=1,
                lora_learning_rate=1e-9)
    moved = {n: (p - before[n]).abs().max().item() for n, p in model.named_parameters()}
    assert all(moved[n] == 0 for n in moved if n not in trainable)  # the pretrained weights are untouched
    assert max(moved[n] for n in trainable if ".lora_" in n) < 1e-6  # adapters at 1e-9 per step
    assert max(moved[n] for n in trainable if ".modules_to_save." in n) > 1e-3  # the head at learning_rate


def test_activation_checkpointing_trains_the_same_model(tiny_bert, minilm_tokenizer):
    encoded = encode_pairs(RewardEncoder(minilm_tokenizer, 32, decoder=False), _pairs())
    models = []
    for checkpointing in (False, True):
        model = add_adapters(tiny_bert(0), 4, 8.0)
        _anchor_run(model, encoded, minilm_tokenizer.pad_token_id, activation_checkpointing=checkpointing, epochs=1)
        assert model.is_activation_checkpointing == checkpointing
        models.append(model)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_a_lora_student_saves_merged_and_resumes_from_its_adapters(tmp_path):
    import json

    from anchor_rm.model.reward_model import load_pretrained, load_saved, save_reward_model

    rm = load_pretrained("minilm-l6", 32, seed=0, lora_rank=4, lora_alpha=8.0)
    _anchor_run(rm.model, rm.encode(_pairs()), rm.encoder.pad_token_id, epochs=1)
    prompts, responses = ["What is 2+2?", "Name a colour."], ["It is 4.", "Blue."]
    trained = rm.scorer(precision="fp32").score(prompts, responses).rewards
    folder = save_reward_model(rm, tmp_path / "model")
    assert json.loads((folder / "anchor_rm.json").read_text())["lora"] == {"rank": 4, "alpha": 8.0, "adapter": "adapter"}
    assert (folder / "adapter" / "adapter_config.json").exists() and is_adapted(rm.model)  # saving merged a copy

    merged = load_saved(folder)  # what evaluation, the registry and the service load: an ordinary model
    assert not is_adapted(merged.model) and not any("lora" in n for n, _ in merged.model.named_parameters())
    torch.testing.assert_close(merged.scorer(precision="fp32").score(prompts, responses).rewards, trained,
                               rtol=1e-4, atol=1e-5)
    resumed = load_saved(folder, adapters=True)  # a resumed run: the pretrained base with the adapters on
    assert is_adapted(resumed.model)
    torch.testing.assert_close(resumed.scorer(precision="fp32").score(prompts, responses).rewards, trained,
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_reward_model(load_pretrained("minilm-l6", 32, seed=0), tmp_path / "full")
        load_saved(tmp_path / "full", adapters=True)


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="lora_rank must be >= 0"):
        TrainConfig(lora_rank=-1)
    with pytest.raises(ValueError, match="lora_alpha"):
        TrainConfig(lora_rank=8, lora_alpha=0)
    with pytest.raises(ValueError, match="do not combine"):
        TrainConfig(lora_rank=8, frozen_layers=2)
    # A cache key holds the LoRA settings only once they are set: keys of runs cached before LoRA stay valid.
    assert "lora_rank" not in TrainConfig().key_dict() and TrainConfig(lora_rank=8).key_dict()["lora_rank"] == 8


def test_a_lora_config_on_a_model_without_adapters_is_refused(tiny_bert, minilm_tokenizer):
    encoded = encode_pairs(RewardEncoder(minilm_tokenizer, 32, decoder=False), _pairs())
    with pytest.raises(ValueError, match="has no adapters"):
        _anchor_run(tiny_bert(0), encoded, minilm_tokenizer.pad_token_id)


@pytest.mark.parametrize("architecture", ["bert", "llama"])
def test_hooks_capture_the_hidden_states_transformers_returns(architecture, tiny_bert, minilm_tokenizer):
    from anchor_rm.model.scoring import capture_hidden_states

    model = (tiny_bert(0) if architecture == "bert" else tiny_llama(minilm_tokenizer)).eval()
    batch = dict(minilm_tokenizer(["a question", "another, longer one"], return_tensors="pt", padding=True))
    with torch.no_grad():
        expected = model(**batch, output_hidden_states=True).hidden_states
        for adapted in (model, add_adapters(copy.deepcopy(model), 4, 8.0)):
            with capture_hidden_states(adapted, [1, 2]) as captured:
                adapted(**batch)
            assert sorted(captured) == [1, 2]  # the anchored layers alone
            for i in (1, 2):  # 2 is the last layer: for Llama, after its final norm, as transformers returns it
                torch.testing.assert_close(captured[i], expected[i], rtol=0, atol=0)


# The LoRA tune run (registered, then scored by the service) is in tests/test_fsdp.py, sharded over two workers.
