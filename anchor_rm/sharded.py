"""Checkpoints of a sharded (FSDP2) run, in torch.distributed.checkpoint's format: every worker writes its own
shard of the trained weights and of AdamW's state (rank 0 also writes the index, `.metadata`), and any number of
workers reads them back, each taking its part of the new layout: a run resumed on more or fewer workers
continues, and one process without a process group reads the whole weights (the export to an ordinary Hugging
Face folder, workflow.load_saved).

A LoRA student's checkpoint holds only its trainable parameters, the adapters and the reward head
(`ignore_frozen_params`): the frozen base is the pretrained weights, which every reader loads from the base model
anyway (16 GB at 8B). A fully fine-tuned student's holds every parameter.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

SHARDED_FOLDER = "sharded"  # the DCP files inside a checkpoint folder
_BUFFERS = ("rotary_emb.inv_freq",)  # non-persistent buffers some state dicts list: not weights


def _options(model: torch.nn.Module, **more):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from anchor_rm.lora import is_adapted

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
