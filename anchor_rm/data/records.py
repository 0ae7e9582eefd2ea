"""Raw preference records -> `PreferencePair`s: the pair, the error every bad input raises, the record sources of
each file format (one record at a time) and the parser of each dataset's layout.

Parsers return pairs as the file states them: ties, empty and identical responses are kept (marked where the
format says so) so that `splits.clean_pairs` drops *and counts* them in one place. Every malformed input raises
`DataError` naming the file, the line (JSONL, or a JSON syntax error) or the record / row index, and the field,
so a bad record is found without a debugger. The readers (readers.py) put sources and parsers together."""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable, Iterator, Mapping
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
