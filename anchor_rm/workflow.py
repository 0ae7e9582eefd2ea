"""The stages of the protocol as plain functions: load a reward model, train it, label with the teacher,
evaluate on every split. MLflow and Ray wrap these; nothing here reaches for them."""

from __future__ import annotations

import gc
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from anchor_rm.data import PreferencePair
from anchor_rm.encoding import RewardEncoder
from anchor_rm.lora import (ADAPTER_FOLDER, add_adapters, hold_frozen_base_in, is_adapted, load_adapters, merged_copy,
                            save_adapters)
from anchor_rm.losses import resolve_anchor_layers
from anchor_rm.reference_cache import (ReferenceStates, choose_reference_cache, compute_reference_states,
                                      default_budget_bytes, disk_free_bytes, estimate_reference_nbytes, storage_dtype)
from anchor_rm.metrics import pairwise_accuracy, tie_rate
from anchor_rm.models import (SCORER_CONFIG, ModelSource, check_max_length, is_decoder, load_reward_model, load_tokenizer,
                              resolve_model, reward_model_on_meta)
from anchor_rm.precision import driver_device_type, uses_bf16
from anchor_rm.ood_flag import DensityFit, FlaggedSet, fit_density, load_density
from anchor_rm.report import SplitResult
from anchor_rm.scoring import EncodedPairs, HiddenStatesHook, RewardScorer, encode_pairs
from anchor_rm.sharded import SHARDED_FOLDER, is_sharded, load_pretrained_sharded, load_sharded
from anchor_rm.splits import ProtocolSplits
from anchor_rm.training import StepLog, TrainConfig, TrainResult, train_reward_model

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
    with `lora_rank` > 0: a LoRA student, anchor_rm/lora.py). `adapters`: a saved adapter folder to put on the
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


@dataclass(frozen=True)
class SplitScore:
    accuracy: float  # points
    n_pairs: int
    tie_rate: float  # points
    identical_after_truncation: int
    # One character per evaluated pair, in order: "1" where the chosen response scored strictly above the
    # rejected one. What a paired bootstrap over pairs resamples (study_report); None in scores stored
    # before it was kept.
    correct: str | None = None


def evaluate_pairs(rm: RewardModel, pairs: Sequence[PreferencePair], batch_size: int = 32, *, precision: str = "auto",
                   hidden_states_hook: HiddenStatesHook | None = None, label: str = "scoring") -> SplitScore:
    """Pairwise accuracy on `pairs`; the hook (see scoring) sees chosen + rejected sequences' states. `label` names
    the progress lines of a long pass."""
    return evaluate_pairs_with_ood(rm, pairs, batch_size, precision=precision, hidden_states_hook=hidden_states_hook,
                                   ood_flag=False, label=label)[0]


def evaluate_pairs_with_ood(rm: RewardModel, pairs: Sequence[PreferencePair], batch_size: int = 32, *,
                            precision: str = "auto", hidden_states_hook: HiddenStatesHook | None = None,
                            ood_flag: bool = True, label: str = "scoring") -> tuple[SplitScore, tuple[np.ndarray, np.ndarray] | None]:
    """`evaluate_pairs`, and where the model has an OOD flag's density (and `ood_flag`), the ood scores of the
    chosen and of the rejected responses of the evaluated pairs, from the same forward pass."""
    encoded = rm.encode(pairs)
    if len(encoded) == 0:
        raise ValueError("no pair left to evaluate after truncation")
    rewards, ood = rm.scorer(batch_size, precision, ood_flag=ood_flag).rewards_and_ood(
        encoded.chosen + encoded.rejected, hidden_states_hook, label)
    chosen, rejected = rewards[: len(encoded)], rewards[len(encoded):]
    correct = "".join("1" if c > r else "0" for c, r in zip(chosen, rejected))
    score = SplitScore(pairwise_accuracy(chosen, rejected), len(encoded), tie_rate(chosen, rejected),
                       encoded.identical_after_truncation, correct)
    return score, None if ood is None else (ood[: len(encoded)], ood[len(encoded):])


def flagged_set(dataset: str, role: str, score: SplitScore, ood: tuple[np.ndarray, np.ndarray]) -> FlaggedSet:
    """An evaluated set as the OOD flag's measurement takes it (ood_flag.measure_sets)."""
    return FlaggedSet(dataset, role, np.array([c == "1" for c in score.correct], dtype=bool), ood[0], ood[1])


def fit_ood_flag(rm: RewardModel, fit_pairs: Sequence[PreferencePair], threshold_pairs: Sequence[PreferencePair], *,
                 fit_split: str, threshold_split: str, batch_size: int = 32, precision: str = "auto") -> DensityFit:
    """The OOD flag's density of `rm`'s representation on both responses of `fit_pairs` (student-train), its
    threshold from `threshold_pairs` (ID validation); set on `rm` (saved with it from then on) and returned."""
    scorer = rm.scorer(batch_size, precision, ood_flag=False)
    fit, threshold = rm.encode(fit_pairs), rm.encode(threshold_pairs)
    rm.density = fit_density(scorer.features(fit.chosen + fit.rejected),
                             scorer.features(threshold.chosen + threshold.rejected),
                             fit_split=fit_split, threshold_split=threshold_split)
    log.info("OOD flag: density of %d %s sequences (%d dimensions, shrinkage %.3f), threshold %.3f from %s",
             rm.density.n_fit, fit_split, rm.density.dimensions, rm.density.shrinkage, rm.density.threshold,
             threshold_split)
    return rm.density


def evaluation_sets(splits: ProtocolSplits, split: str) -> list[tuple[str, str, list[PreferencePair]]]:
    """(dataset, role, pairs) for the ID split and each OOD target, on "val" or "test"."""
    if split not in ("val", "test"):
        raise ValueError(f"split must be 'val' or 'test', got {split!r}")
    source_pairs = splits.id_val if split == "val" else splits.id_test
    return [(splits.source, "id", source_pairs)] + [(t, "ood", parts[split]) for t, parts in splits.ood.items()]


def evaluate_model(rm: RewardModel, splits: ProtocolSplits, split: str, batch_size: int = 32, *,
                   precision: str = "auto") -> dict[str, SplitScore]:
    return {name: evaluate_pairs(rm, pairs, batch_size, precision=precision, label=f"scoring {name} ({split})")
            for name, _, pairs in evaluation_sets(splits, split)}


def split_results(
    splits: ProtocolSplits,
    split: str,
    student: dict[str, SplitScore],
    teacher: dict[str, SplitScore],
    ceiling: dict[str, SplitScore] | None = None,
) -> list[SplitResult]:
    """Report rows: teacher and student accuracy (and the ceiling's) per evaluation set."""
    rows = []
    for name, role, _ in evaluation_sets(splits, split):
        rows.append(
            SplitResult(
                dataset=name,
                role=role,
                split=split,
                n_pairs=student[name].n_pairs,
                teacher_accuracy=teacher[name].accuracy,
                student_accuracy=student[name].accuracy,
                ceiling_accuracy=ceiling[name].accuracy if ceiling else None,
                student_tie_rate=student[name].tie_rate,
            )
        )
    return rows


def scores_to_dict(scores: dict[str, SplitScore]) -> dict[str, dict]:
    return {name: s.__dict__.copy() for name, s in scores.items()}


def scores_from_dict(raw: dict[str, dict]) -> dict[str, SplitScore]:
    return {name: SplitScore(**fields) for name, fields in raw.items()}
