"""HelpSteer3 (nvidia/HelpSteer3, preference subset): the reader on tiny files of the hub's row layout, and its
hub-only catalog entry. No network: the hub rows are dicts handed to the parser iter_hub uses."""

from __future__ import annotations

import json
import re

import pytest

from anchor_rm.data import readers, records
from anchor_rm.data.catalog import HUB_ONLY, data_schema, hub_originals, load_dataset_pairs
from anchor_rm.data.readers import iter_helpsteer3, read_helpsteer3
from anchor_rm.data.records import DataError, ReadStats
from anchor_rm.data.splits import clean_pairs


def user(text: str) -> dict:
    return {"role": "user", "content": text}


ROWS = [
    {"domain": "general", "language": "english", "context": [user("Say hi")], "response1": "Hi!",
     "response2": "Go away.", "overall_preference": -2, "individual_preference": [{"score": -2}]},
    {"domain": "code", "context": [user("Add 1 and 1")], "response1": "3", "response2": "2", "overall_preference": 3},
    {"domain": "general", "context": [user("Pick one")], "response1": "A", "response2": "B", "overall_preference": 0},
    {"domain": "general", "response1": "Green.", "response2": "Dunno.", "overall_preference": "-1",
     "context": [{"role": "system", "content": "Be brief."}, user("Hi"), {"role": "assistant", "content": "Hello!"},
                 user("Name a colour.")]},
]


def write_rows(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_pairs_follow_overall_preference_and_the_context_is_the_prompt(tmp_path):
    pairs = read_helpsteer3(write_rows(tmp_path / "hs3.jsonl", ROWS), "helpsteer3")
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        ("Say hi", "Hi!", "Go away."),  # -2: response1 preferred
        ("Add 1 and 1", "2", "3"),  # 3: response2 preferred
        ("Pick one", "A", "B"),  # 0: a tie, in file order
        ("\n\nSystem: Be brief.\n\nUser: Hi\n\nAssistant: Hello!\n\nUser: Name a colour.", "Green.", "Dunno."),
    ]
    assert [p.metadata["overall_preference"] for p in pairs] == [-2, 3, 0, -1]
    assert [bool(p.metadata.get("tie")) for p in pairs] == [False, False, True, False]
    assert all(p.dataset == "helpsteer3" for p in pairs)
    # Ties (and empty responses) come back marked; cleaning drops and counts them, as for every reader.
    empty = {**ROWS[0], "response2": ""}
    kept, counts = clean_pairs(pairs + read_helpsteer3(write_rows(tmp_path / "e.jsonl", [empty]), "helpsteer3"))
    assert (counts.ties, counts.empty, counts.kept) == (1, 1, 3)
    assert "Pick one" not in [p.prompt for p in kept]


@pytest.mark.parametrize("change, message", [
    ({"response2": None}, "field 'response2' is missing"),
    ({"response1": 7}, "field 'response1' must be a string, got int"),
    ({"overall_preference": 4}, "field 'overall_preference' must be one of -3, -2, -1, 0, 1, 2, 3, got 4"),
    ({"overall_preference": 1.5}, "field 'overall_preference' must be one of"),
    ({"overall_preference": True}, "field 'overall_preference' must be one of"),
    ({"context": "Say hi"}, "field 'context' must be a non-empty list of chat turns"),
    ({"context": []}, "field 'context' must be a non-empty list of chat turns"),
    ({"context": [{"role": "user"}]}, "field 'context': field 'content' is missing"),
])
def test_a_bad_row_names_file_line_and_field(tmp_path, change, message):
    bad = {k: v for k, v in {**ROWS[1], **change}.items() if v is not None}
    path = write_rows(tmp_path / "bad.jsonl", [ROWS[0], bad])
    with pytest.raises(DataError, match=re.escape(f"{path}, line 2: {message}")):
        read_helpsteer3(path, "helpsteer3")
    stats = ReadStats()
    assert len(read_helpsteer3(path, "helpsteer3", skip_invalid=True, stats=stats)) == 1
    assert stats.skipped == 1 and message in stats.errors[0]


def test_invalid_json_line_is_named(tmp_path):
    path = write_rows(tmp_path / "bad.jsonl", [ROWS[0], "{not json"])
    with pytest.raises(DataError, match=re.escape(f"{path}, line 2: invalid JSON")):
        list(iter_helpsteer3(path, "helpsteer3"))


def test_hub_rows_parse_with_the_registered_parser():
    parse = readers._HUB_PARSERS[iter_helpsteer3]
    assert parse is records.helpsteer3_pair and readers._HUB_PARSERS[read_helpsteer3] is parse
    pair = parse(ROWS[1], "helpsteer3", "hub row 0", {"source_index": 0})
    assert (pair.prompt, pair.chosen, pair.rejected) == ("Add 1 and 1", "2", "3")
    with pytest.raises(DataError, match="hub row 0: field 'overall_preference' must be one of"):
        parse({**ROWS[1], "overall_preference": -4}, "helpsteer3", "hub row 0", {})


def test_catalog_reads_it_from_the_hub_only(monkeypatch):
    spec = HUB_ONLY["helpsteer3"]
    assert (spec.category, spec.reader, spec.path, spec.license) == ("helpful", iter_helpsteer3, "", "CC-BY-4.0")
    assert hub_originals("helpsteer3") == ["nvidia/HelpSteer3"]
    with pytest.raises(DataError) as caught:
        load_dataset_pairs("helpsteer3")
    assert "\n" not in str(caught.value)
    assert "no copy ships" in str(caught.value) and "from the hub" in str(caught.value)

    loaded = []

    def fake_hub(name, split, load_kwargs):  # stands in for datasets.load_dataset
        loaded.append((name, split, dict(load_kwargs)))
        return ((f"hub row {i}", {"source_index": i}, row) for i, row in enumerate(ROWS))

    monkeypatch.setattr(readers, "_iter_hub", fake_hub)
    pairs = load_dataset_pairs("helpsteer3", from_hub=True)
    assert loaded == [("nvidia/HelpSteer3", "train", {"name": "preference"})]
    assert [p.chosen for p in pairs] == ["Hi!", "2", "A", "Green."]


def test_dry_run_schema_both_ways():
    assert data_schema("helpsteer3", "source", True) == {
        "dataset": "helpsteer3", "role": "source", "from": "nvidia/HelpSteer3 (train, name=preference)",
        "reader": "iter_helpsteer3", "license": "CC-BY-4.0"}
    assert "hub only" in data_schema("helpsteer3", "source", False)["from"]
