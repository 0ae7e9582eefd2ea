"""What promote.py prints: the candidate and the champion side by side, one PASS/FAIL line per gate, the
outcome, and the exit status (anchor_rm/pipeline/promotion.py decides; this module only says it)."""

from __future__ import annotations

from anchor_rm.evaluation.report_summary import validation_splits_digest
from anchor_rm.pipeline.promotion import (Decision, PromotionResult, RollbackResult, VersionEvidence, champion_of,
                                          version_label)


def _figures(evidence: VersionEvidence | None) -> list[dict[str, str]]:
    """One version's column of the comparison table, in groups: headline, AOG per target, pairs, identity."""
    report = None if evidence is None else evidence.report
    if report is None:
        return [{}, {}, {}, {}, {}]
    id_row, val = report.id_split, report.validation
    gated = {} if val is None else {
        "val: mean OOD NTS": f"{val['mean_nts']:+.2f}", "val: WRG": f"{val['wrg']:+.2f}",
        "val: ID accuracy": f"{report.validation_id_split.student_accuracy:.2f}",
        "val: teacher ID accuracy": f"{report.validation_id_split.teacher_accuracy:.2f}"}
    return [
        gated,
        {"test: mean OOD NTS": f"{report.mean_nts:+.2f}", "test: WRG": f"{report.wrg:+.2f}",
         "test: ID accuracy": f"{id_row.student_accuracy:.2f}", "test: teacher ID accuracy": f"{id_row.teacher_accuracy:.2f}"},
        {f"test: AOG {target}": f"{value:+.2f}" for target, value in report.aog.items()},
        {f"n pairs {row.dataset} ({row.role}, {row.split})": str(row.n_pairs)
         for row in [*(report.validation_splits or []), *report.splits]},
        {"method": str(report.model.get("method")),
         "validation splits digest": validation_splits_digest(report) or "-",
         "test splits digest": evidence.digest or "-"},
    ]


def comparison_rows(decision: Decision) -> list[tuple[str, str, str]]:
    """(figure, candidate, champion) rows of the comparison table; "-" where a side has no such figure."""
    rows = []
    for ours, theirs in zip(_figures(decision.candidate), _figures(decision.champion), strict=True):
        rows += [(key, ours.get(key, "-"), theirs.get(key, "-")) for key in dict.fromkeys([*ours, *theirs])]
    return rows


def format_decision(decision: Decision) -> str:
    """The comparison table and one PASS/FAIL line per gate."""
    source = f" (holds {decision.via_alias})" if decision.via_alias else ""
    champion = decision.champion
    champion_label = f"champion {version_label(champion_of(decision))}"
    lines = [f"{decision.name}: candidate v{decision.candidate.version}{source} vs {champion_label}"]
    if champion is None:
        lines.append("no champion yet: the first promotion needs a report and the ID gate only")
    elif champion.report is None:
        lines.append(f"champion v{champion.version} has no readable report")
    header = ("", f"candidate v{decision.candidate.version}", champion_label)
    rows = [header, *comparison_rows(decision)]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines.append("")
    for row in rows:
        lines.append(f"  {row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}".rstrip())
    if decision.already_champion:
        lines += ["", f"gates: not judged (v{decision.candidate.version} already holds champion)"]
        return "\n".join(lines)
    lines += ["", "gates:"]
    lines += [f"  {'PASS' if gate.passed else 'FAIL'}  {gate.name}: {gate.detail}" for gate in decision.gates]
    return "\n".join(lines)


def _aliases(result: PromotionResult | RollbackResult) -> str:
    return f"(champion {version_label(result.champion)}, previous-champion {version_label(result.previous_champion)})"


def format_result(result: PromotionResult) -> str:
    """What happened, ending with one `outcome:` line."""
    decision = result.decision
    name, candidate = decision.name, decision.candidate.version
    lines = [f"note: {note}" for note in result.notes]
    failed = ", ".join(gate.name for gate in decision.failed_gates)
    if result.forced and failed and result.status in ("promoted", "would-promote", "lost-race"):
        lines.append(f"--force: promoting despite failed gates: {failed}")
    outcomes = {
        "promoted": f"promoted {name} v{candidate}",
        "would-promote": f"dry run: would promote {name} v{candidate}; nothing moved",
        "refused": f"refused {name} v{candidate}: failed {failed}; nothing moved",
        "would-refuse": f"dry run: would refuse {name} v{candidate}: failed {failed}; nothing moved",
        "already-champion": f"{name} v{candidate} already holds champion; nothing moved",
        "lost-race": f"lost race: {name} v{candidate} is not champion",
    }
    return "\n".join([*lines, f"outcome: {outcomes[result.status]} {_aliases(result)}"])


def format_rollback(result: RollbackResult) -> str:
    old = version_label(result.rolled_back_from)
    move = f"champion {old} -> v{result.rolled_back_to}; previous-champion -> {old}"
    outcomes = {
        "rolled-back": f"rolled back {result.name}: {move}",
        "would-roll-back": f"dry run: would roll back {result.name}: {move}; nothing moved",
        "lost-race": f"lost race: {result.name} champion is not v{result.rolled_back_to}",
    }
    return "\n".join([*(f"note: {note}" for note in result.notes), f"outcome: {outcomes[result.status]} {_aliases(result)}"])


def exit_code(status: str) -> int:
    """0: promoted / would promote / already champion / rolled back; 1: a gate refused; 3: lost a race."""
    if status in ("refused", "would-refuse"):
        return 1
    if status == "lost-race":
        return 3
    return 0

