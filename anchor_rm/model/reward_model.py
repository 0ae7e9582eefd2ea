"""A reward model with the tokenizer and encoder that score it (`RewardModel`): loaded pretrained (a fresh scalar
head, LoRA adapters when asked) or from a saved folder, saved with anchor_rm.json beside the weights, and exported
whole from a training checkpoint. The unit that training, evaluation, the registry and the service load."""

from __future__ import annotations

import gc
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from anchor_rm.data.records import PreferencePair
from anchor_rm.model.encoding import RewardEncoder
from anchor_rm.model.loading import (SCORER_CONFIG, ModelSource, check_max_length, is_decoder, load_reward_model,
                                     load_tokenizer, resolve_model, reward_model_on_meta)
from anchor_rm.model.lora import ADAPTER_FOLDER, add_adapters, is_adapted, load_adapters, merged_copy, save_adapters
from anchor_rm.model.ood_flag import DensityFit, load_density
from anchor_rm.model.precision import driver_device_type
from anchor_rm.model.scoring import EncodedPairs, RewardScorer, encode_pairs
from anchor_rm.model.sharded import SHARDED_FOLDER, is_sharded, load_sharded


log = logging.getLogger("anchor_rm")


@dataclass
class RewardModel:
    """A reward model with the tokenizer and encoder that score it: the unit evaluation and serving load."""

    model: torch.nn.Module
    tokenizer: object
    encoder: RewardEncoder
    name: str
    density: DensityFit | None = None  # the OOD flag's fit (fit_ood_flag), saved and loaded with the model

    def scorer(self, batch_size: int = 32, precision: str = "auto", max_tokens: int | None = None,
               ood_flag: bool = True) -> RewardScorer:
        """`ood_flag`: score with the model's density, where it has one (False: rewards alone)."""
        return RewardScorer(self.model, self.encoder, batch_size, precision, max_tokens,
                            self.density if ood_flag else None)

    def encode(self, pairs: Sequence[PreferencePair]) -> EncodedPairs:
        return encode_pairs(self.encoder, pairs)


def load_pretrained(name: str, max_length: int, seed: int, *, lora_rank: int = 0, lora_alpha: float = 16.0,
                    adapters: str | Path | None = None, meta: bool = False) -> RewardModel:
    """Pretrained weights with a fresh scalar head; the seed fixes the head's initialisation (and the adapters'
    with `lora_rank` > 0: a LoRA student, anchor_rm/model/lora.py). `adapters`: a saved adapter folder to put on the
    pretrained base instead of fresh ones (a LoRA student resumed from its checkpoint). `meta`: the model's
    structure alone, on the meta device, no weights read: what encoding and sizing need (the reference cache's
    plan), not 32 GB of host memory for an 8B model."""
    source: ModelSource = resolve_model(name)
    torch.manual_seed(seed)
    model = reward_model_on_meta(source) if meta else load_reward_model(source)
    check_max_length(model.config, max_length, source.name)
    tokenizer = load_tokenizer(source)
    encoder = RewardEncoder(tokenizer, max_length, is_decoder(model))
    if adapters is not None:
        model = load_adapters(model, adapters)
    elif lora_rank:
        model = add_adapters(model, lora_rank, lora_alpha)
    return RewardModel(model, tokenizer, encoder, source.name)


def training_device() -> str:
    """Where the driver's own training and scoring run (the teacher, the ceiling, train.py's and the study's
    students, the reference cache, the final evaluation): its first GPU when it has one, else its CPU."""
    return driver_device_type()


def release_device_memory() -> None:
    """Hands what this process's CUDA caching allocator holds back to the GPU, once its models are gone: the
    driver trains the teacher and the ceiling and computes the reference cache on its first GPU, which Ray then
    gives to a trial. What it keeps after this is its CUDA context (logged). Nothing to do without CUDA."""
    gc.collect()
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    torch.cuda.empty_cache()
    log.info("driver GPU memory after its own stages: %.0f MiB allocated, %.0f MiB reserved (besides its CUDA "
             "context)", torch.cuda.memory_allocated() / 2**20, torch.cuda.memory_reserved() / 2**20)


def save_reward_model(rm: RewardModel, folder: str | Path, extra: dict | None = None, *,
                      adapters_only: bool = False) -> Path:
    """A standard transformers checkpoint plus anchor_rm.json (max length), loadable by `load_saved`.

    - A LoRA student: the merged model is the folder (merged once, on the CPU, from a fresh fp32 base and the
      saved adapters: merged_on_cpu) and the adapters go under adapter/. With `adapters_only` (a training
      checkpoint: every epoch of a trial), only the adapters and the trained head: a few MB instead of the whole
      model, which `load_saved` merges when it is read whole and a resumed run continues from.
    - A model sharded over workers (FSDP2) is not gathered: this writes what reads its shards (the config, the
      tokenizer, anchor_rm.json naming the base model and sharded/), and every worker writes its own shard beside
      it (sharded.save_sharded). `load_saved` reads such a folder in one process; `export_checkpoint` makes it an
      ordinary one."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    info = {"max_length": rm.encoder.max_length, "decoder": rm.encoder.decoder, "base_model": rm.name, **(extra or {})}
    adapted = is_adapted(rm.model)
    if adapted:
        lora = rm.model.peft_config["default"]
        info["lora"] = {"rank": lora.r, "alpha": lora.lora_alpha, "adapter": ADAPTER_FOLDER}
    if is_sharded(rm.model):
        rm.model.config.save_pretrained(folder)
        info["sharded"] = SHARDED_FOLDER
    elif adapted:
        save_adapters(rm.model, folder / ADAPTER_FOLDER)
        if adapters_only:
            rm.model.config.save_pretrained(folder)
            info["adapters_only"] = True
        else:
            merged_on_cpu(rm.model, rm.name, folder / ADAPTER_FOLDER).save_pretrained(folder)
    else:
        rm.model.save_pretrained(folder)
    rm.tokenizer.save_pretrained(folder)
    if rm.density is not None:
        rm.density.save(folder)
    (folder / SCORER_CONFIG).write_text(json.dumps(info, indent=2))
    return folder


def merged_on_cpu(model: torch.nn.Module, base_name: str, adapter_folder: Path) -> torch.nn.Module:
    """A LoRA student's adapters merged into its pretrained weights, in fp32 on the CPU: `model` itself where it is
    held that way (a copy is merged), else a fresh fp32 base read from `base_name` with the adapters saved in
    `adapter_folder` (a student trained on a GPU, its base held in bf16: its own weights are neither fp32 nor on
    the CPU, and a copy would double its memory on the device)."""
    held = [p for p in model.parameters()]
    if all(p.device.type == "cpu" and p.dtype == torch.float32 for p in held):
        return merged_copy(model)
    base = load_reward_model(resolve_model(base_name))
    return load_adapters(base, adapter_folder).merge_and_unload()


def load_saved(folder: str | Path, max_length: int | None = None, *, adapters: bool = False,
               device: str | torch.device = "cpu") -> RewardModel:
    """A saved reward model on `device`, as an ordinary transformers model (a LoRA student's merged weights).
    `adapters`: a LoRA student as it trains, its base model's pretrained weights with the saved adapters on (a
    resumed run). A sharded (FSDP2) checkpoint is read whole here, in one process: the base model's pretrained
    weights (with adapters, for LoRA) and the trained ones from its shards; a LoRA training checkpoint (adapters
    only) is its base model's pretrained weights with the adapters on, merged unless `adapters`."""
    folder = Path(folder)
    info_path = folder / SCORER_CONFIG
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    source = resolve_model(str(folder))
    tokenizer = load_tokenizer(source)
    length = max_length or info.get("max_length") or min(512, getattr(tokenizer, "model_max_length", 512))
    if adapters and "lora" not in info:
        raise ValueError(f"{folder}: no LoRA adapters saved here ({SCORER_CONFIG} names none)")
    if info.get("sharded"):
        model = load_reward_model(resolve_model(info["base_model"]))
        if "lora" in info:
            model = add_adapters(model, info["lora"]["rank"], info["lora"]["alpha"])
        load_sharded(folder, model)
        if not adapters:
            model = (merged_copy(model) if "lora" in info else model).eval()
    elif adapters or info.get("adapters_only"):
        model = load_reward_model(resolve_model(info["base_model"]))
        model = load_adapters(model, folder / info["lora"]["adapter"])
        if not adapters:
            model = model.merge_and_unload().eval()
    else:
        model = load_reward_model(source, dropout=None).eval()
    check_max_length(model.config, int(length), str(folder))
    density = load_density(folder)
    if density is not None and density.dimensions != model.config.hidden_size:  # else every request would fail
        raise ValueError(f"{folder}: the OOD flag's fit has {density.dimensions} dimensions, the model's states "
                         f"{model.config.hidden_size}: the fit belongs to another model")
    model.to(device)
    return RewardModel(model, tokenizer, RewardEncoder(tokenizer, int(length), is_decoder(model)),
                       info.get("base_model", str(folder)), density)


def export_checkpoint(folder: str | Path) -> Path:
    """A training checkpoint folder made an ordinary Hugging Face one in place, as `save_reward_model` writes it
    for a trained model (a LoRA student: merged weights, adapters under adapter/): what the registry and the
    service take. A sharded (FSDP2) checkpoint's shards are read whole; a LoRA checkpoint's adapters are merged
    into the pretrained base, once, on the CPU. Files beside the model (a training state) stay; an ordinary folder
    is left as it is."""
    folder = Path(folder)
    info = json.loads((folder / SCORER_CONFIG).read_text()) if (folder / SCORER_CONFIG).exists() else {}
    if not (info.get("sharded") or info.get("adapters_only")):
        return folder
    rm = load_saved(folder, adapters="lora" in info)
    kept = {k: v for k, v in info.items()
            if k not in ("max_length", "decoder", "base_model", "sharded", "lora", "adapters_only")}
    save_reward_model(rm, folder, kept)  # anchor_rm.json last: until then the folder still reads as a checkpoint
    if info.get("sharded"):
        shutil.rmtree(folder / SHARDED_FOLDER)
    return folder
