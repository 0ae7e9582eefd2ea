"""Raw preference files -> `PreferencePair`s: one reader per format, one generic reader.

Readers return pairs as the file states them: ties, empty and identical responses are kept (marked
where the format says so) so that `splits.clean_pairs` drops *and counts* them in one place. Every
malformed input raises `DataError` naming the file, the line (JSONL, or a JSON syntax error) or the
record / row index, and the field, so a bad record is found without a debugger.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

ASSISTANT = "\n\nAssistant:"
HHH_PROMPT, HHH_RESPONSE, HHH_RUBRIC = "###The instruction to evaluate:", "###Response to evaluate:", "###Score Rubrics"
JSONL = ("*.jsonl", "*.jsonl.gz")


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    dataset: str
    # hash=False: a dict is unhashable, and pairs are handy as set members and dict keys.
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)


class DataError(ValueError):
    """Bad input data; message always names the file (and line / record index) and the field."""


@dataclass
class ReadStats:
    """Pass one as `stats=` with `skip_invalid=True` to learn how many records were skipped, and why."""

    skipped: int = 0
    errors: list[str] = field(default_factory=list)  # the first 20 messages: enough to diagnose, bounded

    def skip(self, error: DataError) -> None:
        self.skipped += 1
        if len(self.errors) < 20:
            self.errors.append(str(error))


# --- record sources: each yields (where, metadata, record); a bad JSONL line comes as a DataError record ---

Record = tuple[str, dict, Any]


def _decode(raw: bytes, path: Path, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line if line is not None else raw[: e.start].count(b"\n") + 1
        raise DataError(f"{path}, line {at}: bytes are not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _iter_jsonl(path: Path) -> Iterator[Record]:
    try:
        with gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                where = f"{path}, line {n}"
                try:
                    text = _decode(raw, path, n)
                    if text.strip():  # a trailing blank line is not a record
                        yield where, {"source_line": n}, json.loads(text)
                except json.JSONDecodeError as e:
                    yield where, {}, DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})")
                except DataError as e:
                    yield where, {}, e
    except (OSError, EOFError, zlib.error) as e:  # missing, truncated or non-gzip file
        raise DataError(f"{path}: cannot read file ({e})") from None


def _iter_json_list(path: Path) -> Iterator[Record]:
    text = _decode(path.read_bytes(), path)
    if not text.strip():
        raise DataError(f"{path}: file is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}, line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    for i, rec in enumerate(data):
        yield f"{path}, record {i}", {"source_index": i}, rec


def _iter_table(path: Path) -> Iterator[Record]:
    if path.suffix.lower() == ".parquet":
        yield from _iter_parquet(path)
        return
    text = _decode(path.read_bytes(), path)  # bad bytes: name the line
    try:  # keep_default_na=False: an empty cell is an empty string (cleaning counts it), not NaN
        import pandas as pd

        rows = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False).to_dict("records")
    except Exception as e:  # pandas raises many types for a corrupt file
        raise DataError(f"{path}: cannot read table ({type(e).__name__}: {e})") from None
    for i, rec in enumerate(rows):
        yield f"{path}, row {i}", {"source_index": i}, rec


def _iter_parquet(path: Path, batch_rows: int = 4096) -> Iterator[Record]:
    """Row groups read a batch at a time. pyarrow, not pandas: chat columns must come back as lists, not numpy
    arrays."""
    import pyarrow.parquet as pq

    i = 0
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=batch_rows)
        for batch in batches:
            for rec in batch.to_pylist():
                yield f"{path}, row {i}", {"source_index": i}, rec
                i += 1
    except Exception as e:  # pyarrow raises many types for a corrupt file
        raise DataError(f"{path}: cannot read table ({type(e).__name__}: {e})") from None


def _iter_hub(name: str, split: str, load_kwargs: Mapping[str, Any]) -> Iterator[Record]:
    try:
        import datasets  # lazy: hub access is optional and slow to import

        rows = datasets.load_dataset(name, split=split, **load_kwargs)
    except Exception as e:  # offline, unknown name, bad split: all the same to the caller
        raise DataError(f"hub dataset {name!r} (split {split!r}): cannot load ({type(e).__name__}: {e})") from None
    for i, rec in enumerate(rows):
        yield f"hub dataset {name!r} split {split!r}, row {i}", {"source_index": i}, rec


# --- field helpers --------------------------------------------------------------------------------------


def _field(rec: Any, key: str, where: str) -> Any:
    if not isinstance(rec, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if key not in rec:
        raise DataError(f"{where}: field {key!r} is missing (fields present: {sorted(rec)})")
    return rec[key]


def _text(rec: Any, key: str, where: str) -> str:
    value = _field(rec, key, where)
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _choice(rec: Any, key: str, allowed: tuple[str, ...], where: str) -> int:
    """A vote or label given as an int or a digit string (files disagree on which)."""
    value = _field(rec, key, where)
    if isinstance(value, bool) or str(value).strip() not in allowed:
        raise DataError(f"{where}: field {key!r} must be one of {', '.join(allowed)}, got {value!r}")
    return int(value)


def _response(rec: Any, key: str, where: str) -> str:
    """A string, or a chat (list of {"role", "content"}) whose answer is its last assistant turn."""
    value = _field(rec, key, where)
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise DataError(f"{where}: field {key!r} must be a string or a message list, got {type(value).__name__}")
    for msg in reversed(value):
        if isinstance(msg, Mapping) and msg.get("role") == "assistant":
            return _text(msg, "content", f"{where}: field {key!r}")
    raise DataError(f"{where}: field {key!r} is a message list without an assistant message")


def _prompt_from_chat(chat: list, key: str, where: str) -> str:
    """Implicit-prompt chats (trl-lib style): the prompt is the turns before the last assistant turn."""
    last = max((i for i, m in enumerate(chat) if isinstance(m, Mapping) and m.get("role") == "assistant"), default=0)
    for i, m in enumerate(chat[:last]):
        if not isinstance(m, Mapping):
            raise DataError(f"{where}: field {key!r}: turn {i} is a {type(m).__name__}, not a message object "
                            f"({{\"role\": ..., \"content\": ...}})")
    turns = [(str(m.get("role", "")), _text(m, "content", f"{where}: field {key!r}")) for m in chat[:last]]
    if not turns:
        raise DataError(f"{where}: no prompt field, and field {key!r} has no turn before its answer")
    return turns[0][1] if len(turns) == 1 else "".join(f"\n\n{r.capitalize()}: {c}" for r, c in turns)


# --- per-format record parsers: (record, dataset, where, metadata) -> pair, or None to leave it out ------


def _hh_split(transcript: str, key: str, where: str) -> tuple[str, str]:
    i = transcript.rfind(ASSISTANT)
    if i < 0:
        raise DataError(f"{where}: field {key!r} has no '\\n\\nAssistant:' turn")
    return transcript[: i + len(ASSISTANT)], transcript[i + len(ASSISTANT) :]


def hh_rlhf_pair(rec: Any, dataset: str, where: str, meta: dict) -> PreferencePair:
    chosen, rejected = _text(rec, "chosen", where), _text(rec, "rejected", where)
    (p_c, a_c), (p_r, a_r) = _hh_split(chosen, "chosen", where), _hh_split(rejected, "rejected", where)
    prompt = p_c
    if p_c != p_r:
        meta["prompt_mismatch"] = True
        # In every such HH row seen, one reply runs on into invented "Human:/Assistant:" turns, so its last
        # marker lies inside the reply: the shorter prefix, which the other transcript starts with, is the
        # dialogue both share. Otherwise the dialogues really differ; keep the chosen's, as the flag says.
        if len(p_r) < len(p_c) and chosen.startswith(p_r):
            prompt, a_c = p_r, chosen[len(p_r) :]
        elif len(p_c) < len(p_r) and rejected.startswith(p_c):
            a_r = rejected[len(p_c) :]
    return PreferencePair(prompt, a_c.strip(), a_r.strip(), dataset, meta)


def generic_pair(rec: Any, dataset: str, where: str, meta: dict, prompt_column: str = "prompt",
                 chosen_column: str = "chosen", rejected_column: str = "rejected") -> PreferencePair:
    if isinstance(rec, Mapping) and prompt_column not in rec and isinstance(rec.get(chosen_column), list):
        prompt = _prompt_from_chat(rec[chosen_column], chosen_column, where)
    else:
        prompt = _text(rec, prompt_column, where)
    chosen, rejected = _response(rec, chosen_column, where), _response(rec, rejected_column, where)
    return PreferencePair(prompt, chosen, rejected, dataset, meta)


def ultrafeedback_pair(rec: Any, dataset: str, where: str, meta: dict) -> PreferencePair:
    scores = rec.get("metadata", rec) if isinstance(rec, Mapping) else {}  # shipped: nested; hub: top level
    if isinstance(scores, Mapping) and "score_chosen" in scores and "score_rejected" in scores:
        meta["score_chosen"], meta["score_rejected"] = scores["score_chosen"], scores["score_rejected"]
        # Binarization drew the rejected answer among the other three, equal ratings included: no preference.
        if scores["score_chosen"] == scores["score_rejected"]:
            meta["tie"] = True
    return generic_pair(rec, dataset, where, meta)


def pku_saferlhf_pair(rec: Any, dataset: str, where: str, meta: dict) -> PreferencePair:
    prompt = _text(rec, "prompt", where)
    if "response" not in rec and "response_0" in rec:  # the hub layout: two responses and a safety verdict
        safer = _choice(rec, "safer_response_id", ("0", "1"), where)
        meta["safety_differs"] = rec.get("is_response_0_safe") != rec.get("is_response_1_safe")
        chosen, rejected = _text(rec, f"response_{safer}", where), _text(rec, f"response_{1 - safer}", where)
        return PreferencePair(prompt, chosen, rejected, dataset, meta)
    responses = _field(rec, "response", where)
    if not (isinstance(responses, list) and len(responses) == 2 and all(isinstance(r, str) for r in responses)):
        raise DataError(f"{where}: field 'response' must be a list of two strings [chosen, rejected]")
    return PreferencePair(prompt, responses[0], responses[1], dataset, meta)


def pandalm_pair(rec: Any, dataset: str, where: str, meta: dict) -> PreferencePair:
    # testset-v1.json holds six answers "True" that its writer serialised as the JSON literal true.
    coerced = [k for k in ("response1", "response2") if isinstance(_field(rec, k, where), bool)]
    if coerced:
        rec, meta["coerced_fields"] = {**rec, **{k: str(rec[k]) for k in coerced}}, coerced
    responses = [_text(rec, "response1", where), _text(rec, "response2", where)]
    instruction, extra = _text(rec, "instruction", where), _text(rec, "input", where)
    votes = [_choice(rec, f"annotator{k}", ("0", "1", "2"), where) for k in (1, 2, 3)]
    winner, count = Counter(votes).most_common(1)[0]
    meta.update(votes=votes, **{k: rec[k] for k in ("idx", "cmp_key") if k in rec})
    if count < 2 or winner == 0:  # vote 0 means "tie"; three different votes mean no majority
        meta["tie"], winner = True, 1
    chosen, rejected = responses if winner == 1 else responses[::-1]
    return PreferencePair(instruction + ("\n\n" + extra if extra.strip() else ""), chosen, rejected, dataset, meta)


def llmbar_pair(rec: Any, dataset: str, where: str, meta: dict) -> PreferencePair:
    outputs = [_text(rec, "output_1", where), _text(rec, "output_2", where)]
    chosen, rejected = outputs if _choice(rec, "label", ("1", "2"), where) == 1 else outputs[::-1]
    return PreferencePair(_text(rec, "input", where), chosen, rejected, dataset, meta)


def helpsteer3_pair(rec: Any, dataset: str, where: str, meta: dict) -> PreferencePair:
    context = _field(rec, "context", where)
    if not isinstance(context, list) or not context:
        raise DataError(f"{where}: field 'context' must be a non-empty list of chat turns, got {context!r:.80}")
    # The context ends on the user's turn: behind a placeholder answer, every one of its turns is the prompt.
    prompt = _prompt_from_chat([*context, {"role": "assistant"}], "context", where)
    responses = [_text(rec, "response1", where), _text(rec, "response2", where)]
    meta["overall_preference"] = preference = _choice(rec, "overall_preference", tuple(map(str, range(-3, 4))), where)
    if preference == 0:  # -3..-1: response1 is better, 1..3: response2, 0: neither
        meta["tie"] = True
    chosen, rejected = responses if preference <= 0 else responses[::-1]
    return PreferencePair(prompt, chosen, rejected, dataset, meta)


def _iter_safetext(path: Path) -> Iterator[Record]:
    """SafeText's {scenario: {"safe": [...], "unsafe": [...]}}: one record per (safe, unsafe) advice of a
    scenario, in file order."""
    text = _decode(path.read_bytes(), path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}, line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, dict) or not data:
        raise DataError(f"{path}: expected a non-empty JSON object of scenarios, got {type(data).__name__}")
    for i, (scenario, advice) in enumerate(data.items()):
        where = f"{path}, scenario {i} ({scenario[:60]!r})"
        if not isinstance(advice, Mapping):
            yield where, {}, DataError(f"{where}: expected an object with 'safe' and 'unsafe' lists")
            continue
        lists = {key: advice.get(key) for key in ("safe", "unsafe")}
        bad = [key for key, items in lists.items() if not isinstance(items, list) or not items]
        if bad:
            yield where, {}, DataError(f"{where}: field {bad[0]!r} must be a non-empty list of advice")
            continue
        for j, safe in enumerate(lists["safe"]):
            for k, unsafe in enumerate(lists["unsafe"]):
                yield (f"{where}, safe {j} x unsafe {k}", {"scenario_index": i},
                       {"prompt": scenario, "chosen": safe, "rejected": unsafe})


def _between(rec: Any, key: str, start: str, end: str, where: str) -> str:
    text = _text(rec, key, where)
    i = text.find(start)
    j = text.find(end, i + len(start)) if i >= 0 else -1
    if i < 0 or j < 0:
        raise DataError(f"{where}: field {key!r} lacks the marker {start if i < 0 else end!r}")
    return text[i + len(start) : j].strip()


def hhh_pair(rec: Any, dataset: str, where: str, meta: dict,
             sources: Iterable[str] | None = None) -> PreferencePair | None:
    if isinstance(rec, Mapping) and "targets" in rec:  # the hub layout (HuggingFaceH4/hhh_alignment)
        targets = rec["targets"]
        try:
            choices, best = list(targets["choices"]), list(targets["labels"]).index(1)
        except (TypeError, KeyError, ValueError):
            raise DataError(f"{where}: field 'targets' must hold 'choices' and 'labels' with one label 1") from None
        if len(choices) != 2:
            raise DataError(f"{where}: field 'targets' must hold two choices, got {len(choices)}")
        return PreferencePair(_text(rec, "input", where), choices[best], choices[1 - best], dataset, meta)
    meta["source"] = _text(rec, "source", where)
    if sources is not None and meta["source"] not in sources:
        return None
    prompt = _between(rec, "chosen_instruction", HHH_PROMPT, HHH_RESPONSE, where)
    if _between(rec, "rejected_instruction", HHH_PROMPT, HHH_RESPONSE, where) != prompt:
        meta["prompt_mismatch"] = True
    chosen, rejected = (_between(rec, k, HHH_RESPONSE, HHH_RUBRIC, where) for k in ("chosen_instruction",
                                                                                     "rejected_instruction"))
    return PreferencePair(prompt, chosen, rejected, dataset, meta)


# --- readers ----------------------------------------------------------------------------------------------
# Each format has a generator, iter_<format>, that parses one record at a time (JSONL and Parquet are read
# as they stream; a JSON list or a CSV is parsed whole first), and read_<format>, the same pairs as a list.
# A source too large to hold as a list goes through the generators (splits.build_protocol_splits).

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


# The same pairs as lists.


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
