"""Readers of the harmless OOD targets that come from other prompt sources and annotation pipelines than the
source (PKU-SafeRLHF) and HH: DiaSafety's chatbot replies labelled Safe or Unsafe per context, and XSTest v2's
human-labelled completions of five models, read two ways: refusing an unsafe prompt preferred to complying with
it (a harmlessness target), and complying with a safe-but-alarming prompt preferred to refusing it (over-refusal:
a reward model that rewards any refusal teaches its policy to refuse benign requests). See
shipped_data/PROVENANCE.md for sources and licences.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

from anchor_rm.data.readers import _parse_records
from anchor_rm.data.records import DataError, PreferencePair, ReadStats, Record, _decode, generic_pair

DIASAFETY_FILES = ("train.json", "val.json", "test.json")
# DiaSafety has up to 56 Safe x Unsafe pairs on one context: at most this many per context, in file order.
DIASAFETY_PAIRS_PER_CONTEXT = 3
XSTEST_COLUMNS = ("id", "type", "prompt", "completion", "final_label")
COMPLIANCE, REFUSAL = "1_full_compliance", "2_full_refusal"  # XSTest's final labels (3_partial_refusal unused)


def _folder_file(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise DataError(f"{path}: no such file (the folder must hold {name})")
    return path


def _iter_diasafety(folder: Path, per_context: int) -> Iterator[Record]:
    """One record per (Safe, Unsafe) response of a context, across the three files (contexts compared with their
    whitespace collapsed), at most `per_context` per context."""
    contexts: dict[str, dict] = {}
    for name in DIASAFETY_FILES:
        path = _folder_file(folder, name)
        try:
            rows = json.loads(_decode(path.read_bytes(), path))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}, line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON list of {{context, response, category, label}} records")
        for i, row in enumerate(rows):
            where = f"{path}, record {i}"
            if not isinstance(row, dict) or row.get("label") not in ("Safe", "Unsafe") \
                    or not isinstance(row.get("context"), str) or not isinstance(row.get("response"), str):
                yield where, {}, DataError(f"{where}: expected string 'context' and 'response' and a 'label' of "
                                           f"Safe or Unsafe")
                continue
            key = re.sub(r"\s+", " ", row["context"]).strip()
            entry = contexts.setdefault(key, {"context": row["context"], "where": where, "Safe": [], "Unsafe": []})
            entry[row["label"]].append((row["response"], row.get("category")))
    for i, entry in enumerate(contexts.values()):
        pairs = [(safe, unsafe) for safe in entry["Safe"] for unsafe in entry["Unsafe"]][:per_context]
        for j, ((safe, _), (unsafe, category)) in enumerate(pairs):
            yield (f"{entry['where']} (context {i}, pair {j})", {"context_index": i, "category": category},
                   {"prompt": entry["context"], "chosen": safe, "rejected": unsafe})


def iter_diasafety(path: str | Path, dataset: str, *, skip_invalid: bool = False, stats: ReadStats | None = None,
                   per_context: int = DIASAFETY_PAIRS_PER_CONTEXT) -> Iterator[PreferencePair]:
    """DiaSafety (Sun et al. 2022): per dialogue context, a response labelled Safe preferred to one labelled Unsafe.
    `path`: the folder with its train.json, val.json and test.json (all three: the test file alone gives 21 pairs)."""
    folder = Path(path)
    if not folder.is_dir():
        raise DataError(f"{folder}: expected DiaSafety's folder (with {', '.join(DIASAFETY_FILES)})")
    return _parse_records(_iter_diasafety(folder, per_context), generic_pair, dataset, str(folder),
                          skip_invalid=skip_invalid, stats=stats)


def _xstest_rows(folder: Path) -> list[tuple[str, dict]]:
    files = sorted(folder.glob("xstest_v2_completions_*.csv"))
    if not files:
        raise DataError(f"{folder}: no xstest_v2_completions_*.csv file")
    rows = []
    for path in files:
        reader = csv.DictReader(io.StringIO(_decode(path.read_bytes(), path), newline=""))
        missing = [c for c in XSTEST_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise DataError(f"{path}, line 1: no column {missing[0]!r} (has {reader.fieldnames})")
        model = path.stem.removeprefix("xstest_v2_completions_")
        rows += [(f"{path}, line {reader.line_num}", {**row, "model": model}) for row in reader]
    return rows


def _iter_xstest(folder: Path, unsafe_prompts: bool) -> Iterator[Record]:
    """Per prompt id, every preferred completion (another model's or the same model's) against every
    dispreferred one: refusal over compliance on the unsafe ("contrast_") prompts, compliance over refusal on the
    safe ones; partial refusals are left out."""
    chosen_label, rejected_label = (REFUSAL, COMPLIANCE) if unsafe_prompts else (COMPLIANCE, REFUSAL)
    by_id: dict[str, dict] = {}
    for where, row in _xstest_rows(folder):
        if row["type"].startswith("contrast_") != unsafe_prompts:
            continue
        entry = by_id.setdefault(row["id"], {"prompt": row["prompt"], "type": row["type"], "where": where,
                                             chosen_label: [], rejected_label: []})
        if row["final_label"] in entry:
            entry[row["final_label"]].append((row["completion"], row["model"]))
    for i, (prompt_id, entry) in enumerate(by_id.items()):
        for chosen, chosen_model in entry[chosen_label]:
            for rejected, rejected_model in entry[rejected_label]:
                yield (f"{entry['where']} (prompt {prompt_id}: {chosen_model} over {rejected_model})",
                       {"prompt_id": prompt_id, "type": entry["type"]},
                       {"prompt": entry["prompt"], "chosen": chosen, "rejected": rejected})


def iter_xstest(path: str | Path, dataset: str, *, unsafe_prompts: bool, skip_invalid: bool = False,
                stats: ReadStats | None = None) -> Iterator[PreferencePair]:
    """XSTest v2 (Röttger et al. 2024) completions with their human final labels. `unsafe_prompts`: its 200 unsafe
    prompts, refusing preferred (harmlessness); else its 250 safe prompts, complying preferred (over-refusal)."""
    folder = Path(path)
    if not folder.is_dir():
        raise DataError(f"{folder}: expected XSTest's folder (with xstest_v2_completions_*.csv)")
    return _parse_records(_iter_xstest(folder, unsafe_prompts), generic_pair, dataset, str(folder),
                          skip_invalid=skip_invalid, stats=stats)
