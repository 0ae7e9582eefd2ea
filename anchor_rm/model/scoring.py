"""The one scoring path: tokenise, truncate, batch, score. Evaluation, the registered model and the HTTP
service all call `RewardScorer.score`."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from anchor_rm.data.progress import Progress
from anchor_rm.data.records import PreferencePair
from anchor_rm.model.encoding import EncodedText, RewardEncoder, collate
from anchor_rm.model.precision import autocast, check_precision


@dataclass(frozen=True)
class EncodedPairs:
    """Training/evaluation pairs after tokenisation; pairs that truncation made identical are gone."""

    chosen: list[EncodedText]
    rejected: list[EncodedText]
    kept: list[int]  # indices into the input pairs
    identical_after_truncation: int
    truncated: int  # pairs where either side lost tokens

    def __len__(self) -> int:
        return len(self.kept)


def encode_pairs(encoder: RewardEncoder, pairs: Sequence[PreferencePair]) -> EncodedPairs:
    chosen, rejected, kept = [], [], []
    identical = truncated = 0
    progress = Progress("tokenise", quiet_when_quick=True)  # a line every 10 s on a large set, else none
    for index, pair in enumerate(pairs):
        progress.update()
        c = encoder.encode(pair.prompt, pair.chosen)
        r = encoder.encode(pair.prompt, pair.rejected)
        if c.input_ids == r.input_ids:
            identical += 1  # no preference left to learn or to measure
            continue
        truncated += int(c.truncated or r.truncated)
        chosen.append(c)
        rejected.append(r)
        kept.append(index)
    progress.close()
    return EncodedPairs(chosen, rejected, kept, identical, truncated)


# A sequence's reward depends on how wide its batch is padded: under bf16, 1.6e-4 on rewards up to 0.05 between a
# text scored alone and with longer batch-mates (MiniLM-L6 on an Ice Lake CPU; 4e-8 in fp32; the number of rows
# changed nothing: bench/batch_invariance.py, docs/serving.md). So scoring pads each sequence to the next multiple
# of WIDTH_BUCKET tokens, a width that depends on the sequence alone, and batches it only with sequences of that
# width: its reward no longer depends on what else is scored (7e-9 in both precisions), at no measured cost.
WIDTH_BUCKET = 32
# What a caller may rely on: |reward scored alone - the same pair scored with any batch-mates| at most this, in
# fp32 and in bf16 (tests/test_batching.py asserts it on BERT and Llama models; measured on CPUs only).
BATCH_INVARIANCE_BOUND = 1e-6


def batch_invariance() -> dict:
    """What /model says about batch-mates (docs/serving.md)."""
    return {"width_bucket": WIDTH_BUCKET, "bound": BATCH_INVARIANCE_BOUND,
            "how": f"each sequence is padded to the next multiple of {WIDTH_BUCKET} tokens and scored only with "
                   "sequences of that width, so a reward does not depend on what else is in its batch; measured on "
                   "CPUs (bench/batch_invariance.py), not on GPUs"}


def bucket_width(length: int, cap: int, bucket: int = WIDTH_BUCKET) -> int:
    """The next multiple of `bucket` from `length`, at most `cap` (the encoder's max length: no position past the
    model's) unless the sequence itself is longer."""
    return max(length, min(-(-length // bucket) * bucket, cap))


def width_bucketed_batches(lengths: Sequence[int], batch_size: int, max_tokens: int | None, cap: int,
                           bucket: int = WIDTH_BUCKET) -> list[tuple[int, list[int]]]:
    """(padded width, batch) for every batch: each sequence padded to bucket_width(its length), batched only with
    sequences of the same width (length_sorted_batches within each width, longest widths first)."""
    by_width: dict[int, list[int]] = {}
    for index, length in enumerate(lengths):
        by_width.setdefault(bucket_width(length, cap, bucket), []).append(index)
    batches = []
    for width in sorted(by_width, reverse=True):
        members = by_width[width]
        for batch in length_sorted_batches([width] * len(members), batch_size, max_tokens):
            batches.append((width, [members[i] for i in batch]))
    return batches


def length_sorted_batches(lengths: Sequence[int], batch_size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Batches of similar length for inference: padding is where CPU time goes on HH (136-372 tokens). With
    `max_tokens`, a batch also holds at most that many tokens once padded (its longest sequence times its size):
    what bounds a large model's activation memory, where a count of sequences does not. A sequence longer than
    the budget goes alone."""
    order = np.argsort(np.asarray(lengths), kind="stable")[::-1].tolist()
    batches: list[list[int]] = []
    for index in order:  # longest first: a batch's first sequence is its longest
        if batches and len(batches[-1]) < batch_size and (
                max_tokens is None or (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens):
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def reward_forward(model, batch: dict[str, torch.Tensor], output_hidden_states: bool = False):
    """The one forward pass of a reward model over a collated batch (training, its reference, scoring)."""
    inputs = {k: v for k, v in batch.items() if k != "anchor_mask"}
    with read_at_last_token(model, batch["input_ids"], batch["attention_mask"]):
        return model(**inputs, output_hidden_states=output_hidden_states)


@contextmanager
def read_at_last_token(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """A decoder's reward read at each sequence's last token, the position its anchor mask marks (encoding.py).
    transformers' sequence classifiers read at the rightmost token that is not the pad id, and where the pad token
    is the end-of-sequence token (the stand-in Instruct checkpoints get, encoding's pad) a sequence that ends in it
    (Llama-3-Instruct's <|eot_id|>; any response cut to end on <|im_end|>) would be read one token early. The head
    scores every position before transformers picks one: a hook puts the last token's score where it looks."""
    core = getattr(model, "module", model)  # DistributedDataParallel's wrapped model
    head = reward_head(core)
    pad = getattr(core.config, "pad_token_id", None)
    if head is None or pad is None or not _is_decoder(core):
        yield
        return
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = attention_mask.sum(dim=-1) - 1  # collate pads on the right
    theirs = (positions * (input_ids != pad)).argmax(dim=-1)

    def move(_module, _args, output):
        moved = output.clone()
        moved[rows.to(output.device), theirs.to(output.device)] = output[rows.to(output.device), last.to(output.device)]
        return moved

    handle = head.register_forward_hook(move)
    try:
        yield
    finally:
        handle.remove()


def _is_decoder(model) -> bool:
    from anchor_rm.model.loading import is_decoder

    return is_decoder(model)


@contextmanager
def capture_hidden_states(model, indices: Sequence[int]):
    """Yields a dict that a forward pass of `model` inside the block fills with entries `indices` (1..L) of the
    `hidden_states` that `output_hidden_states=True` would return, captured by forward hooks on those layers
    alone: no other layer's states are kept for the caller (in a reference's no-grad pass every layer's would
    otherwise stay alive until the pass ends). Entry L of a decoder with a final norm is the norm's output, as
    transformers returns it."""
    from anchor_rm.model.loading import transformer_parts

    if not indices:
        yield {}
        return
    _, layers, norm = transformer_parts(model, "anchor_layers")
    captured: dict[int, torch.Tensor] = {}

    def keep(index: int):
        def hook(_module, _args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [(norm if index == len(layers) and norm is not None else layers[index - 1]).register_forward_hook(keep(index))
               for index in indices]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class ScoredTexts:
    rewards: np.ndarray  # float64, one per input
    truncated: np.ndarray  # bool, one per input
    # The OOD flag (anchor_rm/model/ood_flag.py), one per input; None when the scorer has no fitted density.
    ood_scores: np.ndarray | None = None
    in_domain: np.ndarray | None = None


# Called once per scored batch with (indices into the scored sequences, every layer's hidden states,
# response mask): how representation drift is measured in the same forward pass as the rewards.
HiddenStatesHook = Callable[[list[int], tuple[torch.Tensor, ...], torch.Tensor], None]


def reward_head(model) -> torch.nn.Linear | None:
    """The Linear that computes the scalar reward (named `score` or `classifier`), or None."""
    heads = [getattr(model, "score", None), getattr(model, "classifier", None)]
    # A LoRA student's head is peft's wrapper around a trained copy (modules_to_save): the copy computes the reward.
    heads = [next(iter(m.modules_to_save.values()), None) if hasattr(m, "modules_to_save") else m for m in heads]
    return next((m for m in heads if isinstance(m, torch.nn.Linear)), None)


def cast_matmul_weights_once(model, dtype: torch.dtype = torch.bfloat16) -> int:
    """For a model that only scores (the service): hold every Linear's weight and bias in `dtype`, the reward
    head's excepted. Under autocast to `dtype` a Linear casts its fp32 weight on every forward pass; cast once,
    the same values reach the same kernels (rewards bit for bit the same, tests/test_encoding.py) without the
    casts: 1.14x and 1.15x the pairs/s of a plain loop under autocast for MiniLM-L6 on a native-bf16 CPU
    (docs/benchmarks.md, *Service (M1, 2026-12-06)*, runs 5 and 6), and half the memory of those weights.
    Nothing else is cast: buffers (a rotary embedding's inv_freq), norms, embeddings and the head stay as
    evaluation holds them. The service casts on the CPU, before moving the model to its device
    (service/holder.py, place_for_scoring). Do not use it on a model that trains. Returns how many Linears it cast."""
    head = reward_head(model)
    cast = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head and module.weight.dtype != dtype:
            module.to(dtype)
            cast += 1
    return cast


@contextmanager
def fp32_reward_head(model):
    """Under bf16 autocast, computes the scalar reward head (a Linear named `score` or `classifier`) in
    fp32 from its input. A bf16 reward keeps 8 bits of mantissa: rewards that differ by less than that
    (common for a weakly trained model) come out exactly equal, and a tie counts as a wrong pair."""
    head = reward_head(model)
    if head is None:
        yield
        return

    def in_fp32(module, args, output):
        if not torch.is_autocast_enabled(output.device.type):
            return None  # nothing to undo: the head already ran in the model's own precision
        with torch.autocast(output.device.type, enabled=False):
            bias = None if module.bias is None else module.bias.float()
            return torch.nn.functional.linear(args[0].float(), module.weight.float(), bias)

    handle = head.register_forward_hook(in_fp32)
    try:
        yield
    finally:
        handle.remove()


def pooled_representation(states: torch.Tensor, anchor_mask: torch.Tensor) -> torch.Tensor:
    """(batch, d) fp32: each sequence's states averaged over its anchored positions (the response tokens and
    the position the head reads): the representation the OOD flag's density describes."""
    mask = anchor_mask.to(states.device, torch.float32).unsqueeze(-1)
    return (states.float() * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


class RewardScorer:
    """Scores (prompt, response) pairs with one reward model.

    `precision` (auto | fp32 | bf16, anchor_rm/model/precision.py): the forward pass runs under bf16 autocast where
    it resolves to bf16, about 2-2.5x faster on a CPU with native bf16; the reward head then still runs in
    fp32 (`fp32_reward_head`), so that bf16 rounding does not turn close rewards into ties.

    `density` (anchor_rm/model/ood_flag.py): with a fitted one, `score` also returns each pair's ood score and
    in-domain flag, from the same forward pass (the last layer's states, caught by a hook).

    `batch_invariant` (default): pad each sequence to its own width bucket (WIDTH_BUCKET) and batch it only with
    sequences of that width, so that its reward does not depend on what else is scored with it; False: pad each
    batch to its longest sequence (what bench/batch_invariance.py compares against).
    """

    def __init__(self, model, encoder: RewardEncoder, batch_size: int = 32, precision: str = "auto",
                 max_tokens: int | None = None, density=None, batch_invariant: bool = True):
        self.model = model
        self.encoder = encoder
        self.batch_size = batch_size
        self.max_tokens = max_tokens  # per forward pass, padded (length_sorted_batches); None: batch_size alone
        self.precision = check_precision(precision)
        self.density = density  # ood_flag.DensityFit or None
        self.batch_invariant = batch_invariant  # width buckets (WIDTH_BUCKET)

    @torch.inference_mode()
    def _forward(self, encoded: Sequence[EncodedText], hidden_states_hook: HiddenStatesHook | None,
                 with_features: bool, label: str = "scoring") -> tuple[np.ndarray, np.ndarray | None]:
        """Rewards, and (with_features) each sequence's pooled representation, in one pass over `encoded`. A pass
        longer than the progress interval writes `label`'s progress lines (anchor_rm/data/progress.py)."""
        # Scored in eval mode; each module gets its own mode back. Only a model with a module in training mode
        # is switched: eval() and train() walk every module, which cost about 1.5 ms of a 12 ms lone-pair call
        # (bench/service_breakdown.py, M1), and the service's model is always in eval mode.
        modes = [(module, module.training) for module in self.model.modules()]
        switched = any(training for _, training in modes)
        if switched:
            self.model.eval()
        rewards = np.zeros(len(encoded), dtype=np.float64)
        features: np.ndarray | None = None
        device = next(self.model.parameters()).device
        last = self.model.config.num_hidden_layers
        progress = Progress(label, unit="responses", total=len(encoded), quiet_when_quick=True)
        lengths = [len(e.input_ids) for e in encoded]
        if self.batch_invariant:
            plan = width_bucketed_batches(lengths, self.batch_size, self.max_tokens, self.encoder.max_length)
        else:
            plan = [(None, b) for b in length_sorted_batches(lengths, self.batch_size, self.max_tokens)]
        try:
            for width, batch_indices in plan:
                batch = collate([encoded[i] for i in batch_indices], self.encoder.pad_token_id, width)
                batch = {k: v.to(device) for k, v in batch.items()}
                every_layer = hidden_states_hook is not None
                with autocast(self.precision, device.type), fp32_reward_head(self.model), \
                        capture_hidden_states(self.model, [last] if with_features and not every_layer else []) as caught:
                    output = reward_forward(self.model, batch, output_hidden_states=every_layer)
                rewards[batch_indices] = output.logits[:, 0].float().cpu().numpy()
                if with_features:
                    pooled = pooled_representation(output.hidden_states[-1] if every_layer else caught[last],
                                                   batch["anchor_mask"]).cpu().numpy()
                    if features is None:
                        features = np.zeros((len(encoded), pooled.shape[1]), dtype=np.float32)
                    features[batch_indices] = pooled
                if every_layer:
                    hidden_states_hook(batch_indices, output.hidden_states, batch["anchor_mask"])
                progress.update(len(batch_indices))
            progress.close()
        finally:
            if switched:
                for module, training in modes:
                    module.training = training
        return rewards, features

    def score_encoded(self, encoded: Sequence[EncodedText], hidden_states_hook: HiddenStatesHook | None = None,
                      label: str = "scoring") -> np.ndarray:
        return self._forward(encoded, hidden_states_hook, with_features=False, label=label)[0]

    def rewards_and_ood(self, encoded: Sequence[EncodedText], hidden_states_hook: HiddenStatesHook | None = None,
                        label: str = "scoring") -> tuple[np.ndarray, np.ndarray | None]:
        """Rewards and, where the scorer has a density, each sequence's ood score (else None)."""
        rewards, features = self._forward(encoded, hidden_states_hook, with_features=self.density is not None,
                                          label=label)
        return rewards, None if features is None else self.density.score(features)

    def features(self, encoded: Sequence[EncodedText]) -> np.ndarray:
        """(n, d) fp32: each sequence's pooled representation (what the OOD flag's density is fitted on)."""
        features = self._forward(encoded, None, with_features=True)[1]
        return np.zeros((0, self.model.config.hidden_size), np.float32) if features is None else features

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> ScoredTexts:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        encoded = [self.encoder.encode(p, r) for p, r in zip(prompts, responses)]
        rewards, ood = self.rewards_and_ood(encoded)
        truncated = np.array([e.truncated for e in encoded], dtype=bool)
        return ScoredTexts(rewards, truncated, ood, None if ood is None else self.density.in_domain(ood))

    def score_pairs(self, pairs: EncodedPairs, hidden_states_hook: HiddenStatesHook | None = None,
                    label: str = "scoring") -> tuple[np.ndarray, np.ndarray]:
        """Rewards of the chosen and of the rejected responses; the hook sees chosen + rejected indices."""
        rewards = self.score_encoded(pairs.chosen + pairs.rejected, hidden_states_hook, label)
        return rewards[: len(pairs)], rewards[len(pairs) :]


# ---------------------------------------------------------------------------------------------------
# Best-of-n and pairwise preference from rewards.

def rank(rewards: Sequence[float]) -> list[int]:
    """Indices, best reward first; equal rewards keep request order."""
    return sorted(range(len(rewards)), key=lambda i: (-float(rewards[i]), i))


def sigmoid(x: float) -> float:
    """1 / (1 + e^-x), without overflow for large |x|."""
    x = float(x)
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def preference_probability(reward_a: float, reward_b: float) -> float:
    """P(a preferred over b) = sigmoid(r_a - r_b) (Bradley-Terry)."""
    return sigmoid(float(reward_a) - float(reward_b))


# ---------------------------------------------------------------------------------------------------
# Conversations and rendered transcripts -> (prompt, response), the pair every scorer takes.

HUMAN, ASSISTANT = "\n\nHuman: ", "\n\nAssistant:"


def message_text(content) -> str:
    """An OpenAI-style message content: a string, or a list of parts of which the text parts count."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type", "text") == "text"]
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"content: text part {i} has a text of type {type(text).__name__}, not a string")
        return "".join(texts)
    raise ValueError(f"content must be a string or a list of text parts, got {type(content).__name__}")


def conversation_to_pair(messages: Sequence[dict]) -> tuple[str, str]:
    """A conversation ending in the assistant's reply -> (prompt, response). The turns before the reply are
    rendered as an HH transcript ("\n\nHuman: ...\n\nAssistant: ...", ending in "\n\nAssistant:"), the
    format of the HH prompts the default models train on; a system message leads as a plain paragraph.
    (A decoder's encoder then wraps the pair in its chat template, as for any pair.)"""
    if not messages:
        raise ValueError("needs at least one message (the assistant's reply to judge)")
    *turns, last = messages
    if last.get("role") != "assistant":
        raise ValueError(f"the last message must be the assistant's reply to judge, not role {last.get('role')!r}")
    prompt = ""
    for i, turn in enumerate(turns):
        role, text = turn.get("role"), message_text(turn.get("content", ""))
        if role == "system":
            prompt += text
        elif role == "user":
            prompt += HUMAN + text
        elif role == "assistant":
            prompt += ASSISTANT + " " + text
        else:
            raise ValueError(f"message {i}: role must be system, user or assistant, not {role!r}")
    return prompt + ASSISTANT, message_text(last.get("content", ""))


def split_transcript(text: str) -> tuple[str, str, bool]:
    """A whole rendered exchange -> (prompt, response, found). An HH transcript splits after its last
    "\n\nAssistant:"; any other text (another chat template, plain text) is scored whole, as the response
    to an empty prompt, and found is False."""
    at = text.rfind(ASSISTANT)
    if at < 0 or HUMAN not in text[:at + 1]:
        return "", text, False
    cut = at + len(ASSISTANT)
    return text[:cut], text[cut:].removeprefix(" "), True
