"""Cleaning and prompt-disjoint splits, and the whole source/target protocol built from them.

Splits are by prompt, never by pair: HH, PKU-SafeRLHF and PandaLM have several pairs per prompt, and a
pair-level split would put the same prompt in training and test. For multi-turn HH transcripts the unit is
the first human turn, not the whole transcript: 289 of HH helpful-base's 2,348 pairs share their opening
question with another pair whose later turns differ, and would otherwise straddle splits. Assignment hashes
(seed, group) with sha256, so it is the same on every machine and Python run (Python's hash() is salted).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from collections.abc import Callable, Mapping, Sequence

from anchor_rm.catalog import load_dataset_pairs
from anchor_rm.data import DataError, PreferencePair

SOURCE_FRACTIONS = (("teacher_train", 0.3), ("student_train", 0.4), ("id_val", 0.1), ("id_test", 0.2))


@dataclass
class CleanCounts:
    total: int
    kept: int
    ties: int  # the label states no preference (metadata "tie")
    empty: int  # prompt, chosen or rejected empty or whitespace
    identical: int  # chosen == rejected after strip
    conflicting: int = 0  # the same pair also appears reversed: the labels contradict each other
    duplicates: int = 0  # an exact repeat of an earlier pair: it would only reweight, and inflate the size

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _key(pair: PreferencePair) -> tuple[str, str, str]:
    return pair.prompt.strip(), pair.chosen.strip(), pair.rejected.strip()


def clean_pairs(pairs: Sequence[PreferencePair], *, dedupe: bool = True) -> tuple[list[PreferencePair], CleanCounts]:
    """Drops pairs that carry no usable preference and counts each reason (first reason wins, in field order).

    dedupe=False keeps repeated and contradicting pairs (PKU-SafeRLHF and PandaLM have many: PandaLM's
    models often produced the very same text, so different model pairs collapse to one text pair).
    """
    counts = CleanCounts(total=len(pairs), kept=0, ties=0, empty=0, identical=0)
    candidates = []
    for pair in pairs:
        prompt, chosen, rejected = _key(pair)
        if pair.metadata.get("tie"):
            counts.ties += 1
        elif not (prompt and chosen and rejected):
            counts.empty += 1
        elif chosen == rejected:
            counts.identical += 1
        else:
            candidates.append(pair)
    if not dedupe:
        counts.kept = len(candidates)
        return candidates, counts
    present = {_key(p) for p in candidates}
    kept, seen = [], set()
    for pair in candidates:
        prompt, chosen, rejected = key = _key(pair)
        if (prompt, rejected, chosen) in present:
            counts.conflicting += 1
        elif key in seen:
            counts.duplicates += 1
        else:
            seen.add(key)
            kept.append(pair)
    counts.kept = len(kept)
    return kept, counts


HUMAN_TURN, ASSISTANT_TURN = "Human:", "\n\nAssistant:"


def prompt_group(prompt: str) -> str:
    """What a split keeps together: the first human turn of an HH-style transcript, else the whole prompt."""
    text = prompt.strip()
    if text.startswith(HUMAN_TURN):
        return text.split(ASSISTANT_TURN, 1)[0].strip()
    return text


def _unit_hash(*parts: object) -> float:
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _check_fractions(fractions: Mapping[str, float]) -> None:
    if not fractions or any(f < 0 for f in fractions.values()) or abs(sum(fractions.values()) - 1.0) > 1e-6:
        raise ValueError(f"split fractions must be non-negative and sum to 1, got {dict(fractions)} "
                         f"(sum {sum(fractions.values()):.6g})")


def split_by_prompt(pairs: Sequence[PreferencePair], fractions: Mapping[str, float],
                    seed: int) -> dict[str, list[PreferencePair]]:
    """Prompt-disjoint split whose sizes follow `fractions` in pairs; pairs keep their input order.

    Prompt groups (`prompt_group`: the first human turn of a transcript) are shuffled by hash(seed, group)
    and cut where the running pair count crosses each fraction: exact proportions even for a few dozen
    prompts, where independent per-prompt draws would not be.
    """
    _check_fractions(fractions)
    groups: dict[str, list[int]] = {}
    for i, pair in enumerate(pairs):
        groups.setdefault(prompt_group(pair.prompt), []).append(i)
    order = sorted(groups, key=lambda prompt: (_unit_hash(seed, prompt), prompt))
    names, bounds, running = list(fractions), [], 0.0
    for name in names:
        running += fractions[name]
        bounds.append(running * len(pairs))
    assignment, done = {}, 0
    for prompt in order:
        size = len(groups[prompt])
        middle = done + size / 2  # a prompt goes where the middle of its pairs falls
        slot = next((k for k, bound in enumerate(bounds) if middle < bound), len(names) - 1)
        for i in groups[prompt]:
            assignment[i] = names[slot]
        done += size
    out: dict[str, list[PreferencePair]] = {name: [] for name in names}
    for i, pair in enumerate(pairs):
        out[assignment[i]].append(pair)
    return out


def subsample(pairs: Sequence[PreferencePair], n: int, seed: int, salt: str = "") -> list[PreferencePair]:
    """At most n pairs, chosen by hash(seed, salt, text); keeps input order. Used only after splitting."""
    if len(pairs) <= n:
        return list(pairs)
    ranked = sorted(range(len(pairs)), key=lambda i: (_unit_hash(seed, salt, *_key(pairs[i])), i))
    return [pairs[i] for i in sorted(ranked[:n])]


@dataclass
class ProtocolSplits:
    source: str
    teacher_train: list[PreferencePair]
    student_train: list[PreferencePair]
    id_val: list[PreferencePair]
    id_test: list[PreferencePair]
    ood: dict[str, dict[str, list[PreferencePair]]]  # target -> {"val": [...], "test": [...]}
    counts: dict[str, dict] = field(default_factory=dict)  # dataset -> cleaning counts + "splits" sizes


def _clean(name: str, pairs: list[PreferencePair]) -> tuple[list[PreferencePair], CleanCounts]:
    kept, counts = clean_pairs(pairs)
    if not kept:
        raise DataError(f"dataset {name!r}: no pair left after cleaning ({counts.to_dict()})")
    return kept, counts


def build_protocol_splits(source: str, targets: Sequence[str], seed: int, *,
                          source_fractions: Sequence[tuple[str, float]] = SOURCE_FRACTIONS,
                          ood_val_fraction: float = 0.5,
                          max_pairs: Mapping[str, int] | None = None,
                          loader: Callable[[str], list[PreferencePair]] = load_dataset_pairs) -> ProtocolSplits:
    """Source -> teacher_train / student_train / id_val / id_test; each target -> val / test.

    The teacher and the student train on disjoint prompts, so the student never sees the teacher's own
    training pairs. Tuning selects on id_val and OOD val; test splits are for the final report only.
    `max_pairs` caps a split (keys teacher_train, student_train, id_val, id_test, ood_val, ood_test) by a
    seeded subsample taken after splitting, so a cap never moves a prompt across splits.
    """
    fractions, required = dict(source_fractions), [name for name, _ in SOURCE_FRACTIONS]
    if set(fractions) != set(required):
        raise ValueError(f"source_fractions must name {', '.join(required)}; got {sorted(fractions)}")
    if not 0 < ood_val_fraction < 1:
        raise ValueError(f"ood_val_fraction must lie strictly between 0 and 1, got {ood_val_fraction}")
    if source in targets or len(set(targets)) != len(targets):
        raise ValueError(f"targets must be distinct and exclude the source {source!r}, got {list(targets)}")
    caps = dict(max_pairs or {})
    unknown = set(caps) - set(fractions) - {"ood_val", "ood_test"}
    if unknown or any(not isinstance(n, int) or n < 1 for n in caps.values()):
        raise ValueError(f"max_pairs takes positive ints for {required + ['ood_val', 'ood_test']}; got {caps}")

    def capped(pairs: list[PreferencePair], key: str, name: str) -> list[PreferencePair]:
        if not pairs:
            raise DataError(f"dataset {name!r}: split {key!r} is empty; the dataset has too few prompts")
        return subsample(pairs, caps[key], seed, f"{name}/{key}") if key in caps else pairs

    counts: dict[str, dict] = {}
    kept, clean = _clean(source, loader(source))
    source_groups = {prompt_group(pair.prompt) for pair in kept}
    parts = {k: capped(v, k, source) for k, v in split_by_prompt(kept, fractions, seed).items()}
    counts[source] = {**clean.to_dict(), "splits": {k: len(v) for k, v in parts.items()}}
    ood = {}
    for target in targets:
        kept, clean = _clean(target, loader(target))
        # A target pair whose prompt group the source also has is not out of distribution: drop it.
        shared = [pair for pair in kept if prompt_group(pair.prompt) in source_groups]
        if shared:
            kept = [pair for pair in kept if prompt_group(pair.prompt) not in source_groups]
            if not kept:
                raise DataError(f"dataset {target!r}: every prompt also occurs in the source {source!r}")
        halves = split_by_prompt(kept, {"val": ood_val_fraction, "test": 1 - ood_val_fraction}, seed)
        ood[target] = {k: capped(v, f"ood_{k}", target) for k, v in halves.items()}
        counts[target] = {**clean.to_dict(), "shared_with_source": len(shared),
                          "splits": {k: len(v) for k, v in ood[target].items()}}
    return ProtocolSplits(source, parts["teacher_train"], parts["student_train"], parts["id_val"], parts["id_test"],
                          ood, counts)
