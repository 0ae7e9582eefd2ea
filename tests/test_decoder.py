"""The decoder path on the real SmolLM2-135M weights (GGUF, dequantised once into the cache): chat template,
left truncation of the prompt, and the reward read at the last non-pad token."""

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from anchor_rm.model.reward_model import load_pretrained

    return load_pretrained("smollm2-135m", 96, seed=0)


def test_decoder_uses_the_chat_template_and_keeps_the_response(smollm2):
    tok = smollm2.tokenizer
    assert smollm2.encoder.decoder and smollm2.model.config.pad_token_id == tok.pad_token_id
    e = smollm2.encoder.encode("What is 2+2?", "It is 4.")
    text = tok.decode(e.input_ids)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text and "<|im_start|>assistant\n" in text
    assert tok.decode([i for i, m in zip(e.input_ids, e.anchor_mask) if m]).startswith("It is 4.")

    long = smollm2.encoder.encode("Tell me a story. " * 100, "Once upon a time.")
    assert len(long.input_ids) == 96 and long.prompt_tokens_dropped > 0 and long.response_tokens_dropped == 0
    assert tok.decode([i for i, m in zip(long.input_ids, long.anchor_mask) if m]).startswith("Once upon a time.")


def test_decoder_reward_is_read_at_the_last_token_and_does_not_depend_on_padding(smollm2):
    prompts = ["What is 2+2?", "Name a colour. " * 8]
    responses = ["It is 4.", "Blue, like the sky on a clear summer day."]
    scorer = smollm2.scorer(batch_size=8, precision="fp32")  # the manual check below runs in fp32
    together = scorer.score(prompts, responses).rewards
    for k, (prompt, response) in enumerate(zip(prompts, responses)):
        alone = scorer.score([prompt], [response]).rewards[0]
        assert abs(alone - together[k]) < 1e-4
        ids = torch.tensor([smollm2.encoder.encode(prompt, response).input_ids])
        with torch.inference_mode():
            hidden = smollm2.model.model(input_ids=ids).last_hidden_state
            manual = smollm2.model.score(hidden[0, -1]).item()  # the score head at the last token
        assert manual == pytest.approx(alone, abs=1e-4)


def test_the_reward_is_read_at_the_token_the_anchor_mask_marks_when_it_is_the_pad_token(smollm2):
    """SmolLM2-135M-Instruct's pad token is its end-of-turn token <|im_end|> (pad = EOS). A response cut to end on it
    (the assistant turn is "...<|im_end|>\\n": a budget one token short) ends in the pad id: the reward must be read
    there, where the anchor mask marks the read position, not one token earlier where transformers looks."""
    tok = smollm2.tokenizer
    assert tok.pad_token == "<|im_end|>"
    response = "It is four, since two and two make four."
    whole = smollm2.encoder.encode("What is 2+2?", response)
    assert whole.input_ids[-2] == tok.pad_token_id  # "<|im_end|>", then "\n"
    from anchor_rm.model.encoding import RewardEncoder

    # a budget one token short of the response: the prompt goes first, then the response's last token ("\n")
    encoder = RewardEncoder(tok, sum(whole.anchor_mask) - 1, decoder=True)
    cut = encoder.encode("What is 2+2?", response)
    assert cut.response_tokens_dropped == 1 and cut.input_ids[-1] == tok.pad_token_id
    read = len(cut.input_ids) - 1
    assert cut.anchor_mask[read] == 1
    scorer = smollm2.scorer(batch_size=8, precision="fp32")
    reward = scorer.score_encoded([cut, whole])[0]
    ids = torch.tensor([cut.input_ids])
    with torch.inference_mode():
        hidden = smollm2.model.model(input_ids=ids).last_hidden_state
        at_read = smollm2.model.score(hidden[0, read]).item()
        one_early = smollm2.model.score(hidden[0, read - 1]).item()
    assert reward == pytest.approx(at_read, abs=1e-4) and abs(at_read - one_early) > 1e-3
