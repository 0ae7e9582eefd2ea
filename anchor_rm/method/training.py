"""The training loop: one plain function, run in one process or as Ray Train's per-worker loop.

Each step takes a batch of pairs, scores chosen and rejected responses in one forward pass, and minimises

    L = L_w2s(margin, q) + anchor_lambda * L_anchor(student states, reference states)   (method "anchor")

against the teacher's soft labels q (methods naive / confidence / anchor) or gold labels q = 1 (method
"gold", the strong ceiling; also how the weak teacher itself is trained). Under torch.distributed the model
is wrapped in DistributedDataParallel (or, with strategy fsdp2, sharded: anchor_rm/model/sharded.py) and each rank takes
its share of every epoch's batches.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from anchor_rm.data.progress import Progress
from anchor_rm.method.losses import (anchor_loss, confidence_alpha, confidence_w2s_loss, check_layer_settings,
                                     resolve_anchor_layers, soft_bradley_terry_loss)
from anchor_rm.method.reference_cache import ReferenceStates, encoded_digest
from anchor_rm.model.encoding import collate
from anchor_rm.model.loading import freeze_lower_layers
from anchor_rm.model.lora import adapter_parameter, adapters_off, is_adapted
from anchor_rm.model.precision import autocast, check_precision
from anchor_rm.model.scoring import EncodedPairs, capture_hidden_states, fp32_reward_head, reward_forward
from anchor_rm.model.sharded import is_sharded, load_sharded, shard_model

METHODS = ("naive", "confidence", "anchor", "gold")


TEACHER_LABELS = ("raw", "calibrated")
STRATEGIES = ("ddp", "fsdp2")


@dataclass
class TrainConfig:
    """Hyperparameters of one student (or teacher) training run."""

    method: str = "anchor"  # naive | confidence | anchor | gold (q = 1: the strong ceiling and the teacher)
    anchor_lambda: float = 1e-2  # weight of L_anchor; 0 makes "anchor" identical to "naive"
    anchor_layers: str = "last"  # "last", "middle" (50% and 75% of depth) or "2,4"
    confidence_alpha: float = 0.75  # Burns et al.'s final weight of the self-hardened target
    epochs: int = 2
    batch_size: int = 16  # pairs per optimiser step (two sequences each), summed over workers
    learning_rate: float = 5e-5  # 2e-5 barely moved MiniLM-L6 in one epoch (train loss 0.691 vs ln 2)
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1  # linear warm-up, then linear decay to 0
    max_grad_norm: float = 1.0
    max_length: int = 256  # tokens per (prompt, response); prompts are cut from the left
    seed: int = 0
    length_grouped: bool = True  # batches of similar length: less padding, same data per epoch
    # auto | fp32 | bf16: bf16 autocast only where the hardware computes bf16 natively and faster
    # (anchor_rm/model/precision.py); the pipelines store the resolved value here.
    precision: str = "auto"
    # The embeddings and the lowest k transformer layers keep their pretrained weights (models.freeze_lower_layers):
    # no backward pass through them and no optimiser state, a CPU lever (docs/benchmarks.md, Freezing the lower
    # layers). Every anchored layer must lie above them. 0: full fine-tuning.
    frozen_layers: int = 0
    # The weak teacher's soft labels a W2S student trains on: "raw", or "calibrated" (temperature-scaled on the
    # gold teacher_calibration split, metrics.fit_temperature). Not used by gold training.
    teacher_labels: str = "raw"
    # LoRA (anchor_rm/model/lora.py): adapters of this rank on every linear layer, the reward head trained in full, and
    # ANCHOR's reference the same model with its adapters off. 0: full fine-tuning. The model must come with its
    # adapters (reward_model.load_pretrained(..., lora_rank=)).
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapters' output is scaled by lora_alpha / lora_rank
    lora_learning_rate: float | None = None  # the adapters' learning rate (None: learning_rate, which the head keeps)
    # Recompute each layer's activations in the backward pass instead of keeping them (non-reentrant): less
    # memory for a longer step. Numerically the same training.
    activation_checkpointing: bool = False
    # How several workers share the training: "ddp" (each holds the whole model, gradients averaged) or "fsdp2"
    # (torch's fully_shard per transformer layer, then the root: parameters, gradients and optimiser state
    # sharded over the workers). One worker: no difference.
    strategy: str = "ddp"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.anchor_lambda < 0:
            raise ValueError(f"anchor_lambda must be >= 0, got {self.anchor_lambda}")
        if not 0 <= self.confidence_alpha <= 1:
            raise ValueError(f"confidence_alpha must be in [0, 1], got {self.confidence_alpha}")
        for name in ("epochs", "batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.frozen_layers < 0:
            raise ValueError(f"frozen_layers must be >= 0, got {self.frozen_layers}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        check_precision(self.precision, "precision")
        if self.teacher_labels not in TEACHER_LABELS:
            raise ValueError(f"teacher_labels must be one of {', '.join(TEACHER_LABELS)}, got {self.teacher_labels!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: full fine-tuning), got {self.lora_rank}")
        if self.lora_alpha <= 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha}")
        if self.lora_learning_rate is not None and self.lora_learning_rate <= 0:
            raise ValueError(f"lora_learning_rate must be > 0, got {self.lora_learning_rate}")
        if self.lora_rank and self.frozen_layers:
            raise ValueError(f"frozen_layers ({self.frozen_layers}) and lora_rank ({self.lora_rank}) do not combine: "
                             "with LoRA every pretrained weight is frozen already")

    @property
    def uses_anchor(self) -> bool:
        return self.method == "anchor" and self.anchor_lambda > 0

    def to_dict(self) -> dict:
        return asdict(self)

    def key_dict(self) -> dict:
        """What a stage cache keys on: every field, but the options added after caches existed only when they
        are set, so that runs cached before them (hours of the study's students) are still found."""
        fields = self.to_dict()
        for name, default in KEYED_ONLY_WHEN_SET.items():
            if fields[name] == default:
                del fields[name]
        return fields


# TrainConfig fields that enter a cache key only when they differ from these defaults (TrainConfig.key_dict).
KEYED_ONLY_WHEN_SET = {"lora_rank": 0, "lora_alpha": 16.0, "lora_learning_rate": None, "activation_checkpointing": False,
                       "strategy": "ddp"}


@dataclass
class StepLog:
    step: int
    epoch: int
    loss: float
    w2s_loss: float
    anchor_loss: float
    learning_rate: float
    grad_norm: float | None = None  # the gradients' total norm before clipping (None: no clipping)


@dataclass
class TrainResult:
    steps: int
    seconds: float
    pairs_seen: int
    step_logs: list[StepLog] = field(default_factory=list)
    epoch_metrics: list[dict] = field(default_factory=list)
    optimizer_state: dict | None = None  # for resuming from a checkpoint


def epoch_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int, grouped: bool) -> list[list[int]]:
    """The batches of one epoch, the same on every rank for a given (seed, epoch).

    Length grouping (as in transformers' LengthGroupedSampler): shuffle, cut into mega-batches of 50
    batches, sort each by length, then shuffle the batches; randomness is kept, most padding is not.
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    if grouped:
        mega = batch_size * 50
        lengths_arr = np.asarray(lengths)
        order = np.concatenate(
            [chunk[np.argsort(-lengths_arr[chunk], kind="stable")] for chunk in np.array_split(order, max(1, math.ceil(len(order) / mega)))]
        )
    batches = [order[i : i + batch_size].tolist() for i in range(0, len(order), batch_size)]
    if grouped:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _linear_schedule(optimizer, warmup_steps: int, total_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_reward_model(
    model: torch.nn.Module,
    train: EncodedPairs,
    target_probs: Sequence[float],
    config: TrainConfig,
    *,
    reference: torch.nn.Module | ReferenceStates | None = None,
    pad_token_id: int,
    on_step: Callable[[StepLog], None] | None = None,
    on_epoch_end: Callable[[int, torch.nn.Module, dict], dict | None] | None = None,
    start_epoch: int = 0,
    optimizer_state: dict | None = None,
) -> TrainResult:
    """Trains `model` in place on encoded pairs with per-pair targets q (probability chosen > rejected).

    `reference` is the frozen pretrained copy, needed when config.uses_anchor: the model itself (one extra
    forward pass per step) or its states precomputed on these pairs (reference_cache). `on_epoch_end(epoch, model,
    optimizer_state)` runs on every rank after each epoch (evaluate, checkpoint, report) and may return
    metrics to keep. `start_epoch` and `optimizer_state` resume an interrupted run from a checkpoint: the state
    an earlier run's on_epoch_end was given, or {"sharded": checkpoint folder, "scheduler": ...} for an FSDP2
    checkpoint, whose weights and optimizer state are read here, once the model is sharded (sharded.load_sharded).
    """
    if len(target_probs) != len(train):
        raise ValueError(f"{len(train)} training pairs but {len(target_probs)} targets")
    if len(train) == 0:
        raise ValueError("no training pairs")
    adapted = is_adapted(model)
    if config.lora_rank and not adapted:
        raise ValueError(f"lora_rank {config.lora_rank} but the model has no adapters: load it with "
                         "reward_model.load_pretrained(..., lora_rank=)")
    if config.uses_anchor and reference is None and not adapted:
        raise ValueError("method 'anchor' with anchor_lambda > 0 needs the frozen reference model "
                         "(or a LoRA student, whose reference is itself with its adapters off)")
    torch.manual_seed(config.seed)
    rank, world = _world()
    if config.batch_size % world:
        raise ValueError(f"batch_size {config.batch_size} is not divisible by the {world} workers")
    per_rank = config.batch_size // world

    core = model
    if config.activation_checkpointing:
        # Non-reentrant: the reentrant kind gives no gradients when the inputs need none (a frozen base, trl#3089).
        core.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    check_layer_settings(config.frozen_layers, [config.anchor_layers] if config.uses_anchor else [],
                         core.config.num_hidden_layers)
    layers = resolve_anchor_layers(config.anchor_layers, core.config.num_hidden_layers) if config.uses_anchor else []
    # Frozen before DDP wraps the model: DDP buckets the parameters that require grad when it is built, and a
    # bucket of parameters frozen afterwards never reduces ("Expected to have finished reduction" at step 2).
    freeze_lower_layers(core, config.frozen_layers)
    device = next(core.parameters()).device
    # FSDP2 under any process group, one worker included: a one-GPU run shards as an eight-GPU run does. A model
    # loaded sharded (sharded.load_pretrained_sharded, as the trials load it) is sharded already.
    sharded = config.strategy == "fsdp2" and dist.is_available() and dist.is_initialized()
    if config.strategy == "fsdp2" and not sharded and not is_sharded(core):
        raise ValueError("strategy fsdp2 needs a process group (Ray Train's workers, or torchrun); without one, "
                         "train with strategy ddp")
    if sharded:
        if not is_sharded(core):
            shard_model(core, config.precision, device.type)
        if isinstance(reference, torch.nn.Module) and not is_sharded(reference):  # the frozen copy too
            shard_model(reference.requires_grad_(False), config.precision, device.type)
    elif world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if isinstance(reference, ReferenceStates):
        if reference.digest != encoded_digest(train):
            raise ValueError("the reference cache was computed on other token sequences than these training pairs")
    elif reference is not None:
        reference.eval().requires_grad_(False).to(next(core.parameters()).device)

    targets = torch.tensor(list(target_probs), dtype=torch.float32)
    lengths = [max(len(c.input_ids), len(r.input_ids)) for c, r in zip(train.chosen, train.rejected)]
    steps_per_epoch = len(epoch_batches(lengths, config.batch_size, config.seed, 0, config.length_grouped))
    total_steps = steps_per_epoch * config.epochs
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
    trainable = [(n, p) for n, p in core.named_parameters() if p.requires_grad]
    # With lora_learning_rate, the adapters train at their own rate and the head at learning_rate.
    own_rate = adapted and config.lora_learning_rate is not None
    adapters = [p for n, p in trainable if own_rate and adapter_parameter(n)]
    rest = [(n, p) for n, p in trainable if not (own_rate and adapter_parameter(n))]
    groups = [
        {"params": [p for n, p in rest if not n.endswith(no_decay)], "weight_decay": config.weight_decay},
        {"params": [p for n, p in rest if n.endswith(no_decay)], "weight_decay": 0.0},
        {"params": adapters, "weight_decay": config.weight_decay, "lr": config.lora_learning_rate},
    ]
    groups = [g for g in groups if g["params"]]
    # The fused kernel updates each parameter in one pass instead of several: 0.15 s -> 0.03 s per optimiser
    # step for MiniLM-L6 on 2 CPU cores (half its 22.7M parameters are word embeddings with dense gradients);
    # 1.05-1.17x pairs/s end to end (docs/benchmarks.md). TRL's default optimiser is the same kernel.
    fused = next(core.parameters()).device.type in ("cpu", "cuda") and not sharded
    optimizer = torch.optim.AdamW(groups, lr=config.learning_rate, fused=fused)
    scheduler = _linear_schedule(optimizer, max(1, int(total_steps * config.warmup_fraction)), total_steps)
    if optimizer_state is not None:
        if "sharded" in optimizer_state:  # an FSDP2 checkpoint, read into this run's layout (any number of workers)
            load_sharded(optimizer_state["sharded"], core, optimizer)
        else:
            optimizer.load_state_dict(optimizer_state["optimizer"])
        scheduler.load_state_dict(optimizer_state["scheduler"])

    result = TrainResult(steps=0, seconds=0.0, pairs_seen=0)
    started = time.perf_counter()
    step = start_epoch * steps_per_epoch
    # One rank's lines: steps done of those left, pairs/s, time left, the loss (anchor_rm/data/progress.py).
    progress = Progress("training", unit="steps", total=total_steps - step, rate_unit="pairs",
                        quiet_when_quick=True) if rank == 0 else None
    model.train()
    for epoch in range(start_epoch, config.epochs):
        for batch_indices in epoch_batches(lengths, config.batch_size, config.seed, epoch, config.length_grouped):
            mine = batch_indices[rank * per_rank : (rank + 1) * per_rank]
            if not mine:  # the last, short batch may leave a rank empty; it still joins the step
                mine = batch_indices[:1]
            log = _train_step(model, core, reference, train, targets, mine, layers, config, step, total_steps, pad_token_id)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            log.learning_rate = scheduler.get_last_lr()[0]
            log.epoch = epoch
            result.step_logs.append(log)
            result.pairs_seen += len(batch_indices)
            step += 1
            if progress is not None:
                progress.update(rated=len(batch_indices),
                                note=f"epoch {epoch + 1}/{config.epochs}, loss {log.loss:.4f}")
            if on_step is not None:
                on_step(log)
        result.steps = step
        if on_epoch_end is not None:
            metrics = on_epoch_end(epoch, core, _resumable_state(optimizer, scheduler, sharded))
            if metrics:
                result.epoch_metrics.append({"epoch": epoch, **metrics})
            model.train()
    result.seconds = time.perf_counter() - started
    if progress is not None:
        progress.close(f"{result.pairs_seen / max(result.seconds, 1e-9):.1f} pairs/s")
    result.optimizer_state = _resumable_state(optimizer, scheduler, sharded)
    return result


def _resumable_state(optimizer, scheduler, sharded: bool) -> dict:
    """What continues the run after this epoch, besides the weights: {"optimizer": its state_dict, "scheduler": ...}.
    A sharded (FSDP2) run's optimizer state is a shard per worker, saved with the weights by every worker at once
    (sharded.save_sharded): the optimizer itself, under "sharded_optimizer", instead of its state_dict."""
    if sharded:
        return {"sharded_optimizer": optimizer, "scheduler": scheduler.state_dict()}
    return {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}


def _device_type(model: torch.nn.Module) -> str:
    return next(model.parameters()).device.type


def _train_step(model, core, reference, train, targets, indices, layers, config, step, total_steps, pad_token_id) -> StepLog:
    n = len(indices)
    device = next(core.parameters()).device
    batch = collate([train.chosen[i] for i in indices] + [train.rejected[i] for i in indices], pad_token_id)
    batch = {k: v.to(device) for k, v in batch.items()}
    with autocast(config.precision, _device_type(core)), fp32_reward_head(core), \
            capture_hidden_states(core, layers) as states:
        outputs = reward_forward(model, batch)
    student_states = [states[i].float() for i in layers]
    rewards = outputs.logits[:, 0].float()
    margin = rewards[:n] - rewards[n:]
    q = targets[indices].to(device)
    if config.method == "gold":
        w2s = soft_bradley_terry_loss(margin, torch.ones_like(q))
    elif config.method == "confidence":
        w2s = confidence_w2s_loss(margin, q, confidence_alpha(step, total_steps, config.confidence_alpha))
    else:
        w2s = soft_bradley_terry_loss(margin, q)
    anchor = torch.zeros((), dtype=w2s.dtype, device=device)
    if layers:
        if isinstance(reference, ReferenceStates):
            reference_states = reference.batch(indices, layers, batch["anchor_mask"])
        else:  # the frozen copy, or (a LoRA student, reference None) the student with its adapters off
            frozen = core if reference is None else reference
            with torch.no_grad(), adapters_off(core) if reference is None else nullcontext(), \
                    autocast(config.precision, _device_type(core)), capture_hidden_states(frozen, layers) as captured:
                reward_forward(frozen, batch)
            reference_states = [captured[i].float() for i in layers]
        anchor = anchor_loss(student_states, reference_states, batch["anchor_mask"])
    loss = w2s + config.anchor_lambda * anchor if layers else w2s
    loss.backward()
    grad_norm = None
    if config.max_grad_norm:
        norm = torch.nn.utils.clip_grad_norm_(core.parameters(), config.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return StepLog(step=step, epoch=0, loss=loss.item(), w2s_loss=w2s.item(), anchor_loss=anchor.item(), learning_rate=0.0,
                   grad_norm=grad_norm)
