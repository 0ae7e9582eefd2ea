"""Where the frozen reference's states live (anchor_rm/method/reference_cache.py): RAM, a memory-mapped disk cache,
or nowhere (the reference run live). Fast: a tiny BERT, no server."""

from __future__ import annotations

import pickle

import pytest
import torch

from anchor_rm.data.records import PreferencePair
from anchor_rm.method.reference_cache import (DiskReferenceStates, choose_reference_cache, compute_reference_states,
                                              estimate_reference_nbytes, open_reference_states)
from anchor_rm.method.training import TrainConfig, train_reward_model
from anchor_rm.model.encoding import RewardEncoder
from anchor_rm.model.scoring import encode_pairs

MB = 10**6


def _encoded(tokenizer, n=40):
    pairs = [PreferencePair(f"question number {i}", f"good answer {i % 7} " * (1 + i % 3), f"bad answer {i % 5}", "toy")
             for i in range(n)]
    return encode_pairs(RewardEncoder(tokenizer, 32, decoder=False), pairs)


@pytest.mark.parametrize("nbytes, budget, free, requested, expected", [
    (10 * MB, 100 * MB, None, "auto", "ram"),
    (100 * MB, 100 * MB, None, "auto", "ram"),  # the budget is inclusive
    (200 * MB, 100 * MB, 1000 * MB, "auto", "disk"),
    (200 * MB, 100 * MB, 210 * MB, "auto", "live"),  # the disk would be filled past its headroom
    (200 * MB, 100 * MB, None, "auto", "live"),  # no folder for a disk cache
    (10 * MB, 100 * MB, None, "live", "live"),  # an explicit choice is honoured
    (10**10, 1, 0, "ram", "ram"),  # even far over the budget
])
def test_the_cache_is_chosen_by_its_size_against_the_budget_and_the_disk(nbytes, budget, free, requested, expected):
    assert choose_reference_cache(nbytes, budget, free, requested) == expected


def test_an_unknown_choice_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="one of auto, ram, disk, live, not 'memory'"):
        choose_reference_cache(1, 1, None, "memory")


def test_ram_disk_and_live_give_the_same_anchor_loss_in_training(tiny_bert, minilm_tokenizer, tmp_path):
    """Two steps of ANCHOR training of the same student against each form of the same reference."""
    encoded = _encoded(minilm_tokenizer)
    pad = minilm_tokenizer.pad_token_id
    reference = tiny_bert(0).eval()
    ram = compute_reference_states(reference, encoded, [1, 2], pad, batch_size=8, precision="fp32")
    disk = compute_reference_states(reference, encoded, [1, 2], pad, batch_size=8, precision="fp32",
                                    into=tmp_path / "cache")
    assert isinstance(disk, DiskReferenceStates) and disk.kind == "disk" and ram.kind == "ram"
    assert estimate_reference_nbytes(encoded, 2, reference.config.hidden_size, 4) == ram.nbytes() == disk.nbytes()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["index.json", "layer_1.bin", "layer_2.bin"]
    for seq in (0, 17, 2 * len(encoded) - 1):
        for layer in (1, 2):
            assert torch.equal(ram.row(layer, seq), disk.row(layer, seq))

    losses = {}
    for name, ref in (("ram", ram), ("disk", pickle.loads(pickle.dumps(disk))), ("live", reference)):
        student = tiny_bert(1)  # another initialisation: the anchor term is far from zero
        config = TrainConfig(method="anchor", anchor_lambda=0.5, anchor_layers="last", epochs=1, batch_size=8,
                             learning_rate=1e-3, precision="fp32", seed=0)
        logs = []
        train_reward_model(student, encoded, [0.8] * len(encoded), config, reference=ref, pad_token_id=pad,
                           on_step=logs.append)
        losses[name] = [log.anchor_loss for log in logs]
    assert losses["ram"][0] > 1e-3
    assert losses["disk"] == losses["ram"]  # the same fp32 values, read from the file
    assert losses["live"] == pytest.approx(losses["ram"], rel=1e-5)  # recomputed each step: rounding only


def test_a_disk_cache_is_written_once_and_reused_and_pickles_small(tiny_bert, minilm_tokenizer, tmp_path):
    encoded = _encoded(minilm_tokenizer)
    pad = minilm_tokenizer.pad_token_id
    folder = tmp_path / "cache"
    first = compute_reference_states(tiny_bert(0), encoded, [2], pad, precision="fp32", into=folder)
    written = (folder / "layer_2.bin").stat().st_mtime_ns
    again = compute_reference_states(tiny_bert(0), encoded, [2], pad, precision="fp32", into=folder)
    assert (folder / "layer_2.bin").stat().st_mtime_ns == written and again.digest == first.digest
    assert not (tmp_path / "cache.partial").exists()
    assert len(pickle.dumps(again)) < 10_000 < first.nbytes()  # the folder and offsets travel, not the states
    other = compute_reference_states(tiny_bert(0), _encoded(minilm_tokenizer, 30), [2], pad, precision="fp32", into=folder)
    assert other.digest != first.digest and other.num_pairs == 30  # other sequences: computed again
    half = compute_reference_states(tiny_bert(0), _encoded(minilm_tokenizer, 30), [2], pad, precision="bf16", into=folder)
    assert half.dtype == "float16" and half.nbytes() * 2 == other.nbytes()
    (folder / "index.json").write_text("{not json")  # damaged: named when opened, computed again over it
    with pytest.raises(ValueError, match=f"{folder / 'index.json'}: not a reference cache index"):
        open_reference_states(folder)
    rebuilt = compute_reference_states(tiny_bert(0), encoded, [2], pad, precision="fp32", into=folder)
    assert rebuilt.digest == first.digest and torch.equal(rebuilt.row(2, 3), first.row(2, 3))
    assert not (tmp_path / "cache.retired").exists()


def test_a_disk_cache_of_another_model_or_with_a_file_cut_short_is_computed_again(tiny_bert, minilm_tokenizer, tmp_path):
    """The key holds the reference's weights (a student of the same tokenizer and depth under a reused --name
    must not read another model's states), and a layer file whose removal or writing was cut short is no cache."""
    encoded = _encoded(minilm_tokenizer)
    pad = minilm_tokenizer.pad_token_id
    folder = tmp_path / "cache"
    first = compute_reference_states(tiny_bert(0), encoded, [2], pad, precision="fp32", into=folder).row(2, 3).clone()
    other = compute_reference_states(tiny_bert(1), encoded, [2], pad, precision="fp32", into=folder)
    assert not torch.equal(other.row(2, 3), first)  # computed again, by the other model
    written = (folder / "layer_2.bin").stat().st_mtime_ns
    again = compute_reference_states(tiny_bert(1), encoded, [2], pad, precision="fp32", into=folder)
    assert (folder / "layer_2.bin").stat().st_mtime_ns == written  # the same model: reused
    expected = again.row(2, 3).clone()
    with open(folder / "layer_2.bin", "r+b") as f:
        f.truncate(100)
    rebuilt = compute_reference_states(tiny_bert(1), encoded, [2], pad, precision="fp32", into=folder)
    assert (folder / "layer_2.bin").stat().st_size > 100 and torch.equal(rebuilt.row(2, 3), expected)


@pytest.mark.parametrize("text, expected", [("500MB", 500 * MB), ("2GB", 2 * 10**9), ("1.5GiB", int(1.5 * 2**30)),
                                            ("1024", 1024), ("64 kib", 65536)])
def test_the_budget_flag_reads_sizes_and_refuses_what_is_not_one(text, expected):
    import argparse

    from anchor_rm.cli import common

    assert common.byte_size(text) == expected
    with pytest.raises(argparse.ArgumentTypeError, match="not a size: '2 parsecs'"):
        common.byte_size("2 parsecs")
