import pytest
import torch

from anchor_rm.data.records import PreferencePair
from anchor_rm.evaluation.metrics import pairwise_accuracy
from anchor_rm.method.training import TrainConfig, epoch_batches, train_reward_model
from anchor_rm.model.encoding import RewardEncoder
from anchor_rm.model.scoring import RewardScorer, encode_pairs


def _pairs(n=48):
    # Separable toy preference: the chosen response says "good", the rejected one says "bad".
    return [PreferencePair(f"question number {i}", f"good answer {i % 7}", f"bad answer {i % 5}", "toy") for i in range(n)]


def _train(tiny_bert, tok, config, targets=None, seed=0, reference=None):
    enc = RewardEncoder(tok, 32, decoder=False)
    model = tiny_bert(seed)
    encoded = encode_pairs(enc, _pairs())
    logs = []
    result = train_reward_model(model, encoded, targets or [1.0] * len(encoded), config, reference=reference,
                                pad_token_id=tok.pad_token_id, on_step=logs.append)
    return model, enc, encoded, logs, result


def test_gold_training_learns_a_separable_preference(tiny_bert, minilm_tokenizer):
    config = TrainConfig(method="gold", epochs=4, batch_size=8, learning_rate=1e-3, precision="fp32")
    model, enc, encoded, logs, _ = _train(tiny_bert, minilm_tokenizer, config)
    chosen, rejected = RewardScorer(model, enc).score_pairs(encoded)
    assert pairwise_accuracy(chosen, rejected) == 100.0
    assert logs[-1].loss < logs[0].loss


def test_training_is_deterministic_on_cpu(tiny_bert, minilm_tokenizer):
    config = TrainConfig(method="naive", epochs=1, batch_size=8, learning_rate=1e-3, precision="fp32")
    a = _train(tiny_bert, minilm_tokenizer, config, targets=[0.8] * 48)[0]
    b = _train(tiny_bert, minilm_tokenizer, config, targets=[0.8] * 48)[0]
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_anchor_term_is_zero_at_step_zero_and_grows(tiny_bert, minilm_tokenizer):
    reference = tiny_bert(0).eval()  # the same initial weights as the student
    config = TrainConfig(method="anchor", anchor_lambda=0.1, anchor_layers="middle", epochs=2, batch_size=8,
                         learning_rate=1e-3, precision="fp32")
    _, _, _, logs, _ = _train(tiny_bert, minilm_tokenizer, config, targets=[0.9] * 48, reference=reference)
    assert logs[0].anchor_loss == 0.0
    assert logs[-1].anchor_loss > 0.0
    assert logs[-1].loss == pytest.approx(logs[-1].w2s_loss + 0.1 * logs[-1].anchor_loss, rel=1e-5)


def test_anchor_needs_a_reference(tiny_bert, minilm_tokenizer):
    with pytest.raises(ValueError, match="frozen reference"):
        _train(tiny_bert, minilm_tokenizer, TrainConfig(method="anchor", epochs=1), targets=[0.9] * 48)


def test_epoch_batches_cover_every_pair_once_and_group_lengths():
    lengths = [5, 100, 7, 90, 6, 95, 8, 99] * 10
    batches = epoch_batches(lengths, 8, seed=1, epoch=0, grouped=True)
    assert sorted(i for b in batches for i in b) == list(range(80))
    assert epoch_batches(lengths, 8, 1, 0, True) == batches  # same seed, same epoch: same batches
    assert epoch_batches(lengths, 8, 1, 1, True) != batches
    spread = max(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches)
    assert spread < 95  # no batch mixes the shortest and the longest sequences


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="method must be one of"):
        TrainConfig(method="magic")
    with pytest.raises(ValueError, match="anchor_lambda"):
        TrainConfig(anchor_lambda=-1)
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)


def test_cached_reference_states_give_the_uncached_anchor_loss(tiny_bert, minilm_tokenizer):
    from anchor_rm.method.losses import anchor_loss
    from anchor_rm.method.reference_cache import compute_reference_states
    from anchor_rm.model.encoding import collate
    from anchor_rm.model.scoring import reward_forward

    enc = RewardEncoder(minilm_tokenizer, 32, decoder=False)
    encoded = encode_pairs(enc, _pairs())
    reference = tiny_bert(0).eval()
    cache = compute_reference_states(reference, encoded, [1, 2], minilm_tokenizer.pad_token_id, batch_size=5, precision="fp32")
    student = tiny_bert(0)
    with torch.no_grad():  # a student that has drifted from the reference
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for indices in ([0, 1, 2, 3], [7, 30, 11], list(range(40, 48))):
        batch = collate([encoded.chosen[i] for i in indices] + [encoded.rejected[i] for i in indices],
                        minilm_tokenizer.pad_token_id)
        with torch.no_grad():
            s = reward_forward(student, batch, output_hidden_states=True).hidden_states
            r = reward_forward(reference, batch, output_hidden_states=True).hidden_states
        uncached = anchor_loss([s[1], s[2]], [r[1], r[2]], batch["anchor_mask"]).item()
        cached = anchor_loss([s[1], s[2]], cache.batch(indices, [1, 2], batch["anchor_mask"]), batch["anchor_mask"]).item()
        assert uncached > 0
        assert cached == pytest.approx(uncached, rel=1e-6)  # fp32 states for an fp32 run: same loss
    assert all(t.dtype == torch.float32 for per_layer in cache.states.values() for t in per_layer)
    half = compute_reference_states(reference, encoded, [1, 2], minilm_tokenizer.pad_token_id, batch_size=5, precision="bf16")
    assert all(t.dtype == torch.float16 for per_layer in half.states.values() for t in per_layer)
    assert half.nbytes() * 2 == cache.nbytes()


def test_training_with_the_cache_starts_at_zero_anchor_loss(tiny_bert, minilm_tokenizer):
    from anchor_rm.method.reference_cache import compute_reference_states

    enc = RewardEncoder(minilm_tokenizer, 32, decoder=False)
    encoded = encode_pairs(enc, _pairs())
    cache = compute_reference_states(tiny_bert(0), encoded, [2], minilm_tokenizer.pad_token_id, precision="fp32")
    config = TrainConfig(method="anchor", anchor_lambda=0.5, epochs=2, batch_size=8, learning_rate=1e-3, precision="fp32")
    logs = []
    train_reward_model(tiny_bert(0), encoded, [0.9] * len(encoded), config, reference=cache,
                       pad_token_id=minilm_tokenizer.pad_token_id, on_step=logs.append)
    assert logs[0].anchor_loss == pytest.approx(0.0, abs=1e-6) and logs[-1].anchor_loss > 1e-4


def test_a_cache_of_other_pairs_is_refused(tiny_bert, minilm_tokenizer):
    from anchor_rm.method.reference_cache import compute_reference_states

    enc = RewardEncoder(minilm_tokenizer, 32, decoder=False)
    encoded = encode_pairs(enc, _pairs())
    other = encode_pairs(enc, _pairs(40))
    states = compute_reference_states(tiny_bert(0), other, [2], minilm_tokenizer.pad_token_id, precision="fp32")
    with pytest.raises(ValueError, match="other token sequences"):
        train_reward_model(tiny_bert(0), encoded, [0.9] * len(encoded), TrainConfig(method="anchor", precision="fp32"),
                           reference=states, pad_token_id=minilm_tokenizer.pad_token_id)


def test_frozen_layers_keep_their_weights_and_hold_no_optimiser_state(tiny_bert, minilm_tokenizer):
    before = tiny_bert(0).state_dict()
    config = TrainConfig(method="naive", epochs=1, batch_size=8, learning_rate=1e-3, precision="fp32", frozen_layers=1)
    model, _, _, _, result = _train(tiny_bert, minilm_tokenizer, config, targets=[0.9] * 48)
    after = model.state_dict()
    frozen = [k for k in after if k.startswith(("bert.embeddings.", "bert.encoder.layer.0."))]
    trained = [k for k in after if k not in frozen and "position_ids" not in k and "token_type_ids" not in k]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert any(k.startswith("bert.encoder.layer.1.") for k in trained)
    # every trainable weight moved (a key bias gets no gradient: softmax ignores a shift shared by all keys)
    assert all(not torch.equal(before[k], after[k]) for k in trained
               if k.startswith(("bert.encoder.layer.1.", "classifier.")) and k.endswith(".weight"))
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert len(result.optimizer_state["optimizer"]["state"]) == trainable < len(list(model.parameters()))


def test_frozen_layers_may_not_reach_an_anchored_layer_nor_the_whole_model(tiny_bert, minilm_tokenizer):
    reference = tiny_bert(0).eval()
    config = TrainConfig(method="anchor", anchor_lambda=0.1, anchor_layers="1", epochs=1, batch_size=8, frozen_layers=1)
    with pytest.raises(ValueError, match=r"frozen_layers 1 would freeze anchored layer 1 \(anchor_layers '1' -> \[1\]\)"):
        _train(tiny_bert, minilm_tokenizer, config, targets=[0.9] * 48, reference=reference)
    with pytest.raises(ValueError, match="frozen_layers must be in 0..1 for a model of 2 layers, got 2"):
        _train(tiny_bert, minilm_tokenizer, TrainConfig(method="naive", epochs=1, frozen_layers=2), targets=[0.9] * 48)
    with pytest.raises(ValueError, match="frozen_layers must be >= 0, got -1"):
        TrainConfig(frozen_layers=-1)


def test_a_decoder_freezes_its_token_embeddings_and_lowest_layers():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from anchor_rm.model.loading import freeze_lower_layers

    model = LlamaForSequenceClassification(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                       num_hidden_layers=3, num_attention_heads=2, num_labels=1,
                                                       pad_token_id=0))
    freeze_lower_layers(model, 2)
    assert not model.model.embed_tokens.weight.requires_grad
    assert [all(not p.requires_grad for p in layer.parameters()) for layer in model.model.layers] == [True, True, False]
    assert model.score.weight.requires_grad and model.model.norm.weight.requires_grad
