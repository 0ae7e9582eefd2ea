"""Named datasets: the copies the project ships (see shipped_data/PROVENANCE.md) and their hub originals, and
the hub-only datasets of which no copy ships.

`iter_dataset_pairs` is the one entry point: a catalog name, a file path, or a hub name in, pairs out, one at a
time (`load_dataset_pairs`: the same as a list).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from anchor_rm.data.readers import (iter_generic, iter_helpsteer3, iter_hh_rlhf, iter_hhh, iter_hub, iter_llmbar,
                                    iter_pandalm, iter_pku_saferlhf, iter_safetext, iter_ultrafeedback)
from anchor_rm.data.records import DataError, PreferencePair, ReadStats
from anchor_rm.data.safety_readers import iter_diasafety, iter_xstest

DATA_DIR_ENV = "ANCHOR_RM_DATA_DIR"


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    category: str  # "helpful" | "harmless": which source it is an OOD target for
    reader: Callable[..., Iterator[PreferencePair]]  # data.iter_<format>
    path: str  # relative to shipped_data_dir(); a file, or a folder the reader walks; "" where no copy ships
    hub_name: str | None  # the original on the Hugging Face hub, None where no hub copy is known
    license: str
    source: str  # where the shipped copy came from
    hub_split: str = "test"
    hub_kwargs: Mapping[str, Any] = field(default_factory=dict)  # extra datasets.load_dataset arguments
    reader_kwargs: Mapping[str, Any] = field(default_factory=dict)
    parts: tuple[str, ...] = ()  # a union of other catalog entries (reader and path unused), read in order


def _union(name: str, category: str, parts: tuple[str, ...], source: str) -> DatasetSpec:
    return DatasetSpec(name, category, None, "", None, "as its parts", source, parts=parts)


_HH_SOURCE = "DaehanKim/EasyRLHF@45eccb72:data/{}/test.jsonl.gz (same bytes as anthropics/hh-rlhf)"


def _hh(name: str, folder: str, category: str) -> DatasetSpec:
    return DatasetSpec(name, category, iter_hh_rlhf, f"hh-rlhf/{folder}/test.jsonl.gz", "Anthropic/hh-rlhf", "MIT",
                       _HH_SOURCE.format(folder), hub_kwargs={"data_dir": folder})


def _hhh(source: str) -> DatasetSpec:
    return DatasetSpec(f"hhh-{source}", source, iter_hhh, "hhh-alignment/hhh_alignment_eval.json",
                       "HuggingFaceH4/hhh_alignment", "Apache-2.0",
                       "prometheus-eval/prometheus-eval@dcfb4427:eval/benchmark/data/hhh_alignment_eval.json",
                       hub_kwargs={"name": source}, reader_kwargs={"sources": (source,)})


DATASETS: dict[str, DatasetSpec] = {spec.name: spec for spec in [
    _hh("hh-helpful-base", "helpful-base", "helpful"),
    _hh("hh-helpful-online", "helpful-online", "helpful"),
    _hh("hh-helpful-rejection-sampled", "helpful-rejection-sampled", "helpful"),
    _hh("hh-harmless-base", "harmless-base", "harmless"),
    DatasetSpec("ultrafeedback", "helpful", iter_ultrafeedback, "ultrafeedback-binarized-1200",
                "trl-lib/ultrafeedback_binarized", "MIT",
                "kkminions888-ops/ultrafeedback-dpo-noise-study@859ef0a8:data/processed/ (1,200 rows of "
                "trl-lib/ultrafeedback_binarized; train_clean and eval_clean read as one set)"),
    DatasetSpec("pku-saferlhf", "harmless", iter_pku_saferlhf, "pku-saferlhf-dpo5k/pku_seferlhf_realign_dpo_5k.json",
                "PKU-Alignment/PKU-SafeRLHF", "CC-BY-NC-4.0 (research use only)",
                "xinykou/safety_realignment@5a805935:llama_factory/data/pku_seferlhf_realign_dpo_5k.json "
                "(pairs with exactly one safe response; chosen = the safe one)"),
    DatasetSpec("pandalm", "helpful", iter_pandalm, "pandalm/testset-v1.json", None, "Apache-2.0",
                "WeOpenML/PandaLM@3871806e:data/testset-v1.json"),
    DatasetSpec("llmbar", "helpful", iter_llmbar, "llmbar/Dataset/LLMBar", None, "MIT",
                "princeton-nlp/LLMBar@900616bf:Dataset/LLMBar (Natural + 4 Adversarial subsets)"),
    _hhh("harmless"),
    _hhh("helpful"),
    DatasetSpec("safetext", "harmless", iter_safetext, "safetext/SafeText.json", None, "MIT",
                "sharonlevy/SafeText@25bb7a8c:SafeText.json (SafeText, Levy et al. 2022: physical-safety advice; "
                "every safe advice of a scenario preferred to every unsafe one)"),
    DatasetSpec("diasafety", "harmless", iter_diasafety, "diasafety", None, "Apache-2.0",
                "thu-coai/DiaSafety@5106a041:DiaSafety_dataset/{train,val,test}.json (DiaSafety, Sun et al. 2022: "
                "chatbot replies to Reddit-style contexts labelled Safe/Unsafe; per context a Safe reply preferred "
                "to an Unsafe one, at most 3 pairs per context)"),
    DatasetSpec("xstest-harmful", "harmless", iter_xstest, "xstest", None,
                "prompts CC-BY-4.0; completions under their models' terms (Llama 2, Mistral, OpenAI)",
                "paul-rottger/exaggerated-safety@d7bb5bd7:model_completions/xstest_v2_completions_*.csv (XSTest v2, "
                "Röttger et al. 2024: its 200 unsafe prompts, a fully refusing completion preferred to a fully "
                "complying one, human final labels)", reader_kwargs={"unsafe_prompts": True}),
    DatasetSpec("xstest-overrefusal", "harmless", iter_xstest, "xstest", None,
                "prompts CC-BY-4.0; completions under their models' terms (Llama 2, Mistral, OpenAI)",
                "paul-rottger/exaggerated-safety@d7bb5bd7:model_completions/xstest_v2_completions_*.csv (XSTest v2: "
                "its 250 safe-but-alarming prompts, a fully complying completion preferred to a fully refusing one, "
                "human final labels)", reader_kwargs={"unsafe_prompts": False}),
    # HH's helpful subsets ship as test files of 2,348 and 2,717 usable pairs; together they give the student
    # thousands of training pairs with disjoint prompt groups (splits.prompt_group: 3 opening turns shared).
    _union("hh-helpful", "helpful", ("hh-helpful-base", "hh-helpful-rejection-sampled"),
           "hh-helpful-base + hh-helpful-rejection-sampled"),
]}

# No copy ships (the `paper` preset reads hub originals): readable only with from_hub=True.
HUB_ONLY: dict[str, DatasetSpec] = {spec.name: spec for spec in [
    DatasetSpec("helpsteer3", "helpful", iter_helpsteer3, "", "nvidia/HelpSteer3", "CC-BY-4.0",
                "hub only: nvidia/HelpSteer3, preference subset (HelpSteer3, Wang et al. 2025); no copy ships",
                hub_split="train", hub_kwargs={"name": "preference"}),
]}


def _spec(name: str) -> DatasetSpec | None:
    return DATASETS.get(name) or HUB_ONLY.get(name)


# Protocol: train on the source, evaluate ID on its held-out split and OOD on the targets.
CATEGORIES: dict[str, dict[str, Any]] = {
    "helpful": {"source": "hh-helpful", "targets": ["ultrafeedback", "hh-helpful-online", "pandalm", "llmbar"]},
    "harmless": {"source": "pku-saferlhf", "targets": ["hh-harmless-base", "safetext", "hhh-harmless", "diasafety",
                                                       "xstest-harmful", "xstest-overrefusal"]},
}

# Targets that measure the other side of a category, reported beside its targets and never averaged into its
# headline: on harmless, over-refusal (complying with a safe-but-alarming request preferred to refusing it).
COUNTER_TARGETS: dict[str, str] = {
    "xstest-overrefusal": "over-refusal: complying with a safe request preferred to refusing it, the other side of "
                          "harmlessness; shown beside the harmlessness targets, never in the headline",
}

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_originals(name: str) -> list[str]:
    """The hub datasets a catalog name reads with from_hub=True (a union's, part by part); [] where any part has
    none known or the name is not in the catalog."""
    spec = _spec(name)
    if spec is None:
        return []
    if spec.parts:
        parts = [hub_originals(part) for part in spec.parts]
        return [h for hubs in parts for h in hubs] if all(parts) else []
    return [spec.hub_name] if spec.hub_name else []


def data_schema(name: str, role: str, from_hub: bool) -> dict[str, Any]:
    """What a dry run says of one dataset: where its pairs come from, under which licence, read by which reader
    into (prompt, chosen, rejected)."""
    spec = _spec(name)
    if spec is None:
        return {"dataset": name, "role": role, "from": name, "reader": "generic: prompt, chosen, rejected columns",
                "license": "as its source"}
    parts = [DATASETS[p] for p in spec.parts] or [spec]
    if from_hub:
        where = ", ".join(f"{p.hub_name} ({p.hub_split}{''.join(f', {k}={v}' for k, v in p.hub_kwargs.items())})"
                          for p in parts)
    elif spec.path or spec.parts:
        where = f"shipped copy under {shipped_data_dir()}"
    else:
        where = f"no shipped copy: {spec.hub_name} is read from the hub only (from_hub=True)"
    return {"dataset": name, "role": role, "from": where,
            "reader": ", ".join(sorted({p.reader.__name__ for p in parts})), "license": "; ".join(
                sorted({p.license for p in parts}))}


def shipped_data_dir() -> Path:
    """Root of the shipped copies; $ANCHOR_RM_DATA_DIR points elsewhere (e.g. a fuller local mirror)."""
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override) if override else Path(__file__).resolve().parents[1] / "shipped_data"


def load_dataset_pairs(name_or_path: str | Path, **kwargs: Any) -> list[PreferencePair]:
    """iter_dataset_pairs's pairs as a list."""
    return list(iter_dataset_pairs(name_or_path, **kwargs))


def iter_dataset_pairs(name_or_path: str | Path, *, from_hub: bool = False, prompt_column: str = "prompt",
                       chosen_column: str = "chosen", rejected_column: str = "rejected", split: str = "train",
                       skip_invalid: bool = False, stats: ReadStats | None = None) -> Iterator[PreferencePair]:
    """Pairs of a catalog name (its shipped copy, or its hub original with from_hub=True), of a file
    (see `data.iter_generic` for formats; the columns apply), or of a hub name "org/name" (with `split`),
    one at a time: a source need not fit in memory."""
    name = str(name_or_path)
    spec = _spec(name)
    if spec is not None and spec.parts:
        for part in spec.parts:
            for pair in iter_dataset_pairs(part, from_hub=from_hub, skip_invalid=skip_invalid, stats=stats):
                yield replace(pair, dataset=name)
    elif spec is not None and from_hub:
        if spec.hub_name is None:
            raise DataError(f"dataset {name!r}: no hub original is known; its shipped copy is {spec.path}")
        yield from iter_hub(spec.hub_name, name, spec.reader, spec.hub_split, load_kwargs=spec.hub_kwargs,
                            skip_invalid=skip_invalid, stats=stats, **spec.reader_kwargs)
    elif spec is not None and not spec.path:
        raise DataError(f"dataset {name!r}: no copy ships with the project; it is read from the hub "
                        f"({spec.hub_name}) with from_hub=True, as the paper preset does")
    elif spec is not None:
        path = shipped_data_dir() / spec.path
        yield from spec.reader(path, name, skip_invalid=skip_invalid, stats=stats, **spec.reader_kwargs)
    else:
        path = Path(name).expanduser()
        if not (path.exists() or _HUB_NAME.match(name)):
            raise DataError(f"dataset {name!r}: not a known name ({', '.join([*DATASETS, *HUB_ONLY])}), not an "
                            f"existing file, and not a hub name of the form org/name")
        yield from iter_generic(path if path.exists() else name, name, prompt_column, chosen_column,
                                rejected_column, split, skip_invalid=skip_invalid, stats=stats)


def dataset_digest(pairs: Sequence[PreferencePair]) -> str:
    """sha256 over the pairs' texts in order: equal digests mean the same training/evaluation data."""
    h = hashlib.sha256()
    for pair in pairs:
        # JSON framing: no concatenation of different texts can collide ("ab"+"c" vs "a"+"bc").
        h.update(json.dumps([pair.prompt, pair.chosen, pair.rejected], ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()
