"""One reader per format and one generic reader: `iter_<format>` parses one record at a time (JSONL and Parquet
are read as they stream; a JSON list or a CSV is parsed whole first), and `read_<format>` gives the same pairs
as a list. A source too large to hold as a list goes through the generators (splits.build_protocol_splits)."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from anchor_rm.data.records import (DataError, JSONL, PreferencePair, ReadStats, Record, _iter_hub, _iter_json_list,
                                    _iter_jsonl, _iter_safetext, _iter_table, generic_pair, helpsteer3_pair,
                                    hh_rlhf_pair, hhh_pair, llmbar_pair, pandalm_pair, pku_saferlhf_pair,
                                    ultrafeedback_pair)


Parser = Callable[..., "PreferencePair | None"]


def _parse_records(records: Iterable[Record], parse: Parser, dataset: str, source: str, *, skip_invalid: bool,
                   stats: ReadStats | None, **parse_kwargs: Any) -> Iterator[PreferencePair]:
    stats = stats if stats is not None else ReadStats()
    seen, skipped, first_error = 0, 0, ""
    for where, meta, rec in records:
        seen += 1
        try:
            if isinstance(rec, DataError):
                raise rec
            pair = parse(rec, dataset, where, dict(meta), **parse_kwargs)
        except DataError as e:
            if not skip_invalid:
                raise
            stats.skip(e)
            skipped, first_error = skipped + 1, first_error or str(e)
            continue
        if pair is not None:
            yield pair
    if seen == 0:
        raise DataError(f"{source}: no records (empty file or dataset)")
    if skipped == seen:
        raise DataError(f"{source}: every one of {seen} records is invalid; the first: {first_error}")


def _iter_files(path: str | Path, dataset: str, parse: Parser, patterns: tuple[str, ...], *, skip_invalid: bool,
                stats: ReadStats | None, **parse_kwargs: Any) -> Iterator[PreferencePair]:
    """A file, or every matching file under a folder, sorted so the order does not depend on the file system."""
    root = Path(path)
    files = sorted({p for pattern in patterns for p in root.rglob(pattern)}) if root.is_dir() else [root]
    if root.is_dir() and not files:
        raise DataError(f"{root}: folder holds no {' or '.join(patterns)} file")
    if not files[0].is_file():
        raise DataError(f"{root}: no such file")
    for file in files:
        records = _iter_jsonl(file) if ".jsonl" in file.suffixes else _iter_json_list(file)
        if file != root:  # a folder of files: say which file (and LLMBar subset) each pair came from
            folder = file.parent.relative_to(root)
            extra = {"subset": folder.as_posix() if folder.parts else file.name.split(".")[0],
                     "source_file": file.relative_to(root).as_posix()}
            records = ((w, {**m, **extra}, r) for w, m, r in records)
        yield from _parse_records(records, parse, dataset, str(file), skip_invalid=skip_invalid, stats=stats,
                                  **parse_kwargs)


def iter_hh_rlhf(path: str | Path, dataset: str, *, skip_invalid: bool = False,
                 stats: ReadStats | None = None) -> Iterator[PreferencePair]:
    """Anthropic HH-RLHF transcripts (.jsonl or .jsonl.gz); the prompt keeps the whole multi-turn dialogue."""
    return _iter_files(path, dataset, hh_rlhf_pair, JSONL, skip_invalid=skip_invalid, stats=stats)


def iter_ultrafeedback(path: str | Path, dataset: str, *, skip_invalid: bool = False,
                       stats: ReadStats | None = None) -> Iterator[PreferencePair]:
    """Binarized UltraFeedback JSONL (a file, or a folder of them); equal scores come back as ties."""
    return _iter_files(path, dataset, ultrafeedback_pair, JSONL, skip_invalid=skip_invalid, stats=stats)


def iter_pku_saferlhf(path: str | Path, dataset: str, *, skip_invalid: bool = False,
                      stats: ReadStats | None = None) -> Iterator[PreferencePair]:
    """JSON list of {"prompt", "response": [chosen (the safe one), rejected]}."""
    return _iter_files(path, dataset, pku_saferlhf_pair, ("*.json",), skip_invalid=skip_invalid, stats=stats)


def iter_pandalm(path: str | Path, dataset: str, *, skip_invalid: bool = False,
                 stats: ReadStats | None = None) -> Iterator[PreferencePair]:
    """PandaLM test set: the majority of three annotators; tie majorities come back as metadata["tie"]."""
    return _iter_files(path, dataset, pandalm_pair, ("*.json",), skip_invalid=skip_invalid, stats=stats)


def iter_llmbar(path: str | Path, dataset: str, *, skip_invalid: bool = False,
                stats: ReadStats | None = None) -> Iterator[PreferencePair]:
    """One LLMBar dataset.json, or every dataset.json under a folder (metadata["subset"] = its sub-folder)."""
    return _iter_files(path, dataset, llmbar_pair, ("dataset.json",), skip_invalid=skip_invalid, stats=stats)


def iter_helpsteer3(path: str | Path, dataset: str, *, skip_invalid: bool = False,
                    stats: ReadStats | None = None) -> Iterator[PreferencePair]:
    """HelpSteer3 preference rows (JSONL): the chat `context` is the prompt, `overall_preference` picks the
    response (0 comes back as metadata["tie"])."""
    return _iter_files(path, dataset, helpsteer3_pair, JSONL, skip_invalid=skip_invalid, stats=stats)


def iter_hhh(path: str | Path, dataset: str, *, sources: Iterable[str] | None = None, skip_invalid: bool = False,
             stats: ReadStats | None = None) -> Iterator[PreferencePair]:
    """HHH alignment wrapped in Prometheus judge prompts; `sources` keeps e.g. only ("harmless",)."""
    sources = None if sources is None else frozenset(sources)
    yielded = 0
    for pair in _iter_files(path, dataset, hhh_pair, ("*.json",), skip_invalid=skip_invalid, stats=stats,
                            sources=sources):
        yielded += 1
        yield pair
    if not yielded:
        raise DataError(f"{path}: no record has a source in {sorted(sources or ())}")


def iter_safetext(path: str | Path, dataset: str, *, skip_invalid: bool = False,
                  stats: ReadStats | None = None) -> Iterator[PreferencePair]:
    """SafeText (physical-safety advice): every safe advice of a scenario preferred to every unsafe one; the
    scenario (a sentence's start, "To remove redness from eyes,") is the prompt."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    return _parse_records(_iter_safetext(path), generic_pair, dataset, str(path), skip_invalid=skip_invalid,
                          stats=stats)


FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".csv")


def iter_generic(path_or_hub_name: str | Path, dataset: str, prompt_column: str = "prompt",
                 chosen_column: str = "chosen", rejected_column: str = "rejected", split: str = "train", *,
                 skip_invalid: bool = False, stats: ReadStats | None = None,
                 load_kwargs: Mapping[str, Any] | None = None) -> Iterator[PreferencePair]:
    """A .jsonl[.gz], .json (list), .parquet or .csv file; anything else goes to `datasets.load_dataset`
    (a hub name, or a local folder) with `split` and `load_kwargs`. Chosen/rejected may be chats (lists of
    messages); with no prompt column the prompt is the chosen chat's turns before its answer."""
    path, name = Path(path_or_hub_name), str(path_or_hub_name)
    lowered = name.lower()
    if lowered.endswith(FILE_SUFFIXES):
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        source = name
        suffixes = [s.lower() for s in path.suffixes]
        records = (_iter_jsonl if ".jsonl" in suffixes else _iter_json_list if suffixes[-1] == ".json"
                   else _iter_table)(path)
    elif path.is_file():  # a file, but not of a format read here: datasets would call it a hub name
        raise DataError(f"{path}: not a data file this reads (its name ends in {path.suffix or 'no suffix'}); use one "
                        f"of {', '.join(FILE_SUFFIXES)}")
    else:
        source, records = f"hub dataset {name!r}", _iter_hub(name, split, load_kwargs or {})
    columns = dict(prompt_column=prompt_column, chosen_column=chosen_column, rejected_column=rejected_column)
    yield from _parse_records(records, generic_pair, dataset, source, skip_invalid=skip_invalid, stats=stats,
                              **columns)


def iter_hub(hub_name: str, dataset: str, reader: Callable, split: str, *,
             load_kwargs: Mapping[str, Any] | None = None, skip_invalid: bool = False,
             stats: ReadStats | None = None, **parse_kwargs: Any) -> Iterator[PreferencePair]:
    """A hub dataset whose rows are in the layout `reader` parses (e.g. Anthropic/hh-rlhf with iter_hh_rlhf
    or read_hh_rlhf)."""
    return _parse_records(_iter_hub(hub_name, split, load_kwargs or {}), _HUB_PARSERS[reader], dataset,
                          f"hub dataset {hub_name!r}", skip_invalid=skip_invalid, stats=stats, **parse_kwargs)


def read_hh_rlhf(path: str | Path, dataset: str, **kwargs: Any) -> list[PreferencePair]:
    """iter_hh_rlhf's pairs as a list."""
    return list(iter_hh_rlhf(path, dataset, **kwargs))


def read_ultrafeedback(path: str | Path, dataset: str, **kwargs: Any) -> list[PreferencePair]:
    """iter_ultrafeedback's pairs as a list."""
    return list(iter_ultrafeedback(path, dataset, **kwargs))


def read_pku_saferlhf(path: str | Path, dataset: str, **kwargs: Any) -> list[PreferencePair]:
    """iter_pku_saferlhf's pairs as a list."""
    return list(iter_pku_saferlhf(path, dataset, **kwargs))


def read_pandalm(path: str | Path, dataset: str, **kwargs: Any) -> list[PreferencePair]:
    """iter_pandalm's pairs as a list."""
    return list(iter_pandalm(path, dataset, **kwargs))


def read_llmbar(path: str | Path, dataset: str, **kwargs: Any) -> list[PreferencePair]:
    """iter_llmbar's pairs as a list."""
    return list(iter_llmbar(path, dataset, **kwargs))


def read_helpsteer3(path: str | Path, dataset: str, **kwargs: Any) -> list[PreferencePair]:
    """iter_helpsteer3's pairs as a list."""
    return list(iter_helpsteer3(path, dataset, **kwargs))


def read_hhh(path: str | Path, dataset: str, **kwargs: Any) -> list[PreferencePair]:
    """iter_hhh's pairs as a list."""
    return list(iter_hhh(path, dataset, **kwargs))


def read_safetext(path: str | Path, dataset: str, **kwargs: Any) -> list[PreferencePair]:
    """iter_safetext's pairs as a list."""
    return list(iter_safetext(path, dataset, **kwargs))


def read_generic(path_or_hub_name: str | Path, dataset: str, *args: Any, **kwargs: Any) -> list[PreferencePair]:
    """iter_generic's pairs as a list."""
    return list(iter_generic(path_or_hub_name, dataset, *args, **kwargs))


def read_hub(hub_name: str, dataset: str, reader: Callable, split: str, **kwargs: Any) -> list[PreferencePair]:
    """iter_hub's pairs as a list."""
    return list(iter_hub(hub_name, dataset, reader, split, **kwargs))


# The row parser of each reader, for a hub dataset in the reader's layout.
_HUB_PARSERS: dict[Callable, Parser] = {
    reader: parse
    for parse, readers in ((hh_rlhf_pair, (iter_hh_rlhf, read_hh_rlhf)),
                           (ultrafeedback_pair, (iter_ultrafeedback, read_ultrafeedback)),
                           (pku_saferlhf_pair, (iter_pku_saferlhf, read_pku_saferlhf)),
                           (pandalm_pair, (iter_pandalm, read_pandalm)), (llmbar_pair, (iter_llmbar, read_llmbar)),
                           (helpsteer3_pair, (iter_helpsteer3, read_helpsteer3)), (hhh_pair, (iter_hhh, read_hhh)),
                           (generic_pair, (iter_generic, read_generic)))
    for reader in readers
}
