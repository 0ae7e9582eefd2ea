"""The training stages as plain functions: the student a run starts from, the frozen reference and its states
cached for training, training on pairs (the weak teacher's soft labels or gold), and the teacher's soft labels.
MLflow and Ray wrap these; nothing here reaches for them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from anchor_rm.data.records import PreferencePair
from anchor_rm.method.losses import resolve_anchor_layers
from anchor_rm.method.reference_cache import (ReferenceStates, choose_reference_cache, compute_reference_states,
                                              default_budget_bytes, disk_free_bytes, estimate_reference_nbytes,
                                              storage_dtype)
from anchor_rm.method.training import StepLog, TrainConfig, TrainResult, train_reward_model
from anchor_rm.model.encoding import RewardEncoder
from anchor_rm.model.loading import check_max_length, is_decoder, load_reward_model, load_tokenizer, resolve_model
from anchor_rm.model.lora import hold_frozen_base_in
from anchor_rm.model.precision import uses_bf16
from anchor_rm.model.reward_model import RewardModel, load_pretrained, release_device_memory, training_device
from anchor_rm.model.scoring import EncodedPairs
from anchor_rm.model.sharded import load_pretrained_sharded


log = logging.getLogger("anchor_rm")


def load_student(name: str, config: TrainConfig, device: str | torch.device | None = None, *,
                 adapters: str | Path | None = None) -> RewardModel:
    """The model a training run starts from, on `device` (default training_device()): pretrained, with LoRA
    adapters when `config` asks for them (`adapters`: the ones saved in a checkpoint, to continue from).

    - A LoRA student's frozen base is held in bf16 where `config.precision` is bf16 on that device
      (lora.hold_frozen_base_in), cast on the CPU before it moves: the device never holds its fp32 copy.
    - A student that trains sharded (strategy fsdp2, in a worker of a process group) is loaded sharded
      (sharded.load_pretrained_sharded): no worker's device holds the whole model at any time.
    """
    device = torch.device(device or training_device())
    bf16_base = bool(config.lora_rank) and uses_bf16(config.precision, device.type)
    if config.strategy == "fsdp2" and dist.is_available() and dist.is_initialized():
        if adapters is not None:
            raise ValueError("a sharded student continues from its sharded checkpoint (sharded.load_sharded), not "
                             "from an adapter folder")
        source = resolve_model(name)
        model = load_pretrained_sharded(name, device, precision=config.precision, seed=config.seed,
                                        lora_rank=config.lora_rank, lora_alpha=config.lora_alpha, bf16_base=bf16_base)
        check_max_length(model.config, config.max_length, source.name)
        tokenizer = load_tokenizer(source)
        return RewardModel(model, tokenizer, RewardEncoder(tokenizer, config.max_length, is_decoder(model)), source.name)
    rm = load_pretrained(name, config.max_length, config.seed, lora_rank=config.lora_rank, lora_alpha=config.lora_alpha,
                         adapters=adapters)
    if bf16_base:
        hold_frozen_base_in(rm.model, torch.bfloat16)
    rm.model.to(device)
    return rm


def frozen_reference(name: str, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The frozen pretrained copy ANCHOR pulls the student's hidden states towards, on `device`."""
    model = load_reward_model(resolve_model(name))
    return model.eval().requires_grad_(False).to(device)


def reference_states(student_name: str, rm: RewardModel, pairs: Sequence[PreferencePair],
                     layer_choices: Sequence[str], *, precision: str, batch_size: int = 32, cache: str = "ram",
                     budget_bytes: int | None = None, folder: str | Path | None = None,
                     device: str | torch.device | None = None) -> ReferenceStates | None:
    """The frozen reference as training reads it, at every layer any of `layer_choices` anchors, on `pairs`
    as `rm` encodes them: its states computed once on `device` (default training_device()) and shared by every
    epoch (and every Tune trial), in RAM or on disk under `folder`, or (live) None: no cache, every trainer loads
    the frozen model itself and runs it beside the student (nothing is loaded here for it).

    `cache`: ram, disk, live, or auto (reference_cache.choose_reference_cache: RAM within `budget_bytes`,
    default a quarter of physical memory; else disk when `folder` is given and has room; else live). The size
    is estimated before anything is computed; the choice and the figures behind it are logged."""
    depth = rm.model.config.num_hidden_layers
    layers = sorted({layer for choice in layer_choices for layer in resolve_anchor_layers(choice, depth)})
    encoded = rm.encode(pairs)
    value_bytes = storage_dtype(precision).itemsize
    # The student is the reference's architecture: its config sizes the cache before the reference is loaded.
    nbytes = estimate_reference_nbytes(encoded, len(layers), rm.model.config.hidden_size, value_bytes)
    budget = default_budget_bytes() if budget_bytes is None else budget_bytes
    free = None if folder is None else disk_free_bytes(folder)
    choice = choose_reference_cache(nbytes, budget, free, cache)
    if choice == "disk" and folder is None:
        raise ValueError("a disk reference cache needs a folder")
    log.info("reference cache: layers %s on %d sequences, %.1f MB (%d-byte values); budget %.1f MB, disk free %s: %s",
             layers, 2 * len(encoded), nbytes / 1e6, value_bytes, budget / 1e6,
             "-" if free is None else f"{free / 1e6:.0f} MB", choice)
    if choice == "live":
        return None
    reference = frozen_reference(student_name, device or training_device())
    states = compute_reference_states(reference, encoded, layers, rm.encoder.pad_token_id, batch_size=batch_size,
                                      precision=precision, into=folder if choice == "disk" else None)
    del reference
    release_device_memory()
    return states


def train_on_pairs(
    rm: RewardModel,
    pairs: Sequence[PreferencePair],
    target_probs: Sequence[float] | None,
    config: TrainConfig,
    *,
    reference: torch.nn.Module | ReferenceStates | None = None,
    on_step: Callable[[StepLog], None] | None = None,
    on_epoch_end: Callable[[int, torch.nn.Module, dict], dict | None] | None = None,
    start_epoch: int = 0,
    optimizer_state: dict | None = None,
) -> tuple[TrainResult, EncodedPairs]:
    """Trains rm in place. target_probs: one per input pair (soft labels), or None for gold (q = 1)."""
    encoded = rm.encode(pairs)
    if target_probs is None:
        targets = [1.0] * len(encoded)
    else:
        if len(target_probs) != len(pairs):
            raise ValueError(f"{len(pairs)} pairs but {len(target_probs)} soft labels")
        targets = [float(target_probs[i]) for i in encoded.kept]
    result = train_reward_model(
        rm.model, encoded, targets, config, reference=reference, pad_token_id=rm.encoder.pad_token_id,
        on_step=on_step, on_epoch_end=on_epoch_end, start_epoch=start_epoch, optimizer_state=optimizer_state,
    )
    return result, encoded


def soft_labels(teacher: RewardModel, pairs: Sequence[PreferencePair], batch_size: int = 32,
                precision: str = "auto") -> np.ndarray:
    """The teacher's P(chosen preferred) = sigmoid(r_chosen - r_rejected), one per input pair.

    A pair the teacher's truncation made identical gets 0.5: the teacher has no opinion on it.
    """
    encoded = teacher.encode(pairs)
    chosen, rejected = teacher.scorer(batch_size, precision).score_pairs(encoded, label="teacher labels")
    probs = np.full(len(pairs), 0.5)
    probs[encoded.kept] = 1.0 / (1.0 + np.exp(-(chosen - rejected)))
    return probs
