"""Turning (prompt, response) into model inputs: the one tokenisation and truncation policy.

Encoders score the pair as a text pair ([CLS] prompt [SEP] response [SEP] for BERT), so WordPiece never
merges words across the join. Decoders use the tokenizer's chat template where it has one (the prompt as
the user turn, the response as the assistant turn), else prompt and response joined by a blank line.

Truncation keeps the response: HH prompts are long multi-turn transcripts, and cutting on the right throws
away exactly the text being judged. Prompt tokens are dropped from the left (the oldest turns) first; only
a response that alone exceeds the budget is cut, at its end.

The anchor mask marks the positions ANCHOR regularises: the response tokens, and the position the reward
head reads. For a decoder that is the last token, a response token already. For an encoder it is the first
([CLS] for BERT, <s> for RoBERTa): the sequence-classification head pools that position alone, so without
it a last-layer anchor would not touch the representation the reward is read from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROMPT_RESPONSE_SEPARATOR = "\n\n"  # decoders without a chat template
HEAD_POSITION = 0  # where an encoder's sequence-classification head reads (BERT's pooler, RoBERTa's head)


@dataclass(frozen=True)
class EncodedText:
    input_ids: list[int]
    token_type_ids: list[int] | None
    anchor_mask: list[int]  # 1 on response tokens and the head's read position: where the anchor term counts
    prompt_tokens_dropped: int
    response_tokens_dropped: int

    @property
    def truncated(self) -> bool:
        return self.prompt_tokens_dropped > 0 or self.response_tokens_dropped > 0


@dataclass(frozen=True)
class _PairTemplate:
    """Special tokens around an encoder's text pair, read off the tokenizer itself (BERT, RoBERTa, ...)."""

    prefix: list[int]
    middle: list[int]
    suffix: list[int]
    prompt_type: int
    response_type: int
    has_token_types: bool


def _probe_pair_template(tokenizer) -> _PairTemplate:
    a = tokenizer("a", add_special_tokens=False)["input_ids"]
    b = tokenizer("b", add_special_tokens=False)["input_ids"]
    enc = tokenizer("a", "b")
    ids = enc["input_ids"]
    start_a = _find(ids, a, 0)
    start_b = _find(ids, b, start_a + len(a))
    types = enc.get("token_type_ids")
    return _PairTemplate(
        prefix=ids[:start_a],
        middle=ids[start_a + len(a) : start_b],
        suffix=ids[start_b + len(b) :],
        prompt_type=types[start_a] if types else 0,
        response_type=types[start_b] if types else 0,
        has_token_types=types is not None,
    )


def _find(ids: list[int], needle: list[int], start: int) -> int:
    for i in range(start, len(ids) - len(needle) + 1):
        if ids[i : i + len(needle)] == needle:
            return i
    raise ValueError("cannot read the text-pair template off this tokenizer")


class RewardEncoder:
    """Encodes (prompt, response) for one reward model under a maximum length."""

    def __init__(self, tokenizer, max_length: int, decoder: bool):
        if max_length < 8:
            raise ValueError(f"max_length must be at least 8 tokens, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.decoder = decoder
        self.pad_token_id = tokenizer.pad_token_id
        self._template = None if decoder else _probe_pair_template(tokenizer)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _decoder_parts(self, prompt: str, response: str) -> tuple[list[int], list[int], list[int]]:
        """(head, prompt, response) ids for a decoder; head is never truncated (BOS, system turn)."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            user = [{"role": "user", "content": prompt}]
            prompt_text = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            full = tok.apply_chat_template(user + [{"role": "assistant", "content": response}], tokenize=False)
            if full.startswith(prompt_text):
                return [], self._ids(prompt_text), self._ids(full[len(prompt_text) :])
        head = [tok.bos_token_id] if tok.bos_token_id is not None else []
        return head, self._ids(prompt + PROMPT_RESPONSE_SEPARATOR), self._ids(response)

    def encode(self, prompt: str, response: str) -> EncodedText:
        if self.decoder:
            head, prompt_ids, response_ids = self._decoder_parts(prompt, response)
            fixed = len(head)
        else:
            t = self._template
            head, prompt_ids, response_ids = [], self._ids(prompt), self._ids(response)
            fixed = len(t.prefix) + len(t.middle) + len(t.suffix)
        budget = self.max_length - fixed
        response_dropped = max(0, len(response_ids) - budget)
        if response_dropped:
            response_ids = response_ids[: len(response_ids) - response_dropped]
        prompt_dropped = max(0, len(prompt_ids) - (budget - len(response_ids)))
        prompt_ids = prompt_ids[prompt_dropped:]
        if self.decoder:
            ids = head + prompt_ids + response_ids
            mask = [0] * (len(head) + len(prompt_ids)) + [1] * len(response_ids)
            if ids:  # the head reads the last token: the response's last, or the prompt's when the response is empty
                mask[-1] = 1
            types = None
        else:
            t = self._template
            ids = t.prefix + prompt_ids + t.middle + response_ids + t.suffix
            n_prompt_side = len(t.prefix) + len(prompt_ids) + len(t.middle)
            mask = [0] * n_prompt_side + [1] * len(response_ids) + [0] * len(t.suffix)
            mask[HEAD_POSITION] = 1
            types = (
                [t.prompt_type] * n_prompt_side + [t.response_type] * (len(response_ids) + len(t.suffix))
                if t.has_token_types
                else None
            )
        return EncodedText(ids, types, mask, prompt_dropped, response_dropped)


def collate(encoded: list[EncodedText], pad_token_id: int, width: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pads a batch to its own longest sequence (dynamic padding), or to `width` when given."""
    longest = max(len(e.input_ids) for e in encoded)
    if width is not None and width < longest:
        raise ValueError(f"width {width} is shorter than the batch's longest sequence ({longest} tokens)")
    width = width or longest
    n = len(encoded)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    anchor_mask = torch.zeros((n, width), dtype=torch.float32)
    with_types = encoded[0].token_type_ids is not None
    token_type_ids = torch.zeros((n, width), dtype=torch.long) if with_types else None
    for row, e in enumerate(encoded):
        length = len(e.input_ids)
        input_ids[row, :length] = torch.tensor(e.input_ids)
        attention_mask[row, :length] = 1
        anchor_mask[row, :length] = torch.tensor(e.anchor_mask, dtype=torch.float32)
        if with_types:
            token_type_ids[row, :length] = torch.tensor(e.token_type_ids)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "anchor_mask": anchor_mask}
    if with_types:
        batch["token_type_ids"] = token_type_ids
    return batch
