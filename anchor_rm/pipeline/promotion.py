"""Promotion: move the registry alias `champion` to a version only when its report passes the gates.

A version is judged on the evaluation report it was registered with (registry.version_report) against the
version that holds `champion` now. The gates read the report's *validation* rows, never its test figures:
promoting again and again on test would select on test, and the test figures would then overstate what
the champion does on data nothing chose it by. The test figures are shown beside, for the record.

    report             it carries report/report.json with figures on the test splits  (--force cannot skip)
    validation rows    its report has validation rows (reports since 2026-12-01 do)
    validation splits  on the same validation data as the champion's (report_summary.validation_splits_digest)
    mean OOD NTS (val) its validation mean NTS is not below the champion's    (no champion yet: does not apply)
    ID accuracy (val)  its validation ID accuracy is at most `max_id_drop` points below the weak teacher's

Promotion points `previous-champion` at the old champion, then `champion` at the new version, and tags the
version `promoted_at` / `promoted_from`. `rollback` swaps the two aliases back. Nothing is ever deleted and
registry stages are never used.

Concurrency. The MLflow registry has no compare-and-set on aliases: setting one is a blind write and the
last writer wins. Promotion is therefore optimistic, in three steps:

1. decide   read the aliases and judge the gates against the champion (`decide`).
2. write    read `champion` again just before writing; if it moved meanwhile, judge the gates again
            against the new champion (and refuse if they now fail); then write `previous-champion` and
            `champion` (`apply_promotion`).
3. verify   wait `settle_seconds`, read `champion` back. If it no longer names our version, another
            promotion or rollback wrote after us: the result is "lost-race" (the CLI exits 3), nothing is
            tagged, and the alias as read is printed. Only a verified promotion is tagged.

A promotion whose step-2 read comes after our write is judged against our version. Two that both read the
old champion and both write within `settle_seconds` of each other: the last write stands, the other reports
lost-race, and the one standing was judged against the old champion, not against the other candidate.
Either way the printed outcomes read as one serial history that ends at the final alias. (MLflow's
SQL store creates an alias by select-then-insert, so two writers creating the same alias at once make one
fail on the unique key; that write is retried, which updates the row as a plain overwrite would.)

The window that remains: a promoter that stalls for more than `settle_seconds` between its step-2 read and
its write (a paused process, a very slow tracking server) can overwrite a promotion that has already
reported success, without having been judged against it; both then report success and both set
`previous-champion` to the champion they replaced. A longer `settle_seconds` narrows the window; the
`promoted_from` tags show it after the fact (two versions promoted from the same champion). Closing it
needs a lock or a conditional write, which the registry does not offer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Literal

from anchor_rm.evaluation.keys import (CHALLENGER, CHAMPION, PREVIOUS_CHAMPION, PROMOTED_AT_TAG, PROMOTED_FROM_TAG,
                                       PROMOTION_FORCED_TAG, REPORT_JSON, ROLLED_BACK_AT_TAG, ROLLED_BACK_FROM_TAG)
from anchor_rm.evaluation.report import EvaluationReport
from anchor_rm.evaluation.report_summary import test_splits_digest, validation_splits_digest
from anchor_rm.mlflow_edge import registry, store

DEFAULT_MAX_ID_DROP = 2.0  # points
DEFAULT_SETTLE_SECONDS = 1.0
FIGURE_SPLITS = "test"
# Accuracies are k/n*100 and NTS sums of them: a tie must pass, whatever the last bit says.
_TOLERANCE = 1e-9

Status = Literal["promoted", "would-promote", "refused", "would-refuse", "already-champion", "lost-race"]
RollbackStatus = Literal["rolled-back", "would-roll-back", "lost-race"]


class PromotionInputError(ValueError):
    """Bad input: an unknown model or version, no version holding `challenger`, a version without a
    usable report, nothing to roll back to."""


@dataclass(frozen=True)
class VersionEvidence:
    version: str
    report: EvaluationReport | None

    @property
    def digest(self) -> str | None:
        return None if self.report is None else test_splits_digest(self.report)


@dataclass(frozen=True)
class Gate:
    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class Decision:
    """A candidate judged against the champion of one moment."""

    name: str
    candidate: VersionEvidence  # always with a report on the test splits
    champion: VersionEvidence | None  # None: no version holds `champion`
    previous_champion: str | None
    gates: tuple[Gate, ...]
    max_id_drop: float
    via_alias: str | None = None  # "challenger" when the candidate was taken from that alias

    @property
    def passed(self) -> bool:
        return all(gate.passed for gate in self.gates)

    @property
    def failed_gates(self) -> list[Gate]:
        return [gate for gate in self.gates if not gate.passed]

    @property
    def already_champion(self) -> bool:
        return self.champion is not None and self.champion.version == self.candidate.version


@dataclass(frozen=True)
class PromotionResult:
    status: Status
    decision: Decision  # the decision the outcome rests on: re-judged if the champion moved before writing
    champion: str | None  # `champion` as last read (after the write, when there was one)
    previous_champion: str | None
    forced: bool = False
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class RollbackResult:
    status: RollbackStatus
    name: str
    rolled_back_from: str | None  # the champion before the rollback
    rolled_back_to: str  # the previous champion, champion again
    champion: str | None  # `champion` as last read
    previous_champion: str | None
    notes: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------------
# Gates: pure functions of two reports.

def _validation_summary(report: EvaluationReport) -> str:
    return ", ".join(f"{row.dataset} ({row.role}, n={row.n_pairs})" for row in report.validation_splits or [])


def _champion_gates(candidate: EvaluationReport, champion: VersionEvidence) -> list[Gate]:
    label, theirs = f"champion v{champion.version}", champion.report
    if theirs is None or theirs.figure_splits != FIGURE_SPLITS:
        why = "carries no report" if theirs is None else f"has figures on {theirs.figure_splits!r} splits"
        return [Gate("champion report", False, f"{label} {why}: nothing to compare against")]
    if theirs.validation is None:
        return [Gate("champion report", False,
                     f"{label}'s report has no validation rows (registered before promotion compared validation "
                     "splits): nothing to compare against on validation; promote once with --force")]
    our_digest, their_digest = validation_splits_digest(candidate), validation_splits_digest(theirs)
    ours = candidate.validation["mean_nts"]
    if our_digest != their_digest:
        their = theirs.validation["mean_nts"]
        return [
            Gate("validation splits", False,
                 f"report for other validation splits: candidate digest {our_digest} on "
                 f"{_validation_summary(candidate)}; {label} digest {their_digest} on {_validation_summary(theirs)}"),
            Gate("mean OOD NTS (val)", False, f"{ours:+.2f} vs {their:+.2f}: not comparable (different validation splits)"),
        ]
    # Both over the candidate's headline targets: a champion registered under another headline rule averaged
    # other targets, and its validation rows give its mean over these.
    their = theirs.validation_mean_nts(candidate.headline_targets)
    same_headline = sorted(candidate.headline_targets or []) == sorted(theirs.headline_targets or [])
    over = "" if same_headline else f" over the candidate's headline targets {candidate.headline_targets}"
    nts_passed = ours >= their - _TOLERANCE
    return [
        Gate("validation splits", True, f"same validation splits as {label} (digest {our_digest})"),
        Gate("mean OOD NTS (val)", nts_passed, f"{ours:+.2f} {'>=' if nts_passed else '<'} {their:+.2f} ({label}){over}"),
    ]


def judge(
    candidate: EvaluationReport,
    champion: VersionEvidence | None,
    max_id_drop: float = DEFAULT_MAX_ID_DROP,
) -> tuple[Gate, ...]:
    """The promotion gates for `candidate` against `champion` (None before the first promotion), on the
    validation rows of their reports."""
    if candidate.validation is None:
        return (Gate("validation rows", False,
                     "the candidate's report has no validation rows (registered before promotion compared "
                     "validation splits); register it again from its run, or promote with --force"),)
    gates = [Gate("validation rows", True, f"on {_validation_summary(candidate)}")]
    gates += [] if champion is None else _champion_gates(candidate, champion)
    id_row = candidate.validation_id_split
    floor = id_row.teacher_accuracy - max_id_drop
    id_passed = id_row.student_accuracy >= floor - _TOLERANCE
    gates.append(Gate(
        "ID accuracy (val)", id_passed,
        f"{id_row.student_accuracy:.2f} {'>=' if id_passed else '<'} {floor:.2f} = teacher "
        f"{id_row.teacher_accuracy:.2f} minus max ID drop {max_id_drop:g} points ({id_row.dataset}, n={id_row.n_pairs})",
    ))
    return tuple(gates)


# ---------------------------------------------------------------------------------------------------
# Reading the registry.

def read_aliases(name: str) -> dict[str, str]:
    """All aliases of `name` in one read: {alias: version}."""
    try:
        return registry.read_aliases(name)
    except store.TrackingError as exc:
        if store.not_found(exc):
            raise PromotionInputError(f"no registered model named {name!r} in this tracking store") from None
        raise


def _check_version(name: str, version: str) -> None:
    if not str(version).isdigit():
        raise PromotionInputError(f"version must be a number like 3, got {version!r}")
    try:
        status = registry.version_status(name, str(version))
    except store.TrackingError as exc:
        if store.not_found(exc):
            raise PromotionInputError(f"{name} has no version {version}") from None
        raise
    if status != "READY":
        raise PromotionInputError(f"{name} version {version} is {status}, not READY")


def _evidence(name: str, version: str) -> VersionEvidence:
    return VersionEvidence(str(version), registry.version_report(name, str(version)))


def _candidate_evidence(name: str, version: str) -> VersionEvidence:
    _check_version(name, version)
    try:
        evidence = _evidence(name, version)
    except ValueError as exc:
        raise PromotionInputError(f"{name} version {version}: its report is invalid: {exc}") from None
    if evidence.report is None:
        raise PromotionInputError(
            f"{name} version {version} has no report ({REPORT_JSON} in its run); only a version "
            f"registered with its evaluation report can be promoted"
        )
    if evidence.report.figure_splits != FIGURE_SPLITS:
        raise PromotionInputError(
            f"{name} version {version}: its report's figures are on {evidence.report.figure_splits!r} splits; "
            f"promotion compares figures on {FIGURE_SPLITS!r} splits only"
        )
    return evidence


def _champion_evidence(name: str, version: str | None) -> VersionEvidence | None:
    if version is None:
        return None
    try:
        return _evidence(name, version)
    except ValueError:  # an unreadable report: the "champion report" gate names it
        return VersionEvidence(version, None)


def decide(name: str, version: str | None = None, *, max_id_drop: float = DEFAULT_MAX_ID_DROP) -> Decision:
    """Judge `version` (default: the version holding `challenger`) against the current champion.
    Reads only; raises PromotionInputError on bad input."""
    if not math.isfinite(max_id_drop):
        raise PromotionInputError(f"max ID drop must be a finite number of points, got {max_id_drop!r}")
    aliases = read_aliases(name)
    via_alias = None
    if version is None:
        version = aliases.get(CHALLENGER)
        if version is None:
            raise PromotionInputError(
                f"no version of {name} holds the alias {CHALLENGER!r}; name one with --version"
            )
        via_alias = CHALLENGER
    candidate = _candidate_evidence(name, str(version))
    return _judged(name, candidate, aliases, max_id_drop, via_alias)


def _judged(name: str, candidate: VersionEvidence, aliases: dict[str, str], max_id_drop: float,
            via_alias: str | None) -> Decision:
    champion_version = aliases.get(CHAMPION)
    if champion_version == candidate.version:
        champion = candidate
    else:
        champion = _champion_evidence(name, champion_version)
    gates = () if champion is candidate else judge(candidate.report, champion, max_id_drop)  # type: ignore[arg-type]
    return Decision(name, candidate, champion, aliases.get(PREVIOUS_CHAMPION), gates, max_id_drop, via_alias)


# ---------------------------------------------------------------------------------------------------
# Writing: promotion and rollback.

# The SQL store sets an alias (and a tag) by select-then-insert: two writers creating the same alias at once
# make the second insert fail on the unique key (a tracking server relays the same error). The row exists
# by then, so writing again updates it: the blind overwrite the registry offers anyway.
_WRITE_CONFLICT = ("unique constraint", "integrityerror", "duplicate entry", "duplicate key", "database is locked")


def _write(action: Callable[[], object], attempts: int = 5) -> None:
    for attempt in range(attempts):
        try:
            action()
            return
        except store.TrackingError as exc:
            if attempt == attempts - 1 or not any(text in str(exc).lower() for text in _WRITE_CONFLICT):
                raise
            time.sleep(0.05 * (attempt + 1))


def _set_alias(name: str, alias: str, version: str) -> None:
    _write(lambda: registry.set_alias(name, alias, version))


def _set_tag(name: str, version: str, key: str, value: str) -> None:
    _write(lambda: registry.set_version_tag(name, version, key, value))


def _move_champion(name: str, new: str, old: str | None, settle_seconds: float,
                   sleep: Callable[[float], None]) -> tuple[str | None, str | None]:
    """champion -> `new`, previous-champion -> `old`; then, after `settle_seconds`, the aliases as they
    stand (another writer may have moved them: MLflow has no compare-and-set for aliases).

    previous-champion first: a crash between the two writes leaves both on the old champion, not a
    previous-champion that names a version which never was champion."""
    if old is not None:
        _set_alias(name, PREVIOUS_CHAMPION, old)
    _set_alias(name, CHAMPION, new)
    sleep(settle_seconds)
    after = read_aliases(name)
    return after.get(CHAMPION), after.get(PREVIOUS_CHAMPION)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def champion_of(decision: Decision) -> str | None:
    return None if decision.champion is None else decision.champion.version


def apply_promotion(
    decision: Decision,
    *,
    force: bool = False,
    settle_seconds: float = DEFAULT_SETTLE_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> PromotionResult:
    """Steps 2 and 3 of the module docstring: re-read and re-judge, write both aliases, verify."""
    name, candidate = decision.name, decision.candidate.version
    if decision.already_champion:
        return PromotionResult("already-champion", decision, candidate, decision.previous_champion)
    if not decision.passed and not force:
        return PromotionResult("refused", decision, champion_of(decision), decision.previous_champion)

    notes: list[str] = []
    aliases = read_aliases(name)
    current = aliases.get(CHAMPION)
    if current != champion_of(decision):
        notes.append(
            f"champion moved from {version_label(champion_of(decision))} to {version_label(current)} while this promotion was "
            f"deciding; the gates were judged again against {version_label(current)}"
        )
        decision = _judged(name, decision.candidate, aliases, decision.max_id_drop, decision.via_alias)
        if decision.already_champion:
            return PromotionResult("already-champion", decision, current, decision.previous_champion,
                                   notes=tuple(notes))
        if not decision.passed and not force:
            return PromotionResult("refused", decision, current, decision.previous_champion, notes=tuple(notes))

    champion_after, previous_after = _move_champion(name, candidate, current, settle_seconds, sleep)
    if champion_after != candidate:
        notes.append(
            f"another promotion or rollback moved champion to {version_label(champion_after)} after this one set it to "
            f"v{candidate}: this promotion did not stick"
        )
        return PromotionResult("lost-race", decision, champion_after, previous_after, force, tuple(notes))
    if previous_after != current:
        notes.append(f"previous-champion reads {version_label(previous_after)}, not {version_label(current)}: another promotion or "
                     f"rollback is writing at the same time")

    _set_tag(name, candidate, PROMOTED_AT_TAG, _now())
    _set_tag(name, candidate, PROMOTED_FROM_TAG, current or "none")
    if force and not decision.passed:
        _set_tag(name, candidate, PROMOTION_FORCED_TAG, "; ".join(g.name for g in decision.failed_gates))
    return PromotionResult("promoted", decision, champion_after, previous_after, force, tuple(notes))


def promote(
    name: str,
    version: str | None = None,
    *,
    max_id_drop: float = DEFAULT_MAX_ID_DROP,
    force: bool = False,
    dry_run: bool = False,
    settle_seconds: float = DEFAULT_SETTLE_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> PromotionResult:
    """Decide, then (unless `dry_run`) apply: see the module docstring."""
    decision = decide(name, version, max_id_drop=max_id_drop)
    if dry_run:
        return preview(decision, force=force)
    return apply_promotion(decision, force=force, settle_seconds=settle_seconds, sleep=sleep)


def preview(decision: Decision, *, force: bool = False) -> PromotionResult:
    """What `apply_promotion` would do against the champion the decision was judged on; writes nothing."""
    if decision.already_champion:
        status: Status = "already-champion"
    else:
        status = "would-promote" if decision.passed or force else "would-refuse"
    return PromotionResult(status, decision, champion_of(decision), decision.previous_champion, force)


def rollback(name: str, *, dry_run: bool = False, settle_seconds: float = DEFAULT_SETTLE_SECONDS,
             sleep: Callable[[float], None] = time.sleep) -> RollbackResult:
    """Point `champion` back at `previous-champion`, and `previous-champion` at the version rolled back
    from (so a second rollback undoes the first). No gates: a rollback restores a state that was live."""
    aliases = read_aliases(name)
    current, previous = aliases.get(CHAMPION), aliases.get(PREVIOUS_CHAMPION)
    if previous is None:
        raise PromotionInputError(f"{name} has no {PREVIOUS_CHAMPION!r} alias: nothing to roll back to")
    if previous == current:
        raise PromotionInputError(
            f"champion and previous-champion of {name} both name v{current}: nothing to roll back"
        )
    if dry_run:
        return RollbackResult("would-roll-back", name, current, previous, current, previous)
    champion_after, previous_after = _move_champion(name, previous, current, settle_seconds, sleep)
    if champion_after != previous:
        note = (f"another promotion or rollback moved champion to {version_label(champion_after)} after this rollback set it "
                f"to v{previous}: the rollback did not stick")
        return RollbackResult("lost-race", name, current, previous, champion_after, previous_after, (note,))
    _set_tag(name, previous, ROLLED_BACK_AT_TAG, _now())
    _set_tag(name, previous, ROLLED_BACK_FROM_TAG, current or "none")
    return RollbackResult("rolled-back", name, current, previous, champion_after, previous_after)


def version_label(version: str | None) -> str:
    return "none" if version is None else f"v{version}"
