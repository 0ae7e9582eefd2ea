"""Cleaning, prompt-disjoint splits and the protocol built from them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from anchor_rm.data.catalog import CATEGORIES, dataset_digest, load_dataset_pairs
from anchor_rm.data.records import DataError, PreferencePair
from anchor_rm.data.splits import (CleanCounts, ProtocolSplits, build_protocol_splits, clean_pairs, split_by_prompt,
                                   subsample)


def pair(prompt: str, chosen: str = "good", rejected: str = "bad", **metadata) -> PreferencePair:
    return PreferencePair(prompt, chosen, rejected, "toy", metadata)


def toy(n_prompts: int, per_prompt: int = 3, name: str = "toy") -> list[PreferencePair]:
    return [PreferencePair(f"{name} prompt {i}", f"good {i}.{j}", f"bad {i}.{j}", name)
            for i in range(n_prompts) for j in range(per_prompt)]


def prompts(pairs) -> set[str]:
    return {p.prompt for p in pairs}


def is_subsequence(part, whole) -> bool:
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)


# --- cleaning ---------------------------------------------------------------------------------------


def test_clean_pairs_drops_and_counts_each_reason():
    pairs = [
        pair("p1"),
        pair("p2", tie=True),
        pair("  ", "a", "b"), pair("p3", "", "b"), pair("p4", "a", " \n"),
        pair("p5", "same", " same "),
        pair("p6", "x", "y"), pair("p6", "y", "x"),  # contradicting labels
        pair("p7", "a", "b"), pair("p7", "a ", "b"),  # a repeat (after strip)
        pair("p1", "other", "bad"),  # same prompt, different pair: kept
    ]
    kept, counts = clean_pairs(pairs)
    assert counts == CleanCounts(total=11, kept=3, ties=1, empty=3, identical=1, conflicting=2, duplicates=1)
    assert kept == [pairs[0], pairs[8], pairs[10]]  # the first of the repeats, in input order
    assert counts.to_dict() == {"total": 11, "kept": 3, "ties": 1, "empty": 3, "identical": 1,
                                "conflicting": 2, "duplicates": 1}


def test_clean_pairs_without_dedupe_keeps_repeats_and_conflicts():
    pairs = [pair("p", "x", "y"), pair("p", "y", "x"), pair("p", "x", "y")]
    kept, counts = clean_pairs(pairs, dedupe=False)
    assert kept == pairs and counts.kept == 3 and counts.duplicates == counts.conflicting == 0


def test_clean_counts_on_shipped_data():
    expected = {  # (total, kept, ties, empty, identical, conflicting, duplicates), measured on the shipped copies
        "hh-helpful-base": (2354, 2348, 0, 4, 2, 0, 0),
        "hh-harmless-base": (2312, 2308, 0, 4, 0, 0, 0),
        "pandalm": (999, 762, 105, 52, 0, 0, 80),
        "ultrafeedback": (1200, 1059, 136, 2, 3, 0, 0),
        "pku-saferlhf": (5135, 3302, 0, 0, 0, 304, 1529),
    }
    for name, numbers in expected.items():
        _, counts = clean_pairs(load_dataset_pairs(name))
        assert tuple(counts.to_dict().values()) == numbers, name


# --- split_by_prompt --------------------------------------------------------------------------------

FRACTIONS = {"a": 0.3, "b": 0.4, "c": 0.1, "d": 0.2}


def test_split_is_deterministic_and_seed_dependent():
    pairs = toy(200)
    first, again, other = (split_by_prompt(pairs, FRACTIONS, seed) for seed in (0, 0, 1))
    assert first == again
    assert first != other


def test_split_is_prompt_disjoint_exhaustive_and_order_stable():
    pairs = clean_pairs(load_dataset_pairs("pku-saferlhf"))[0]  # up to a dozen pairs per prompt
    parts = split_by_prompt(pairs, FRACTIONS, seed=3)
    assert sum(len(v) for v in parts.values()) == len(pairs)
    names = list(parts)
    for i, x in enumerate(names):
        assert is_subsequence(parts[x], pairs)
        for y in names[i + 1:]:
            assert not prompts(parts[x]) & prompts(parts[y]), (x, y)


@pytest.mark.parametrize("n_prompts, per_prompt", [(1000, 1), (300, 4), (40, 1)])
def test_split_sizes_follow_fractions(n_prompts, per_prompt):
    pairs = toy(n_prompts, per_prompt)
    parts = split_by_prompt(pairs, FRACTIONS, seed=0)
    for name, fraction in FRACTIONS.items():
        # the cut falls at a prompt boundary: off by at most one prompt's pairs
        assert abs(len(parts[name]) - fraction * len(pairs)) <= per_prompt, name


def test_split_zero_fraction_is_empty_and_bad_fractions_raise():
    pairs = toy(50)
    assert split_by_prompt(pairs, {"train": 1.0, "unused": 0.0}, seed=0)["unused"] == []
    with pytest.raises(ValueError, match=r"sum to 1.*'x': 0.5.*'y': 0.4"):
        split_by_prompt(pairs, {"x": 0.5, "y": 0.4}, seed=0)
    with pytest.raises(ValueError, match="non-negative"):
        split_by_prompt(pairs, {"x": 1.5, "y": -0.5}, seed=0)


def test_split_does_not_depend_on_python_hash_seed():
    # Python's hash() of str changes per process; the split must not.
    code = ("from anchor_rm.data.catalog import load_dataset_pairs, dataset_digest\n"
            "from anchor_rm.data.splits import split_by_prompt\n"
            "parts = split_by_prompt(load_dataset_pairs('hh-helpful-online'), {'x': 0.5, 'y': 0.5}, seed=7)\n"
            "print(dataset_digest(parts['x']))\n")
    digests = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, check=True).stdout for seed in ("1", "2")}
    assert len(digests) == 1
    here = split_by_prompt(load_dataset_pairs("hh-helpful-online"), {"x": 0.5, "y": 0.5}, seed=7)
    assert digests == {dataset_digest(here["x"]) + "\n"}


def test_subsample_is_seeded_ordered_and_bounded():
    pairs = toy(100, 1)
    picked = subsample(pairs, 10, seed=0)
    assert len(picked) == 10 and is_subsequence(picked, pairs)
    assert picked == subsample(pairs, 10, seed=0) != subsample(pairs, 10, seed=1)
    assert subsample(pairs, 500, seed=0) == pairs


# --- the protocol -----------------------------------------------------------------------------------


def fake_loader(sizes: dict[str, int]):
    return lambda name: toy(sizes[name], 2, name)


def source_splits(splits: ProtocolSplits) -> dict[str, list[PreferencePair]]:
    return {k: getattr(splits, k) for k in ("teacher_train", "teacher_calibration", "student_train", "id_val", "id_test")}


def test_protocol_splits_are_disjoint_and_counted():
    loader = fake_loader({"src": 500, "t1": 100, "t2": 60})
    splits = build_protocol_splits("src", ["t1", "t2"], seed=0, loader=loader)
    parts = source_splits(splits)
    sizes = {k: len(v) for k, v in parts.items()}
    assert sizes == {"teacher_train": 150, "teacher_calibration": 150, "student_train": 400, "id_val": 100, "id_test": 200}
    seen: set[str] = set()
    for part in parts.values():
        assert not prompts(part) & seen
        seen |= prompts(part)
    for target in ("t1", "t2"):
        val, test = splits.ood[target]["val"], splits.ood[target]["test"]
        assert not prompts(val) & prompts(test) and len(val) + len(test) == 2 * {"t1": 100, "t2": 60}[target]
    assert splits.counts["src"]["splits"]["id_test"] == 200
    assert splits.counts["t2"]["total"] == 120 and splits.counts["t2"]["kept"] == 120
    assert build_protocol_splits("src", ["t1", "t2"], seed=0, loader=loader) == splits


def test_protocol_caps_subsample_within_each_split():
    loader = fake_loader({"src": 500, "t1": 100})
    full = build_protocol_splits("src", ["t1"], seed=4, loader=loader)
    caps = {"teacher_train": 50, "teacher_calibration": 15, "student_train": 60, "id_val": 10, "id_test": 20,
            "ood_val": 7, "ood_test": 9}
    capped = build_protocol_splits("src", ["t1"], seed=4, loader=loader, max_pairs=caps)
    for key, part in source_splits(capped).items():
        assert len(part) == caps[key] and is_subsequence(part, source_splits(full)[key])
    for half in ("val", "test"):
        assert len(capped.ood["t1"][half]) == caps[f"ood_{half}"]
        assert is_subsequence(capped.ood["t1"][half], full.ood["t1"][half])
    assert capped.counts["t1"]["splits"] == {"val": 7, "test": 9}
    for bad in ({"train": 5}, {"id_val": 0}):
        with pytest.raises(ValueError, match="max_pairs takes positive ints"):
            build_protocol_splits("src", ["t1"], seed=4, loader=loader, max_pairs=bad)


def test_protocol_rejects_empty_datasets_and_bad_arguments():
    def loader(name):
        return [pair("p", "same", "same")] if name == "dead" else toy(100, 1, name)

    with pytest.raises(DataError, match="'dead': no pair left after cleaning"):
        build_protocol_splits("src", ["dead"], seed=0, loader=loader)
    with pytest.raises(ValueError, match="sum to 1"):
        bad = (("teacher_train", 0.5), ("teacher_calibration", 0.1), ("student_train", 0.5), ("id_val", 0.1),
               ("id_test", 0.1))
        build_protocol_splits("src", ["t"], seed=0, loader=loader, source_fractions=bad)
    with pytest.raises(ValueError, match="source_fractions must name teacher_train, teacher_calibration"):
        old = (("teacher_train", 0.3), ("student_train", 0.4), ("id_val", 0.1), ("id_test", 0.2))
        build_protocol_splits("src", ["t"], seed=0, loader=loader, source_fractions=old)
    with pytest.raises(ValueError, match="exclude the source"):
        build_protocol_splits("src", ["src"], seed=0, loader=loader)
    with pytest.raises(DataError, match=r"split '\w+' is empty; the dataset has too few prompts"):
        build_protocol_splits("src", ["t"], seed=0, loader=lambda name: toy(3, 1, name))


@pytest.mark.parametrize("category", sorted(CATEGORIES))
def test_protocol_on_shipped_data(category):
    protocol = CATEGORIES[category]
    splits = build_protocol_splits(protocol["source"], protocol["targets"], seed=0)
    parts = source_splits(splits)
    total = sum(len(v) for v in parts.values())
    assert total == splits.counts[protocol["source"]]["kept"]
    assert abs(len(splits.id_test) - 0.2 * total) <= 3
    all_prompts = [prompts(v) for v in parts.values()]
    assert sum(len(p) for p in all_prompts) == len(set().union(*all_prompts))
    assert set(splits.ood) == set(protocol["targets"])
    for target in protocol["targets"]:
        assert splits.ood[target]["val"] and splits.ood[target]["test"]
        assert not prompts(splits.ood[target]["val"]) & prompts(splits.ood[target]["test"])


def test_hh_transcripts_that_share_their_first_human_turn_stay_in_one_split():
    from anchor_rm.data.splits import prompt_group

    opening = "\n\nHuman: How do I bake bread?\n\nAssistant:"
    later = [opening + f" Use flour.\n\nHuman: And then {i}?\n\nAssistant:" for i in range(40)]
    assert {prompt_group(p) for p in later + [opening]} == {"Human: How do I bake bread?"}
    assert prompt_group("  Write a poem.  ") == "Write a poem."  # not a transcript: the whole prompt
    others = [PreferencePair(f"\n\nHuman: question {i}?\n\nAssistant:", "a", "b", "t") for i in range(200)]
    pairs = [PreferencePair(p, "good", "bad", "t") for p in later] + others
    for seed in range(5):
        parts = split_by_prompt(pairs, {"train": 0.5, "test": 0.5}, seed)
        holding = [name for name, part in parts.items() if any("bake bread" in p.prompt for p in part)]
        assert len(holding) == 1, (seed, holding)


def test_target_pairs_whose_prompt_group_is_in_the_source_are_dropped_and_counted():
    source = [PreferencePair(f"\n\nHuman: q{i}?\n\nAssistant:", "good", "bad", "src") for i in range(60)]
    target = ([PreferencePair("\n\nHuman: q3?\n\nAssistant: hi\n\nHuman: more?\n\nAssistant:", "x", "y", "tgt")]
              + [PreferencePair(f"other {i}", "x", "y", "tgt") for i in range(20)])
    data = {"src": source, "tgt": target}
    splits = build_protocol_splits("src", ["tgt"], 0, loader=data.__getitem__)
    assert splits.counts["tgt"]["shared_with_source"] == 1
    assert not any("q3?" in p.prompt for part in splits.ood["tgt"].values() for p in part)


# --- the protocol read as a stream ---------------------------------------------------------------------


def in_memory_splits(source: str, targets: list[str], seed: int, caps: dict) -> ProtocolSplits:
    """What build_protocol_splits must give, composed from the list functions: everything in memory."""
    from anchor_rm.data.splits import SOURCE_FRACTIONS, prompt_group

    def capped(pairs, key, name):
        return subsample(pairs, caps[key], seed, f"{name}/{key}") if key in caps else pairs

    kept, _ = clean_pairs(load_dataset_pairs(source))
    groups = {prompt_group(p.prompt) for p in kept}
    parts = {k: capped(v, k, source) for k, v in split_by_prompt(kept, dict(SOURCE_FRACTIONS), seed).items()}
    ood = {}
    for target in targets:
        own = [p for p in clean_pairs(load_dataset_pairs(target))[0] if prompt_group(p.prompt) not in groups]
        halves = split_by_prompt(own, {"val": 0.5, "test": 0.5}, seed)
        ood[target] = {k: capped(v, f"ood_{k}", target) for k, v in halves.items()}
    return ProtocolSplits(source, parts["teacher_train"], parts["student_train"], parts["id_val"], parts["id_test"], ood,
                          teacher_calibration=parts["teacher_calibration"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("category, seed, caps", [("helpful", 0, {"student_train": 640, "id_test": 500, "ood_test": 150}),
                                                  ("harmless", 3, {"teacher_train": 150, "ood_val": 20}),
                                                  ("helpful", 1, {})])
def test_streamed_protocol_gives_the_pairs_the_in_memory_functions_give(category, seed, caps):
    source, targets = CATEGORIES[category]["source"], CATEGORIES[category]["targets"]
    streamed = build_protocol_splits(source, targets, seed, max_pairs=caps)
    expected = in_memory_splits(source, targets, seed, caps)
    for split in ("teacher_train", "teacher_calibration", "student_train", "id_val", "id_test"):
        assert getattr(streamed, split) == getattr(expected, split), split
    assert streamed.ood == expected.ood


class Counted:
    """A loader over `n` synthetic pairs, made afresh on every read, that tracks how many are alive at once."""

    def __init__(self, n: int, per_prompt: int = 2):
        import weakref

        self.n, self.per_prompt, self.alive, self.most_alive, self.reads = n, per_prompt, 0, 0, 0
        self._finalize = weakref.finalize

    def _gone(self):
        self.alive -= 1

    def __call__(self, name: str):
        self.reads += 1
        for i in range(self.n):
            p = PreferencePair(f"{name} prompt {i // self.per_prompt}", f"good answer {i}", f"bad answer {i}", name)
            self.alive += 1
            self.most_alive = max(self.most_alive, self.alive)
            self._finalize(p, self._gone)
            yield p


@pytest.mark.timeout(120)
def test_the_protocol_never_holds_a_whole_source_only_what_the_caps_keep():
    caps = {"teacher_train": 20, "teacher_calibration": 10, "student_train": 30, "id_val": 10, "id_test": 10,
            "ood_val": 5, "ood_test": 5}
    loader = Counted(20_000)
    splits = build_protocol_splits("big", ["target"], 0, max_pairs=caps, loader=loader)
    assert loader.reads == 4  # two passes over each dataset
    assert [len(splits.teacher_train), len(splits.student_train), len(splits.id_val), len(splits.id_test)] == [20, 30, 10, 10]
    assert splits.counts["big"]["total"] == splits.counts["target"]["total"] == 20_000
    # 40,000 pairs went by; at most the caps' 90 (and the two in hand: the loader's and the reader's) were
    # ever alive together.
    assert loader.most_alive <= sum(caps.values()) + 2, loader.most_alive


def test_a_source_that_changes_between_the_two_reads_is_a_data_error():
    reads = []

    def shrinking(name):
        reads.append(name)
        return toy(40 if len(reads) == 1 else 10, name=name)

    with pytest.raises(DataError, match=r"dataset 'src': 30 pairs on the second read, 120 on the first; "
                                        r"did it change while it was read\?"):
        build_protocol_splits("src", [], 0, loader=shrinking)


def test_every_dataset_pass_reports_its_progress(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="anchor_rm"):
        build_protocol_splits("hh-helpful-base", ["pandalm"], 0, max_pairs={"student_train": 40})
    lines = [r.getMessage() for r in caplog.records]
    for name in ("hh-helpful-base", "pandalm"):
        assert any(line.startswith(f"data {name}: read and clean: ") and " kept" in line for line in lines), lines
        assert any(line.startswith(f"data {name}: select the splits' pairs: ") for line in lines), lines
    assert any("student_train 40" in line for line in lines), lines


def test_progress_writes_a_line_every_interval_and_a_total(caplog):
    import logging

    from anchor_rm.data.progress import Progress

    with caplog.at_level(logging.INFO, logger="anchor_rm"):
        progress = Progress("stage", every_s=0.0)
        progress.update(3)
        progress.update(2)
        progress.close("done")
        Progress("quick", quiet_when_quick=True).close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("stage: 3 pairs so far") and lines[1].startswith("stage: 5 pairs so far"), lines
    assert lines[2].startswith("stage: 5 pairs in ") and lines[2].endswith("; done"), lines
    assert len(lines) == 3, lines


def test_the_calibration_share_comes_out_of_the_teachers_and_moves_no_student_or_evaluation_pair():
    from anchor_rm.data.splits import SOURCE_FRACTIONS

    pairs = toy(400, 3, "src")
    now = split_by_prompt(pairs, dict(SOURCE_FRACTIONS), seed=2)
    before = split_by_prompt(pairs, {"teacher_train": 0.3, "student_train": 0.4, "id_val": 0.1, "id_test": 0.2}, seed=2)
    for name in ("student_train", "id_val", "id_test"):
        assert now[name] == before[name], name
    assert sorted(now["teacher_train"] + now["teacher_calibration"], key=pairs.index) == before["teacher_train"]
    assert now["teacher_calibration"] and not prompts(now["teacher_calibration"]) & prompts(now["teacher_train"])


def test_progress_with_a_total_gives_the_share_the_rate_and_the_time_left(caplog, monkeypatch):
    import logging

    from anchor_rm.data import progress as p

    with caplog.at_level(logging.INFO, logger="anchor_rm"):
        steps = p.Progress("training", unit="steps", total=4, rate_unit="pairs", every_s=0.0)
        steps.update(rated=8, note="epoch 1/2, loss 0.6900")
        steps.update(3, rated=24)
    lines = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(r"training: 1/4 steps \(25%\), [\d.]+ pairs/s, about .+ left; epoch 1/2, loss 0.6900", lines[0])
    assert re.fullmatch(r"training: 4/4 steps \(100%\), [\d.]+ pairs/s", lines[1]), lines  # nothing left to estimate
    assert [p.duration(s) for s in (4.4, 185, 7800)] == ["4 s", "3 min 5 s", "2 h 10 min"]
    monkeypatch.setenv(p.INTERVAL_VARIABLE, "2.5")
    assert p.Progress("x").every_s == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(p.INTERVAL_VARIABLE, bad)
        with pytest.raises(ValueError, match=f"ANCHOR_RM_PROGRESS_SECONDS={bad!r}: not a number of seconds >= 0"):
            p.Progress("x")
