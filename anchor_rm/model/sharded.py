"""Sharding a student with FSDP2, loading it sharded, and its checkpoints.

Loading (`load_pretrained_sharded`), as torchtune does it: every worker builds the model on the meta device (no
memory), shards it, and rank 0 alone reads the pretrained weights (one copy in host RAM, not one per worker) and
broadcasts them a tensor at a time, each worker keeping its shard: a worker's GPU never holds the whole model.

Checkpoints, in torch.distributed.checkpoint's format: every worker writes its own
shard of the trained weights and of AdamW's state (rank 0 also writes the index, `.metadata`), and any number of
workers reads them back, each taking its part of the new layout: a run resumed on more or fewer workers
continues, and one process without a process group reads the whole weights (the export to an ordinary Hugging
Face folder, reward_model.load_saved).

A LoRA student's checkpoint holds only its trainable parameters, the adapters and the reward head
(`ignore_frozen_params`): the frozen base is the pretrained weights, which every reader loads from the base model
anyway (16 GB at 8B). A fully fine-tuned student's holds every parameter.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

SHARDED_FOLDER = "sharded"  # the DCP files inside a checkpoint folder


def shard_model(model: torch.nn.Module, precision: str, device_type: str) -> None:
    """FSDP2 in place: `fully_shard` on each transformer layer, then on the root, over the process group's
    workers (gloo on CPU, nccl on GPU), at any number of workers (one included: the same code path as eight).
    `model` may live on the meta device (load_pretrained_sharded). On a GPU in bf16, parameters are gathered in
    bf16 and gradients reduced in fp32; the sharded fp32 parameters stay the master copy. gloo's reduce-scatter
    may sum where it should average (pytorch#162338): the sum is forced and divided by the number of workers, on
    every backend alike."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from anchor_rm.model.loading import transformer_parts

    world = dist.get_world_size()
    mesh = init_device_mesh(device_type, (world,))  # explicit: on a machine with CUDA, CPU workers stay on CPU
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if device_type == "cuda" and precision == "bf16" else MixedPrecisionPolicy())
    _, layers, _ = transformer_parts(model, "strategy fsdp2")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(float(world))


def load_pretrained_sharded(name: str, device: torch.device | str, *, precision: str, seed: int = 0,
                            lora_rank: int = 0, lora_alpha: float = 16.0, bf16_base: bool = False) -> torch.nn.Module:
    """The pretrained reward model of `name`, sharded over the process group's workers on `device`, equal to what
    `load_reward_model` (with `seed`'s head, and adapters when `lora_rank`) gives in one process. Every worker
    calls it. The order is what keeps memory down: meta model -> adapters -> shard -> rank 0 reads the weights
    into host RAM and broadcasts them one tensor at a time (set_model_state_dict, broadcast_from_rank0) -> the
    buffers computed at construction (a decoder's rotary inv_freq, in no state dict) broadcast from rank 0 too.
    Peak on each GPU: its shard plus the tensor in transit (memory_plan counts it as `loading`)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from anchor_rm.model.loading import load_reward_model, resolve_model, reward_model_on_meta
    from anchor_rm.model.lora import add_adapters, hold_frozen_base_in

    device = torch.device(device)
    source = resolve_model(name)

    def prepared(model):
        model = add_adapters(model, lora_rank, lora_alpha) if lora_rank else model
        if bf16_base:
            hold_frozen_base_in(model, torch.bfloat16)
        return model

    model = prepared(reward_model_on_meta(source))
    shard_model(model, precision, device.type)
    full, computed = {}, None
    if dist.get_rank() == 0:
        torch.manual_seed(seed)  # the head (and adapters) initialised as load_pretrained initialises them
        whole = prepared(load_reward_model(source))
        full = whole.state_dict()
        computed = {key: buffer for key, buffer in whole.named_buffers() if key not in full}
        del whole
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    box = [computed]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    for buffer_name, value in box[0].items():
        owner_name, _, attribute = buffer_name.rpartition(".")
        model.get_submodule(owner_name)._buffers[attribute] = value.to(device)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"{name}: {len(still_meta)} tensors were not loaded onto {device}: {still_meta[:5]}")
    return model
_BUFFERS = ("rotary_emb.inv_freq",)  # non-persistent buffers some state dicts list: not weights


def _options(model: torch.nn.Module, **more):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from anchor_rm.model.lora import is_adapted

    return StateDictOptions(ignore_frozen_params=is_adapted(model), **more)


def save_sharded(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Every worker of the run calls this with its own (possibly local, per-worker) `folder`: its shard of the
    trainable weights and of the optimizer's state go into folder/sharded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    target = Path(folder) / SHARDED_FOLDER
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options(model))
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(target))
    return target


def load_sharded(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """The weights (and, given `optimizer`, its state) saved by `save_sharded` into `model`, sharded or not: every
    worker of a sharded run calls it after `fully_shard` and building the optimizer; one process without a
    process group reads the weights whole. `folder` is the checkpoint folder (holding sharded/)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    source = Path(folder) / SHARDED_FOLDER
    if not (source / ".metadata").is_file():
        raise ValueError(f"{folder}: no sharded checkpoint here ({SHARDED_FOLDER}/.metadata is missing)")
    alone = not (dist.is_available() and dist.is_initialized())
    options = _options(model)
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=options)}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
        state = {"model": model_state, "optimizer": optimizer_state}
    with warnings.catch_warnings():
        # one process reads the whole checkpoint, as asked (no_dist); torch says so in a warning all the same
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, checkpoint_id=str(source), no_dist=alone)
    # A LoRA student's frozen base is in neither the checkpoint nor `state`: loaded non-strict, then checked.
    loading = _options(model, strict=False)
    if optimizer is None:
        result = set_model_state_dict(model, state["model"], options=loading)
    else:
        result = set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                                options=loading)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    missing = [k for k in result.missing_keys if k not in frozen and not k.endswith(_BUFFERS)]
    if missing or result.unexpected_keys:
        raise ValueError(f"{source}: the checkpoint does not match the model: missing {missing[:5]}, "
                         f"unexpected {list(result.unexpected_keys)[:5]}")


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model`'s parameters are sharded over workers (FSDP2's DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
