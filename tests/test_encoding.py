import torch

from anchor_rm.data.records import PreferencePair
from anchor_rm.model.encoding import RewardEncoder, collate
from anchor_rm.model.scoring import RewardScorer, encode_pairs

PROMPT = "Human: " + " ".join(f"word{i}" for i in range(300)) + " Assistant:"
RESPONSE = "The capital of France is Paris."


def test_encoder_text_pair_layout(minilm_tokenizer):
    enc = RewardEncoder(minilm_tokenizer, 64, decoder=False)
    e = enc.encode("what is up", "not much")
    tok = minilm_tokenizer
    assert e.input_ids[0] == tok.cls_token_id and e.input_ids[-1] == tok.sep_token_id
    assert e.input_ids == tok("what is up", "not much")["input_ids"]  # same as the tokenizer's own pair
    assert e.token_type_ids == tok("what is up", "not much")["token_type_ids"]
    anchored = [i for i, m in zip(e.input_ids, e.anchor_mask) if m]
    # The response, and [CLS]: the position BertForSequenceClassification's head reads.
    assert anchored[0] == tok.cls_token_id and tok.decode(anchored[1:]) == "not much"
    assert not e.truncated


def test_a_last_layer_anchor_constrains_what_the_encoders_head_reads(minilm_tokenizer):
    """The head pools [CLS] alone: a student whose [CLS] state drifted, all else equal, pays an anchor term."""
    from anchor_rm.method.losses import anchor_loss

    batch = collate([RewardEncoder(minilm_tokenizer, 64, decoder=False).encode("what is up", "not much")],
                    minilm_tokenizer.pad_token_id)
    reference = torch.randn(1, batch["input_ids"].shape[1], 8)
    student = reference.clone()
    student[0, 0] += 1.0  # only the [CLS] state moved
    assert anchor_loss([student], [reference], batch["anchor_mask"]).item() > 0


def test_truncation_drops_prompt_from_the_left_and_keeps_the_response(minilm_tokenizer):
    enc = RewardEncoder(minilm_tokenizer, 64, decoder=False)
    e = enc.encode(PROMPT, RESPONSE)
    assert len(e.input_ids) == 64
    assert e.prompt_tokens_dropped > 0 and e.response_tokens_dropped == 0
    text = minilm_tokenizer.decode(e.input_ids, skip_special_tokens=True)
    assert text.endswith("the capital of france is paris.")
    assert "word0 " not in text and "assistant :" in text  # the oldest words went, the latest stayed
    anchored = [i for i, m in zip(e.input_ids, e.anchor_mask) if m]
    assert anchored[0] == minilm_tokenizer.cls_token_id  # the head's read position, then the whole response
    assert minilm_tokenizer.decode(anchored[1:]) == RESPONSE.lower()


def test_response_longer_than_budget_is_cut_at_its_end(minilm_tokenizer):
    enc = RewardEncoder(minilm_tokenizer, 16, decoder=False)
    e = enc.encode("hi", " ".join(["long"] * 40))
    assert len(e.input_ids) == 16 and e.response_tokens_dropped > 0
    assert sum(e.anchor_mask) == 16 - 2  # the response and [CLS], not the two [SEP]; the prompt went entirely


def test_pairs_identical_after_truncation_are_dropped_and_counted(minilm_tokenizer):
    enc = RewardEncoder(minilm_tokenizer, 12, decoder=False)
    same_start = " ".join(["same"] * 30)
    pairs = [
        PreferencePair("p", same_start + " good", same_start + " bad", "t"),  # differ only past the budget
        PreferencePair("p", "good answer", "bad answer", "t"),
    ]
    encoded = encode_pairs(enc, pairs)
    assert encoded.identical_after_truncation == 1 and encoded.kept == [1]


def test_collate_pads_right_and_masks(minilm_tokenizer):
    enc = RewardEncoder(minilm_tokenizer, 64, decoder=False)
    a, b = enc.encode("a b c", "d"), enc.encode("a", "d e f g h")
    batch = collate([a, b], minilm_tokenizer.pad_token_id)
    width = max(len(a.input_ids), len(b.input_ids))
    assert batch["input_ids"].shape == (2, width)
    assert batch["attention_mask"].sum(1).tolist() == [len(a.input_ids), len(b.input_ids)]
    assert batch["anchor_mask"].sum(1).tolist() == [2, 6]  # response tokens + [CLS]
    assert torch.all(batch["anchor_mask"] <= batch["attention_mask"])


def test_scoring_runs_in_eval_mode_and_leaves_the_model_in_its_mode(minilm_tokenizer, tiny_bert):
    model = tiny_bert(0)
    model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.5
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5  # in training mode two calls would differ
    scorer = RewardScorer(model, RewardEncoder(minilm_tokenizer, 64, decoder=False), batch_size=8)
    model.train()
    first, second = scorer.score(["a prompt"] * 3, ["one", "two words", "three more words"]).rewards, \
        scorer.score(["a prompt"] * 3, ["one", "two words", "three more words"]).rewards
    assert (first == second).all() and all(m.training for m in model.modules())  # scored in eval, restored
    model.eval()
    model.classifier.train()  # one module left in training mode: still scored in eval mode, then restored
    assert (scorer.score(["a prompt"] * 3, ["one", "two words", "three more words"]).rewards == first).all()
    assert model.classifier.training and not model.training

    model.eval()
    walks = []
    model.eval = lambda: walks.append("eval")  # a model in eval mode is not walked again per call
    model.train = lambda mode=True: walks.append("train")
    assert (scorer.score(["a prompt"] * 3, ["one", "two words", "three more words"]).rewards == first).all()
    assert walks == []


def test_a_reward_does_not_depend_on_its_batch(minilm_tokenizer, tiny_bert):
    enc = RewardEncoder(minilm_tokenizer, 64, decoder=False)
    scorer = RewardScorer(tiny_bert(0), enc, batch_size=8)
    prompts = ["short", "a much longer prompt with many more words in it than the first", "mid length one"]
    responses = ["yes", "a long response " * 5, "ok then"]
    together = scorer.score(prompts, responses).rewards
    alone = [scorer.score([p], [r]).rewards[0] for p, r in zip(prompts, responses)]
    assert max(abs(x - y) for x, y in zip(together, alone)) < 1e-4


def test_matmul_weights_cast_once_score_bit_for_bit_as_autocast_does_and_the_head_stays_fp32(minilm_tokenizer, tiny_bert):
    import copy

    from anchor_rm.model.scoring import cast_matmul_weights_once, reward_head

    enc = RewardEncoder(minilm_tokenizer, 64, decoder=False)
    model = tiny_bert(0).eval()
    prompts = ["short", "a much longer prompt with many more words in it than the first", "mid length one"]
    responses = ["yes", "a long response " * 5, "ok then"]
    before = RewardScorer(model, enc, batch_size=2, precision="bf16").score(prompts, responses).rewards
    cast = copy.deepcopy(model)
    n = cast_matmul_weights_once(cast)
    linears = [m for m in cast.modules() if isinstance(m, torch.nn.Linear)]
    assert n == len(linears) - 1 and reward_head(cast).weight.dtype == torch.float32
    assert all(m.weight.dtype == torch.bfloat16 for m in linears if m is not reward_head(cast))
    after = RewardScorer(cast, enc, batch_size=2, precision="bf16").score(prompts, responses).rewards
    assert after.tolist() == before.tolist()  # the same bf16 weights reach the same kernels: no rounding of its own
    assert cast_matmul_weights_once(cast) == 0  # already cast: nothing to do
