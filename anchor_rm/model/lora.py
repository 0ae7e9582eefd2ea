"""LoRA students (peft): low-rank adapters on every linear layer of the pretrained model, the scalar reward head
trained in full. The adapters start at zero (peft initialises B = 0), so the adapted model *is* the pretrained
model at step 0, and ANCHOR's frozen reference is that same model with its adapters switched off
(`adapters_off`): no second copy of the weights and no cache of its states, which is what makes ANCHOR
affordable at 7-8B (docs/scaling.md). TRL's DPO and torchtune's LoRA recipes take their reference the same way.

A trained LoRA student is saved as one ordinary Hugging Face folder with the adapters merged in (what
evaluation, the registry and the service load) and the adapters themselves under `adapter/` (what a resumed run
continues from, and what a user loads on the base model with peft).
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

ADAPTER_FOLDER = "adapter"


def add_adapters(model: torch.nn.Module, rank: int, alpha: float) -> torch.nn.Module:
    """`model` (an AutoModelForSequenceClassification) with LoRA adapters of `rank` on every linear layer but the
    reward head, which peft trains in full (a copy, `modules_to_save`). The adapters are injected into `model`'s
    own modules; the returned peft wrapper is what training, saving and `adapters_off` take."""
    from peft import LoraConfig, TaskType, get_peft_model

    if rank < 1:
        raise ValueError(f"lora_rank must be >= 1 to add adapters, got {rank}")
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=rank, lora_alpha=alpha, lora_dropout=0.0,
                        target_modules="all-linear")
    with _quiet():
        return get_peft_model(model, config)


@contextmanager
def _quiet():
    # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model: a FutureWarning
    # in every run's output that says nothing about the run.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft wrapper with adapters (without importing peft for a plain model)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


@contextmanager
def adapters_off(model: torch.nn.Module):
    """The pretrained model: `model`'s adapters (and its trained head copy) switched off inside the block. Call it
    under torch.no_grad() and outside the student's forward pass (activation checkpointing recomputes that pass
    during backward and would not see the switch, peft#2832)."""
    with model.disable_adapter():
        yield


def adapter_parameter(name: str) -> bool:
    """Whether a parameter of an adapted model is a LoRA adapter weight (not the fully trained head)."""
    return ".lora_" in name


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain transformers model with the adapters merged into its weights; `model` is left as it was. For a
    model held in fp32 on the CPU (a loaded checkpoint, a CPU run); a trained student elsewhere is merged by
    reward_model.save_reward_model from its saved adapters, on the CPU."""
    return copy.deepcopy(model).merge_and_unload()


def frozen_base_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The pretrained Linear layers under the adapters (peft's `base_layer`s): frozen, and most of the weights."""
    return [m.base_layer for m in model.modules() if isinstance(getattr(m, "base_layer", None), torch.nn.Linear)]


def hold_frozen_base_in(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Holds the frozen base's Linear weights in `dtype` (bf16 where the device computes it natively): half the
    memory of fp32 (about 15 GB instead of 28 for an 8B student), and bf16 autocast no longer casts every frozen
    weight on every forward pass. The values the matmuls see are the same (autocast rounds fp32 to bf16 the same
    way). The adapters, the reward head, the embeddings and the norms stay fp32: what trains keeps fp32 master
    weights, and the residual stream its fp32 path. Returns how many Linears were cast."""
    layers = frozen_base_linears(model)
    for layer in layers:
        layer.to(dtype)
    return len(layers)


def save_adapters(model: torch.nn.Module, folder: str | Path) -> Path:
    """The adapters and the trained head, as peft saves them (adapter_config.json, adapter_model.safetensors)."""
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def load_adapters(base: torch.nn.Module, folder: str | Path) -> torch.nn.Module:
    """`base` (the pretrained model) with the adapters saved under `folder`, trainable: a resumed run."""
    from peft import PeftModel

    with _quiet():
        return PeftModel.from_pretrained(base, str(folder), is_trainable=True)


def adapter_summary(model: torch.nn.Module) -> dict[str, int]:
    """Trainable and total parameters: what LoRA saves in gradients and optimiser state."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable_parameters": trainable, "total_parameters": total}
