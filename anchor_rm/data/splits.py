"""Cleaning and prompt-disjoint splits, and the whole source/target protocol built from them.

Splits are by prompt, never by pair: HH, PKU-SafeRLHF and PandaLM have several pairs per prompt, and a
pair-level split would put the same prompt in training and test. For multi-turn HH transcripts the unit is
the first human turn, not the whole transcript: 289 of HH helpful-base's 2,348 pairs share their opening
question with another pair whose later turns differ, and would otherwise straddle splits. Assignment hashes
(seed, group) with sha256, so it is the same on every machine and Python run (Python's hash() is salted).

`build_protocol_splits` reads each dataset twice as a stream (catalog.iter_dataset_pairs) and never holds a
whole source: the first pass keeps, per pair, only digests of its texts and of its prompt group (cleaning,
de-duplication and the split are decided on those); the second keeps the pairs each capped split selects.
Memory grows with the number of pairs by about 0.3 kB each, not with their text (bench/large_source.py).
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import asdict, dataclass, field
from collections.abc import Callable, Iterable, Mapping, Sequence

from anchor_rm.data.catalog import iter_dataset_pairs
from anchor_rm.data.progress import Progress
from anchor_rm.data.records import DataError, PreferencePair

# Shares of the source's pairs by prompt group, cut in this order. teacher_calibration is gold data of the
# teacher's share that the teacher does not train on and no student sees: the temperature of its soft labels is
# fitted there (metrics.fit_temperature). Half of the teacher's share: the teacher trains on the other half, and one
# temperature fitted on 160 pairs moved by chance from 0.3 to 1,000. Placed right after
# teacher_train, it leaves the cuts of student_train, id_val and id_test where they were when the teacher's
# share was 0.3.
SOURCE_FRACTIONS = (("teacher_train", 0.15), ("teacher_calibration", 0.15), ("student_train", 0.4), ("id_val", 0.1),
                    ("id_test", 0.2))


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


def _digest(*texts: str) -> bytes:
    """16 bytes standing for the texts (JSON framing: no two different tuples give the same input)."""
    return hashlib.blake2b(json.dumps(texts, ensure_ascii=False).encode("utf-8"), digest_size=16).digest()


def _drop_reason(pair: PreferencePair) -> str | None:
    """The CleanCounts field a pair that carries no usable preference is counted under; None when usable."""
    prompt, chosen, rejected = _key(pair)
    if pair.metadata.get("tie"):
        return "ties"
    if not (prompt and chosen and rejected):
        return "empty"
    if chosen == rejected:
        return "identical"
    return None


def _pair_digests(pair: PreferencePair) -> tuple[bytes, bytes]:
    """(the pair's digest, the digest of the same pair reversed)."""
    prompt, chosen, rejected = _key(pair)
    return _digest(prompt, chosen, rejected), _digest(prompt, rejected, chosen)


def _dedupe(digests: Sequence[tuple[bytes, bytes]]) -> tuple[list[int], int, int]:
    """(positions kept, conflicting, duplicates): a pair whose reverse also occurs is dropped (both ways), a
    repeat after its first occurrence too."""
    present = {forward for forward, _ in digests}
    kept, seen, conflicting, duplicates = [], set(), 0, 0
    for i, (forward, reverse) in enumerate(digests):
        if reverse in present:
            conflicting += 1
        elif forward in seen:
            duplicates += 1
        else:
            seen.add(forward)
            kept.append(i)
    return kept, conflicting, duplicates


def clean_pairs(pairs: Sequence[PreferencePair], *, dedupe: bool = True) -> tuple[list[PreferencePair], CleanCounts]:
    """Drops pairs that carry no usable preference and counts each reason (first reason wins, in field order).

    dedupe=False keeps repeated and contradicting pairs (PKU-SafeRLHF and PandaLM have many: PandaLM's
    models often produced the very same text, so different model pairs collapse to one text pair).
    """
    counts = CleanCounts(total=len(pairs), kept=0, ties=0, empty=0, identical=0)
    candidates = []
    for pair in pairs:
        reason = _drop_reason(pair)
        if reason is None:
            candidates.append(pair)
        else:
            setattr(counts, reason, getattr(counts, reason) + 1)
    if dedupe:
        kept, counts.conflicting, counts.duplicates = _dedupe([_pair_digests(p) for p in candidates])
        candidates = [candidates[i] for i in kept]
    counts.kept = len(candidates)
    return candidates, counts


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


def _slots(groups: Sequence[bytes], group_hash: Mapping[bytes, float], fractions: Mapping[str, float]) -> list[str]:
    """The split of each pair, from its prompt group's digest and each group's seeded hash: groups in hash
    order, cut where the running pair count crosses each fraction."""
    _check_fractions(fractions)
    members: dict[bytes, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    order = sorted(members, key=lambda group: (group_hash[group], group))
    names, bounds, running = list(fractions), [], 0.0
    for name in names:
        running += fractions[name]
        bounds.append(running * len(groups))
    slots: list[str] = [""] * len(groups)
    done = 0
    for group in order:
        size = len(members[group])
        middle = done + size / 2  # a prompt goes where the middle of its pairs falls
        slot = next((k for k, bound in enumerate(bounds) if middle < bound), len(names) - 1)
        for i in members[group]:
            slots[i] = names[slot]
        done += size
    return slots


def split_by_prompt(pairs: Sequence[PreferencePair], fractions: Mapping[str, float],
                    seed: int) -> dict[str, list[PreferencePair]]:
    """Prompt-disjoint split whose sizes follow `fractions` in pairs; pairs keep their input order.

    Prompt groups (`prompt_group`: the first human turn of a transcript) are shuffled by hash(seed, group)
    and cut where the running pair count crosses each fraction: exact proportions even for a few dozen
    prompts, where independent per-prompt draws would not be.
    """
    groups, group_hash = [], {}
    for pair in pairs:
        group = prompt_group(pair.prompt)
        digest = _digest(group)
        group_hash.setdefault(digest, _unit_hash(seed, group))
        groups.append(digest)
    out: dict[str, list[PreferencePair]] = {name: [] for name in fractions}
    for pair, slot in zip(pairs, _slots(groups, group_hash, fractions)):
        out[slot].append(pair)
    return out


def _rank_key(pair: PreferencePair, seed: int, salt: str) -> float:
    return _unit_hash(seed, salt, *_key(pair))


def subsample(pairs: Sequence[PreferencePair], n: int, seed: int, salt: str = "") -> list[PreferencePair]:
    """At most n pairs, chosen by hash(seed, salt, text); keeps input order. Used only after splitting."""
    if len(pairs) <= n:
        return list(pairs)
    ranked = sorted(range(len(pairs)), key=lambda i: (_rank_key(pairs[i], seed, salt), i))
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
    # Gold pairs for the teacher's temperature (SOURCE_FRACTIONS): never trained on, by teacher or student.
    teacher_calibration: list[PreferencePair] = field(default_factory=list)


@dataclass
class _Scan:
    """What the first pass keeps of a dataset's pairs that survive cleaning: no text, only where each is in
    the stream and its prompt group."""

    counts: CleanCounts
    positions: list[int]  # in the stream
    groups: list[bytes]  # the prompt group's digest
    group_hash: dict[bytes, float]  # hash(seed, group) of every group


def _scan(name: str, pairs: Iterable[PreferencePair], seed: int) -> _Scan:
    """First pass: cleaning (clean_pairs' rules) and the prompt groups, holding digests, not texts."""
    progress = Progress(f"data {name}: read and clean")
    counts = CleanCounts(total=0, kept=0, ties=0, empty=0, identical=0)
    positions, digests, groups, group_hash = [], [], [], {}
    for position, pair in enumerate(pairs):
        counts.total += 1
        progress.update()
        reason = _drop_reason(pair)
        if reason is not None:
            setattr(counts, reason, getattr(counts, reason) + 1)
            continue
        group = prompt_group(pair.prompt)
        digest = _digest(group)
        group_hash.setdefault(digest, _unit_hash(seed, group))
        positions.append(position)
        digests.append(_pair_digests(pair))
        groups.append(digest)
    kept, counts.conflicting, counts.duplicates = _dedupe(digests)
    counts.kept = len(kept)
    progress.close(f"{counts.kept:,} kept")
    if not kept:
        raise DataError(f"dataset {name!r}: no pair left after cleaning ({counts.to_dict()})")
    kept_groups = [groups[i] for i in kept]
    return _Scan(counts, [positions[i] for i in kept], kept_groups,
                 {g: group_hash[g] for g in set(kept_groups)})


def _select(name: str, pairs: Iterable[PreferencePair], total: int, slots: Mapping[int, str],
            caps: Mapping[str, tuple[str, int]], seed: int) -> dict[str, list[PreferencePair]]:
    """Second pass: each split's pairs (`slots`: stream position -> split), a capped split only its `n` pairs
    of lowest hash(seed, salt, text), as `subsample` picks them, held in a heap of n while the stream goes by.
    `total`: the pairs the first read gave."""
    progress = Progress(f"data {name}: select the splits' pairs")
    chosen: dict[str, list] = {split: [] for split in dict.fromkeys(slots.values())}
    seen = 0
    for position, pair in enumerate(pairs):
        seen += 1
        progress.update()
        split = slots.get(position)
        if split is None:
            continue
        if split not in caps:
            chosen[split].append((position, pair))
            continue
        salt, n = caps[split]
        item = (-_rank_key(pair, seed, salt), -position, pair)  # the heap's top: the worst kept so far
        heap = chosen[split]
        if len(heap) < n:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)
    if seen != total:  # the positions of the first read would point at other pairs
        raise DataError(f"dataset {name!r}: {seen} pairs on the second read, {total} on the first; did it change "
                        "while it was read?")
    out = {}
    for split, items in chosen.items():  # back in stream order
        positioned = items if split not in caps else [(-negated, pair) for _, negated, pair in items]
        out[split] = [pair for _, pair in sorted(positioned, key=lambda item: item[0])]
    progress.close(", ".join(f"{split} {len(v):,}" for split, v in out.items()))
    return out


def build_protocol_splits(source: str, targets: Sequence[str], seed: int, *,
                          source_fractions: Sequence[tuple[str, float]] = SOURCE_FRACTIONS,
                          ood_val_fraction: float = 0.5,
                          max_pairs: Mapping[str, int] | None = None,
                          loader: Callable[[str], Iterable[PreferencePair]] = iter_dataset_pairs) -> ProtocolSplits:
    """Source -> teacher_train / teacher_calibration / student_train / id_val / id_test; each target -> val / test.

    The teacher and the student train on disjoint prompts, so the student never sees the teacher's own
    training pairs. Tuning selects on id_val and OOD val; test splits are for the final report only.
    `max_pairs` caps a split (a source split's name, ood_val or ood_test) by a
    seeded subsample taken after splitting, so a cap never moves a prompt across splits. `loader(name)` is
    called twice per dataset (two passes over it) and must give the same pairs in the same order each time.
    """
    fractions, required = dict(source_fractions), [name for name, _ in SOURCE_FRACTIONS]
    if set(fractions) != set(required):
        raise ValueError(f"source_fractions must name {', '.join(required)}; got {sorted(fractions)}")
    _check_fractions(fractions)
    if not 0 < ood_val_fraction < 1:
        raise ValueError(f"ood_val_fraction must lie strictly between 0 and 1, got {ood_val_fraction}")
    if source in targets or len(set(targets)) != len(targets):
        raise ValueError(f"targets must be distinct and exclude the source {source!r}, got {list(targets)}")
    caps = dict(max_pairs or {})
    unknown = set(caps) - set(fractions) - {"ood_val", "ood_test"}
    if unknown or any(not isinstance(n, int) or n < 1 for n in caps.values()):
        raise ValueError(f"max_pairs takes positive ints for {required + ['ood_val', 'ood_test']}; got {caps}")

    def split(name: str, scan: _Scan, halves: Mapping[str, float], cap_key: Callable[[str], str]) -> dict[str, list]:
        slots = _slots(scan.groups, scan.group_hash, halves)
        split_caps = {k: (f"{name}/{cap_key(k)}", caps[cap_key(k)]) for k in halves if cap_key(k) in caps}
        parts = _select(name, loader(name), scan.counts.total, dict(zip(scan.positions, slots)), split_caps, seed)
        for k in halves:
            if not parts.get(k):
                raise DataError(f"dataset {name!r}: split {cap_key(k)!r} is empty; the dataset has too few prompts")
        return {k: parts[k] for k in halves}

    counts: dict[str, dict] = {}
    scan = _scan(source, loader(source), seed)
    source_groups = set(scan.groups)
    parts = split(source, scan, fractions, lambda k: k)
    counts[source] = {**scan.counts.to_dict(), "splits": {k: len(v) for k, v in parts.items()}}
    ood = {}
    for target in targets:
        scan = _scan(target, loader(target), seed)
        # A target pair whose prompt group the source also has is not out of distribution: drop it.
        own = [i for i, group in enumerate(scan.groups) if group not in source_groups]
        shared = len(scan.groups) - len(own)
        if not own:
            raise DataError(f"dataset {target!r}: every prompt also occurs in the source {source!r}")
        scan = _Scan(scan.counts, [scan.positions[i] for i in own], [scan.groups[i] for i in own], scan.group_hash)
        ood[target] = split(target, scan, {"val": ood_val_fraction, "test": 1 - ood_val_fraction}, lambda k: f"ood_{k}")
        counts[target] = {**scan.counts.to_dict(), "shared_with_source": shared,
                          "splits": {k: len(v) for k, v in ood[target].items()}}
    return ProtocolSplits(source, parts["teacher_train"], parts["student_train"], parts["id_val"], parts["id_test"],
                          ood, counts, teacher_calibration=parts["teacher_calibration"])
