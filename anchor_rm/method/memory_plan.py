"""A memory plan before anything trains: peak memory per worker estimated from the model's config, the strategy,
LoRA, the batch and the sequence length, against what each worker has; a run that will not fit is refused in one
line (the estimate, the limit, what to change) instead of dying of out-of-memory an hour in.

The estimate, per worker, in bytes:
- weights: 4 per parameter (fp32: the loaders load fp32; bf16 autocast computes in bf16 but keeps fp32
  masters), divided by the workers under FSDP2, plus the two layers it gathers at once (one computing, one
  prefetched); a LoRA student in bf16 holds its frozen base's Linear weights in 2 (lora.hold_frozen_base_in);
- gradients and AdamW state: 4 + 8 per *trainable* parameter (LoRA: adapters and head), divided likewise; DDP
  keeps a bucketed copy of the gradients (4 more) when there is more than one worker;
- ANCHOR's frozen reference: a second copy of the weights (sharded under FSDP2) for full fine-tuning; none for
  a LoRA student (its adapters switched off) or a cached reference (the states live beside, measured apart);
- activations: what backward needs per token and layer, ACTIVATION_VALUES x (hidden, MLP width, attention
  scores) values, at 4 bytes (fp32) or BF16_ACTIVATION_BYTES (autocast keeps some in fp32); with activation
  checkpointing, one hidden state per layer and one layer's activations;
- a fixed overhead (the framework, the CUDA context);
- loading, which may peak above training: on CPU, where the weights load into the same memory, two copies of the
  weights while transformers reads the checkpoint (and the reference's); on a GPU under FSDP2 (loaded sharded:
  sharded.load_pretrained_sharded) each worker's shard plus the largest tensor in transit, twice (the full
  tensor broadcast and its shard). The peak is the larger of the two. `host_loading` is the host RAM a worker
  needs while loading for a GPU: two fp32 copies per DDP worker; for FSDP2 rank 0's alone, the other workers
  none (check_protocol_memory holds it against the machine's memory, a container's limit included).
The constants are fitted to peaks measured on CPU (bench/memory_plan.py, docs/scaling.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

STRATEGIES = ("ddp", "fsdp2")
GIB = 2**30

# Values kept for backward per token and layer: a x hidden + b x MLP width (+ c x MLP width for a gated MLP) +
# d x heads x sequence length (the attention probabilities of the math attention path).
ACTIVATION_VALUES = {"hidden": 10, "mlp": 2, "gated_mlp": 2, "scores": 2}
BF16_ACTIVATION_BYTES = 3  # bf16 autocast: matmul outputs in bf16, norms and residuals in fp32
OVERHEAD_BYTES = {"cpu": int(0.8 * GIB), "cuda": int(1.5 * GIB)}  # the process (and the CUDA context)


class MemoryPlanError(ValueError):
    """A plan that will not fit: its one line says the estimate, the limit and what to change."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model's architecture."""

    parameters: int
    layer_parameters: int  # one transformer layer's
    layers: int
    hidden: int
    mlp: int  # the MLP's inner width
    heads: int
    gated_mlp: bool  # Llama's SwiGLU: two up projections
    linear_shapes: tuple[tuple[int, int, int], ...]  # (in, out, count) of the linear layers LoRA adapts
    largest_tensor: int = 0  # the most values one parameter holds (the embeddings, usually)

    def lora_parameters(self, rank: int) -> int:
        return sum(rank * (i + o) * n for i, o, n in self.linear_shapes)

    @property
    def linear_parameters(self) -> int:
        """The weights of the Linear layers LoRA adapts (the frozen base a LoRA student may hold in bf16)."""
        return sum(i * o * n for i, o, n in self.linear_shapes)


def model_shape(config) -> ModelShape:
    """The shape of a transformers config's sequence-classification model, counted on the meta device (no
    memory, no weights: the paper's 8B models plan offline from their config alone)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    config.num_labels = 1
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    from anchor_rm.model.loading import transformer_parts

    _, layers, _ = transformer_parts(model, "memory plan")
    shapes: dict[tuple[int, int], int] = {}
    head = {id(m) for m in (getattr(model, "score", None), getattr(model, "classifier", None)) if m is not None}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module) not in head:
            key = (module.in_features, module.out_features)
            shapes[key] = shapes.get(key, 0) + 1
    mlp = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    return ModelShape(
        parameters=sum(p.numel() for p in model.parameters()),
        layer_parameters=sum(p.numel() for p in layers[0].parameters()),
        layers=len(layers), hidden=config.hidden_size, mlp=mlp, heads=config.num_attention_heads,
        gated_mlp=has_gated_mlp(model),
        linear_shapes=tuple((i, o, n) for (i, o), n in sorted(shapes.items())),
        largest_tensor=max(p.numel() for p in model.parameters()),
    )


# A gated MLP's gate projection: its own Linear (Llama, Qwen, Mistral, Gemma 1-3) or fused with the up projection
# (Phi-3's Linear, Mixtral's experts' parameter). Mixtral's router, named `gate`, is not one.
GATE_NAMES = ("gate_proj", "gate_up_proj")


def has_gated_mlp(model) -> bool:
    """Whether the model's MLP is gated (SwiGLU, GeGLU: a third projection), read off its modules and parameters
    rather than a list of model types."""
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    return any(name.rsplit(".", 1)[-1] in GATE_NAMES for name in names)


@dataclass(frozen=True)
class MemoryPlan:
    device: str  # cpu | cuda
    strategy: str
    workers: int
    sequences_per_worker: int  # chosen and rejected: two per pair
    max_length: int
    activation_checkpointing: bool
    parameters: int
    trainable_parameters: int
    weights: int  # bytes per worker, as each field below
    gradients: int
    optimizer: int
    reference: int
    activations: int
    overhead: int
    loading: int  # the peak while loading the weights on the device, beside the overhead
    host_loading: int = 0  # host RAM a worker needs while loading for a GPU (0 on CPU: `loading` is that memory)

    @property
    def total(self) -> int:
        training = self.weights + self.gradients + self.optimizer + self.reference + self.activations
        return self.overhead + max(training, self.loading)

    def summary(self) -> str:
        parts = ", ".join(f"{name} {getattr(self, name) / GIB:.2f}" for name in
                          ("weights", "gradients", "optimizer", "reference", "activations", "overhead", "loading"))
        host = f"; host RAM while loading {self.host_loading / GIB:.2f} GiB" if self.host_loading else ""
        return (f"{self.total / GIB:.2f} GiB per worker ({parts} GiB); {self.strategy} on {self.workers} "
                f"{self.device} worker(s), {self.sequences_per_worker} sequences x {self.max_length} tokens per worker, "
                f"{self.trainable_parameters:,} of {self.parameters:,} parameters trained{host}")

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def plan_memory(shape: ModelShape, *, batch_size: int, max_length: int, lora_rank: int = 0, anchor: bool = False,
                cached_reference: bool = False, activation_checkpointing: bool = False, strategy: str = "ddp",
                workers: int = 1, device: str = "cpu", precision: str = "fp32") -> MemoryPlan:
    # A LoRA student in bf16 holds its frozen base's Linear weights in bf16 (stages.load_student).
    """The estimated peak memory of one worker (see the module's docstring). `batch_size` is pairs per optimiser
    step over all workers, as TrainConfig has it."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if workers < 1 or batch_size < 1 or max_length < 1:
        raise ValueError(f"workers, batch_size and max_length must be >= 1, got {workers}, {batch_size}, {max_length}")
    shard = workers if strategy == "fsdp2" else 1
    trainable = (shape.lora_parameters(lora_rank) + shape.hidden) if lora_rank else shape.parameters
    gathered = 2 * 4 * shape.layer_parameters if strategy == "fsdp2" and workers > 1 else 0
    base_bytes = 4 * shape.parameters - (2 * shape.linear_parameters if lora_rank and precision == "bf16" else 0)
    weights = base_bytes // shard + gathered
    gradients = 4 * trainable // shard + (4 * trainable if strategy == "ddp" and workers > 1 else 0)
    optimizer = 8 * trainable // shard
    reference = 4 * shape.parameters // shard if anchor and not lora_rank and not cached_reference else 0
    sequences = 2 * math.ceil(batch_size / workers)
    tokens = sequences * max_length
    # The attention probabilities are kept by the math attention of CPUs; GPUs' fused attention keeps none.
    per_token_layer = (ACTIVATION_VALUES["hidden"] * shape.hidden + ACTIVATION_VALUES["mlp"] * shape.mlp
                       + (ACTIVATION_VALUES["gated_mlp"] * shape.mlp if shape.gated_mlp else 0)
                       + (ACTIVATION_VALUES["scores"] * shape.heads * max_length if device == "cpu" else 0))
    value_bytes = BF16_ACTIVATION_BYTES if precision == "bf16" else 4
    if activation_checkpointing:
        activations = tokens * (shape.layers * shape.hidden * 4 + per_token_layer * value_bytes)
    else:
        activations = tokens * shape.layers * per_token_layer * value_bytes
    return MemoryPlan(device=device, strategy=strategy, workers=workers, sequences_per_worker=sequences,
                      max_length=max_length, activation_checkpointing=activation_checkpointing,
                      parameters=shape.parameters, trainable_parameters=trainable,
                      weights=weights, gradients=gradients, optimizer=optimizer, reference=reference,
                      activations=int(activations), overhead=OVERHEAD_BYTES[device],
                      loading=_loading(shape, base_bytes, reference, shard, device),
                      host_loading=0 if device == "cpu" else 2 * 4 * shape.parameters)


def _loading(shape: ModelShape, base_bytes: int, reference: int, shard: int, device: str) -> int:
    """The device's peak while the weights load (module docstring)."""
    if device == "cpu":
        return 2 * (4 * shape.parameters + reference)
    if shard > 1:  # loaded sharded: the shards, and one tensor broadcast whole and cut (twice its size)
        return base_bytes // shard + reference + 2 * 4 * shape.largest_tensor
    return base_bytes + reference  # loaded on the CPU, moved: never more than it then holds


def check_plan(plan: MemoryPlan, limit_bytes: int | None, where: str, shardable: bool = True) -> None:
    """Refuses a plan over `limit_bytes` (what one worker has on `where`) in one line: the estimate, the limit, and
    what to change. No limit known: nothing to check."""
    if limit_bytes is None or plan.total <= limit_bytes:
        return
    advice = []
    if not plan.trainable_parameters < plan.parameters:
        advice.append("train LoRA adapters (--lora-rank 16)")
    if plan.strategy == "ddp" and shardable:
        advice.append("shard over more workers (--strategy fsdp2 --workers-per-trial N)")
    if plan.activations > plan.total // 4:
        advice.append(("" if plan.activation_checkpointing else "--activation-checkpointing, ")
                      + "a smaller batch or --max-length")
    raise MemoryPlanError(f"will not fit: about {plan.total / GIB:.1f} GiB per worker estimated against "
                          f"{limit_bytes / GIB:.1f} GiB on {where}; " + "; or ".join(advice or ["use a larger device"]))


def physical_memory_bytes(cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """This machine's memory, or the container's limit where that is lower (a Kubernetes pod, KubeRay's workers:
    the kernel kills the pod at its limit, whatever the host has)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = None
    limit = cgroup_memory_limit(cgroup_root)
    if limit is None or (physical is not None and physical <= limit):
        return physical
    return limit


def cgroup_memory_limit(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The memory limit of this process's cgroup, v2 (`memory.max`) or v1 (`memory/memory.limit_in_bytes`), at the
    cgroup root a container sees and at this process's own cgroup path under it; the lowest one set. None where
    no limit is set ("max", or v1's near-2^63 "unlimited") or none can be read."""
    from pathlib import Path

    paths = [""]
    try:
        for line in Path(self_cgroup).read_text().splitlines():
            hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
            if path.strip("/") and (hierarchy == "0" or "memory" in controllers.split(",")):
                paths.append(path.strip("/"))
    except OSError:
        pass
    limits = []
    for sub in paths:
        for name in ("memory.max", "memory/memory.limit_in_bytes"):
            folder, _, file = name.rpartition("/")
            candidate = Path(root, folder, sub, file) if folder else Path(root, sub, file)
            try:
                text = candidate.read_text().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < 2**60:
                limits.append(int(text))
    return min(limits) if limits else None


def worker_memory_limit(device: str, workers_per_machine: int) -> tuple[int | None, str]:
    """(bytes one worker may use, where): a GPU's memory (the first one's: every worker gets one), or this
    machine's physical memory shared by the workers that run on it. None where it cannot be told."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None, "a GPU this machine does not have"
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"{props.name} ({props.total_memory / GIB:.0f} GiB)"
    total = physical_memory_bytes()
    if total is None:
        return None, "this machine"
    return total // max(1, workers_per_machine), (f"this machine's {total / GIB:.0f} GiB shared by "
                                                  f"{workers_per_machine} worker(s)")


def planned_precision(cfg, device: str, requested: str = "auto") -> str:
    """The precision a plan for `device` assumes: the experiment's (resolved for the driver's device) on a CPU or
    the GPU this machine has; for GPUs this machine lacks (a cluster planned from elsewhere), bf16 where `auto` is
    asked (every GPU of the paper's setting, A100 and later, computes it natively)."""
    if device != "cuda" or requested != "auto":
        return cfg.precision if device != "cuda" else ("bf16" if requested == "bf16" else "fp32")
    if _has_cuda():
        from anchor_rm.model.precision import resolve_precision

        return resolve_precision("auto", "cuda")
    return "bf16"


def protocol_plans(cfg, *, strategy: str = "ddp", workers: int = 1, device: str = "cpu",
                   anchor_layer_choices: tuple | None = None, precision: str | None = None) -> dict[str, MemoryPlan]:
    """The teacher's and the student's plans for a ProtocolConfig, and the ceiling's where it differs from the
    student's: the ceiling trains in the driver's process, unsharded (experiment.prepare_shared), so a sharded
    student's ceiling is planned as one worker. Settings the model's config refuses (a max length over its
    positions, frozen layers over anchored ones: the student's own anchor layers, or every choice of a search,
    `anchor_layer_choices`) are ValueErrors here, before anything trains."""
    from anchor_rm.method.losses import check_layer_settings
    from anchor_rm.model.loading import check_max_length, load_model_config

    plans = {}
    for role, name, train in (("teacher", cfg.teacher, cfg.teacher_train), ("student", cfg.student, cfg.student_train)):
        # the teacher trains in the driver's process, the students as `workers` Ray Train workers
        config = load_model_config(name)
        check_max_length(config, train.max_length, name)
        if role == "student":
            specs = anchor_layer_choices if anchor_layer_choices is not None else (
                [train.anchor_layers] if train.uses_anchor else [])
            check_layer_settings(train.frozen_layers, specs, config.num_hidden_layers)
        plans[role] = plan_memory(model_shape(config), batch_size=train.batch_size,
                                  max_length=train.max_length, lora_rank=train.lora_rank, anchor=train.uses_anchor,
                                  activation_checkpointing=train.activation_checkpointing,
                                  strategy=strategy if role == "student" else "ddp",
                                  workers=workers if role == "student" else 1, device=device,
                                  precision=precision or cfg.precision)
        if role == "student" and cfg.train_ceiling and strategy == "fsdp2":
            plans["ceiling"] = plan_memory(model_shape(config), batch_size=train.batch_size, max_length=train.max_length,
                                           lora_rank=train.lora_rank, activation_checkpointing=train.activation_checkpointing,
                                           device=device, precision=precision or cfg.precision)
    return plans


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_protocol_memory(cfg, *, strategy: str = "ddp", workers: int = 1, device: str = "cpu",
                          workers_per_machine: int = 1, worker_memory: int | None = None, log=None,
                          anchor_layer_choices: tuple | None = None, precision: str | None = None) -> dict[str, MemoryPlan]:
    """Plans the teacher and the students, logs each plan, and refuses (MemoryPlanError) the first that will not
    fit in what one worker has: `worker_memory` bytes where given, else worker_memory_limit's."""
    plans = protocol_plans(cfg, strategy=strategy, workers=workers, device=device, anchor_layer_choices=anchor_layer_choices,
                           precision=precision)
    limit, where = ((worker_memory, "each worker (as given)") if worker_memory
                    else worker_memory_limit(device, workers_per_machine))
    # Host RAM is this machine's: checked where the plan is for this machine's own GPUs, not for a cluster planned
    # from a laptop (--dry-run of the paper preset).
    host = physical_memory_bytes() if device == "cpu" or _has_cuda() else None
    for role, plan in plans.items():
        if log is not None:
            log.info("memory plan of the %s: %s", role, plan.summary())
        # the ceiling trains in the driver's one process: it cannot be sharded
        check_plan(plan, limit, f"{where}, for the {role}" + (" (it trains in the driver's process, unsharded)"
                                                              if role == "ceiling" else ""), shardable=role != "ceiling")
        # Loading for GPUs passes through host RAM: every DDP worker of the machine at once, rank 0 alone under FSDP2.
        loaders = 1 if plan.strategy == "fsdp2" or role == "teacher" else workers_per_machine
        if plan.host_loading and host is not None and plan.host_loading * loaders > host:
            raise MemoryPlanError(f"will not fit: loading the {role} for the GPUs takes about "
                                  f"{plan.host_loading * loaders / GIB:.1f} GiB of host RAM ({loaders} worker(s) reading "
                                  f"fp32 weights) against this machine's {host / GIB:.1f} GiB (its container's limit where "
                                  f"lower); shard it (--strategy fsdp2: rank 0 reads it alone) or use a larger machine")
    return plans
