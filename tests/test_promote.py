"""Promotion through a real MLflow registry (a SQLite store per test, versions registered for real with
their reports): the gates, the aliases, rollback, and two promotions racing."""

from __future__ import annotations

import os
import subprocess
import threading

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from anchor_rm.evaluation import report_summary
from anchor_rm.evaluation.report import SplitResult, build_report
from anchor_rm.mlflow_edge import registry
from anchor_rm.pipeline import promotion, promotion_text
from helpers import PYTHON, ROOT, register_version, run_pipeline, sqlite_store, tiny_model_folder

NAME = registry.default_model_name("harmless")  # promote.py's default name
DIGESTS = {"hh-helpful-base/id_test": "a" * 64, "ultrafeedback/test": "b" * 64, "pandalm/test": "c" * 64,
           "hh-helpful-base/id_val": "e" * 64, "ultrafeedback/val": "f" * 64, "pandalm/val": "0" * 64}


def make_report(id_acc: float = 60.0, ood: tuple[float, ...] = (55.0, 53.0), *, teacher_id: float = 60.0,
                targets: tuple[str, ...] = ("ultrafeedback", "pandalm"), digests: dict | None = None,
                method: str = "anchor", test_ood: tuple[float, ...] | None = None, validation: bool = True,
                headline: list[str] | None = None):
    """A report whose OOD teachers score 50: validation mean NTS (what the gates read) =
    mean(ood) - 50 - max(0, teacher_id - id_acc). Its test figures are the same unless `test_ood` says."""
    def rows(split: str, accuracies, sizes):
        out = [SplitResult("hh-helpful-base", "id", split, sizes[0], teacher_id, id_acc, None, 0.0)]
        return out + [SplitResult(t, "ood", split, n, 50.0, acc, None, 0.0) for t, acc, n in zip(targets, accuracies, sizes[1:])]

    model = {"name": NAME, "student": "tiny-bert", "teacher": "tiny-teacher", "method": method, "hyperparameters": {}}
    return build_report(model, rows("test", test_ood or ood, (470, 500, 300)), selection_splits="val",
                        figure_splits="test", data_digests=DIGESTS if digests is None else digests,
                        validation_results=rows("val", ood, (300, 200, 200)) if validation else None,
                        headline_targets=headline)


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh SQLite tracking store and registry, artifacts beside it."""
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with sqlite_store(tmp_path, "promotion-tests") as uri:
        yield uri


@pytest.fixture
def model_folder(tmp_path, minilm_tokenizer):
    return tiny_model_folder(tmp_path / "model", minilm_tokenizer, max_length=64)


@pytest.fixture
def register(store, model_folder):
    """Register a new version with its report (and point `challenger` at it); returns the version."""
    return lambda report, name=NAME: register_version(model_folder, report, name)


def aliases(name: str = NAME) -> dict[str, str]:
    return promotion.read_aliases(name)


def tags(version: str, name: str = NAME) -> dict[str, str]:
    return MlflowClient().get_model_version(name, version).tags


def all_versions(name: str = NAME) -> list[str]:
    return sorted((str(mv.version) for mv in MlflowClient().search_model_versions(f"name='{name}'")), key=int)


def promote(*args, **kwargs) -> promotion.PromotionResult:
    kwargs.setdefault("settle_seconds", 0.0)
    return promotion.promote(NAME, *args, **kwargs)


def cli(store: str, *args: str, cwd) -> subprocess.CompletedProcess:
    return run_pipeline("promote.py", "--tracking-uri", store, "--settle-seconds", "0", *args, cwd=cwd,
                        env={"OMP_NUM_THREADS": "1"}, timeout=300)


# ---------------------------------------------------------------------------------------------------
# Gates.

def test_gates_are_pure_functions_of_two_reports():
    champion = promotion.VersionEvidence("1", make_report(ood=(55.0, 53.0)))  # mean NTS 4
    better, worse = make_report(ood=(56.0, 54.0)), make_report(ood=(54.0, 52.0))
    assert all(g.passed for g in promotion.judge(better, champion))
    assert all(g.passed for g in promotion.judge(make_report(ood=(55.0, 53.0)), champion))  # a tie passes
    failed = [g.name for g in promotion.judge(worse, champion) if not g.passed]
    assert failed == ["mean OOD NTS (val)"]
    # ID gate: 57.9 is more than 2 points below the teacher's 60, 58.0 is not
    assert [g.name for g in promotion.judge(make_report(id_acc=57.9), None) if not g.passed] == ["ID accuracy (val)"]
    assert all(g.passed for g in promotion.judge(make_report(id_acc=58.0), None, max_id_drop=2.0))
    # no champion: the validation rows and the ID gate
    assert [g.name for g in promotion.judge(make_report(id_acc=58.0), None)] == ["validation rows", "ID accuracy (val)"]
    assert not promotion.judge(make_report(id_acc=59.5), None, max_id_drop=0.0)[-1].passed


def test_the_champion_is_judged_over_the_candidates_headline_targets():
    """A champion registered under another headline rule averaged other targets: its validation rows give its
    mean over the candidate's."""
    # champion: ultrafeedback NTS +10, pandalm -4; mean over both +3, over ultrafeedback alone +10
    champion = promotion.VersionEvidence("1", make_report(ood=(60.0, 46.0)))
    candidate = make_report(ood=(58.0, 60.0), headline=["ultrafeedback"])  # +8 over its headline (+9 over both)
    (nts_gate,) = [g for g in promotion.judge(candidate, champion) if g.name == "mean OOD NTS (val)"]
    assert not nts_gate.passed and nts_gate.detail == ("+8.00 < +10.00 (champion v1) over the candidate's headline "
                                                       "targets ['ultrafeedback']")
    same = promotion.judge(make_report(ood=(61.0, 40.0), headline=["ultrafeedback"]),
                           promotion.VersionEvidence("1", make_report(ood=(60.0, 46.0), headline=["ultrafeedback"])))
    assert all(g.passed for g in same)
    assert [g.detail for g in same if g.name == "mean OOD NTS (val)"] == ["+11.00 >= +10.00 (champion v1)"]


def test_gates_read_validation_never_test():
    champion = promotion.VersionEvidence("1", make_report(ood=(55.0, 53.0)))  # val and test mean NTS 4
    # better on test (mean NTS 15), worse on validation (3): refused
    test_only = make_report(ood=(54.0, 52.0), test_ood=(65.0, 65.0))
    assert [g.name for g in promotion.judge(test_only, champion) if not g.passed] == ["mean OOD NTS (val)"]
    # worse on test (-5), better on validation (5): passes
    assert all(g.passed for g in promotion.judge(make_report(ood=(56.0, 54.0), test_ood=(45.0, 45.0)), champion))
    # a report without validation rows (registered before they existed) is refused, with what to do
    old = promotion.judge(make_report(validation=False), champion)
    assert [g.name for g in old] == ["validation rows"] and not old[0].passed and "--force" in old[0].detail
    # a champion without them: nothing to compare against on validation
    gates = promotion.judge(make_report(), promotion.VersionEvidence("1", make_report(validation=False)))
    assert [g.name for g in gates if not g.passed] == ["champion report"]


def test_first_promotion_needs_a_report_and_the_id_gate(register):
    v1 = register(make_report(ood=(51.0, 50.0)))
    assert aliases() == {"challenger": v1}
    result = promote()  # default: the version holding challenger
    assert result.status == "promoted" and result.decision.via_alias == "challenger"
    assert [g.name for g in result.decision.gates] == ["validation rows", "ID accuracy (val)"]
    assert aliases() == {"challenger": v1, "champion": v1}
    assert tags(v1)["promoted_from"] == "none" and "promoted_at" in tags(v1)
    assert "no champion yet" in promotion_text.format_decision(result.decision)
    assert promote().status == "already-champion"


def test_better_challenger_replaces_the_champion_and_keeps_it_reachable(register):
    v1 = register(make_report(ood=(55.0, 53.0)))
    promote(v1)
    v2 = register(make_report(ood=(57.0, 53.0)))  # mean NTS 5 > 4
    result = promote()
    assert result.status == "promoted" and result.decision.candidate.version == v2
    assert aliases() == {"challenger": v2, "champion": v2, "previous-champion": v1}
    assert tags(v2)["promoted_from"] == v1
    assert all_versions() == [v1, v2]
    text = promotion_text.format_decision(result.decision)
    assert "PASS  mean OOD NTS (val): +5.00 >= +4.00" in text and "PASS  validation splits" in text


def test_worse_challenger_is_refused_by_the_cli(register, store, tmp_path):
    v1 = register(make_report(ood=(55.0, 53.0)))
    promote(v1)
    v2 = register(make_report(ood=(54.0, 53.0), method="naive"))  # mean NTS 3.5 < 4
    result = cli(store, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    out = result.stdout
    assert f"candidate v{v2} (holds challenger) vs champion v{v1}" in out
    for row in ("val: mean OOD NTS", "val: WRG", "val: ID accuracy", "val: teacher ID accuracy", "test: mean OOD NTS",
                "test: AOG ultrafeedback", "test: AOG pandalm", "n pairs hh-helpful-base (id, val)",
                "n pairs pandalm (ood, test)", "validation splits digest"):
        assert row in out, row
    assert "FAIL  mean OOD NTS (val): +3.50 < +4.00" in out and "PASS  ID accuracy (val)" in out
    assert f"outcome: refused {NAME} v{v2}: failed mean OOD NTS (val); nothing moved" in out
    assert aliases()["champion"] == v1 and "previous-champion" not in aliases()
    assert "promoted_at" not in tags(v2)


def test_id_drop_gate_is_configurable(register):
    v1 = register(make_report(id_acc=57.0, ood=(60.0, 60.0)))  # 3 points below the teacher, big OOD gain
    result = promote()
    assert result.status == "refused" and [g.name for g in result.decision.failed_gates] == ["ID accuracy (val)"]
    assert "57.00 < 58.00" in result.decision.failed_gates[0].detail
    assert "champion" not in aliases()
    assert promote(max_id_drop=3.0).status == "promoted"
    assert aliases()["champion"] == v1


def test_report_for_other_validation_splits_is_refused_unless_forced(register):
    v1 = register(make_report())
    promote(v1)
    other = {**DIGESTS, "pandalm/val": "d" * 64}  # same datasets, other data behind one of them
    v2 = register(make_report(ood=(70.0, 70.0), digests=other))
    result = promote()
    assert result.status == "refused"
    assert [g.name for g in result.decision.failed_gates] == ["validation splits", "mean OOD NTS (val)"]
    detail = result.decision.failed_gates[0].detail
    assert "report for other validation splits" in detail
    assert report_summary.validation_splits_digest(result.decision.candidate.report) in detail
    assert report_summary.validation_splits_digest(result.decision.champion.report) in detail
    assert "ultrafeedback (ood, n=200)" in detail
    v3 = register(make_report(ood=(70.0, 70.0), targets=("ultrafeedback", "llmbar")))  # another OOD target
    assert promote().status == "refused"
    assert "llmbar" in promote(dry_run=True).decision.failed_gates[0].detail
    assert aliases()["champion"] == v1
    forced = promote(v2, force=True)
    assert forced.status == "promoted" and aliases()["champion"] == v2
    assert tags(v2)["promotion_forced"] == "validation splits; mean OOD NTS (val)"
    assert all_versions() == [v1, v2, v3]


def _register_without_report(model_folder, name: str = NAME) -> str:
    """A version whose run logged the model files but no report/ artifacts."""
    client = MlflowClient()
    if not client.search_registered_models(f"name='{name}'"):
        client.create_registered_model(name)
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(model_folder), "model")
    return str(client.create_model_version(name, f"{run.info.artifact_uri}/model", run_id=run.info.run_id).version)


def test_version_without_report_cannot_be_promoted(register, model_folder, store, tmp_path):
    v1 = register(make_report())
    promote(v1)
    bare = _register_without_report(model_folder)
    with pytest.raises(promotion.PromotionInputError, match=f"version {bare} has no report"):
        promote(bare, force=True)
    result = cli(store, "--version", bare, "--force", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {NAME} version {bare} has no report")
    assert "Traceback" not in result.stderr
    assert aliases()["champion"] == v1


def test_force_promotes_past_failed_gates_and_says_which(register):
    v1 = register(make_report(ood=(60.0, 60.0)))
    promote(v1)
    v2 = register(make_report(id_acc=50.0, ood=(51.0, 51.0)))
    result = promote(force=True)
    assert result.status == "promoted" and result.forced
    assert aliases() == {"challenger": v2, "champion": v2, "previous-champion": v1}
    text = promotion_text.format_result(result)
    assert "--force: promoting despite failed gates: mean OOD NTS (val), ID accuracy (val)" in text
    assert tags(v2)["promotion_forced"] == "mean OOD NTS (val); ID accuracy (val)"


def test_rollback_swaps_champion_and_previous_champion(register, store, tmp_path):
    v1 = register(make_report(ood=(55.0, 53.0)))
    promote(v1)
    with pytest.raises(promotion.PromotionInputError, match="nothing to roll back to"):
        promotion.rollback(NAME, settle_seconds=0)
    v2 = register(make_report(ood=(57.0, 55.0)))
    promote()
    result = cli(store, "--rollback", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"champion v{v2} -> v{v1}; previous-champion -> v{v2}" in result.stdout
    assert f"(champion v{v1}, previous-champion v{v2})" in result.stdout
    assert aliases() == {"challenger": v2, "champion": v1, "previous-champion": v2}
    assert tags(v1)["rolled_back_from"] == v2
    again = promotion.rollback(NAME, settle_seconds=0)  # a second rollback undoes the first
    assert again.status == "rolled-back" and aliases()["champion"] == v2 and aliases()["previous-champion"] == v1
    assert all_versions() == [v1, v2]


def test_dry_run_moves_nothing(register):
    v1 = register(make_report(ood=(55.0, 53.0)))
    assert promote(dry_run=True).status == "would-promote"
    assert aliases() == {"challenger": v1}
    promote(v1)
    v2 = register(make_report(ood=(50.0, 50.0)))
    assert promote(dry_run=True).status == "would-refuse"
    assert promote(dry_run=True, force=True).status == "would-promote"
    v3 = register(make_report(ood=(60.0, 60.0)))
    assert promote(v2, dry_run=True).status == "would-refuse" and promote(dry_run=True).status == "would-promote"
    rollback = promotion.rollback  # nothing to roll back to yet, dry run or not
    with pytest.raises(promotion.PromotionInputError):
        rollback(NAME, dry_run=True)
    assert aliases() == {"challenger": v3, "champion": v1}
    assert "promoted_at" not in tags(v3)


# ---------------------------------------------------------------------------------------------------
# Bad input through the CLI: one line, exit 2.

def test_cli_help_and_bad_input(register, store, tmp_path):
    helped = run_pipeline("promote.py", "--help", cwd=tmp_path, timeout=300)
    assert helped.returncode == 0
    for text in ("--name", "--version", "--category", "--max-id-drop", "--force", "--dry-run", "--rollback",
                 "--tracking-uri", "challenger", "exit status", "MLFLOW_TRACKING_URI"):
        assert text in helped.stdout, text

    empty = tmp_path / "empty"
    empty.mkdir()
    missing = run_pipeline("promote.py", cwd=empty, timeout=300)  # the default store, absent: not created
    assert missing.returncode == 2 and f"error: no MLflow database at {empty / 'mlflow.db'}" in missing.stderr
    assert not (empty / "mlflow.db").exists()

    unknown = cli(store, "--name", "no-such-model", cwd=tmp_path)
    assert unknown.returncode == 2 and "error: no registered model named 'no-such-model'" in unknown.stderr
    assert "Traceback" not in unknown.stderr

    with pytest.raises(promotion.PromotionInputError, match="no registered model"):
        promotion.decide(NAME)
    v1 = register(make_report())
    MlflowClient().delete_registered_model_alias(NAME, "challenger")
    with pytest.raises(promotion.PromotionInputError, match="holds the alias 'challenger'"):
        promotion.decide(NAME)
    with pytest.raises(promotion.PromotionInputError, match=f"{NAME} has no version 9"):
        promotion.decide(NAME, "9")
    with pytest.raises(promotion.PromotionInputError, match="must be a number"):
        promotion.decide(NAME, "latest")
    assert promotion.decide(NAME, v1).passed


# ---------------------------------------------------------------------------------------------------
# Races: the registry has no compare-and-set on aliases.

def test_champion_moved_before_writing_is_judged_again(register):
    v1 = register(make_report(ood=(55.0, 53.0)))  # NTS 4
    promote(v1)
    v2 = register(make_report(ood=(56.0, 54.0)))  # NTS 5
    decision = promotion.decide(NAME, v2)
    assert decision.passed and decision.champion.version == v1
    v3 = register(make_report(ood=(58.0, 56.0)))  # NTS 7, promoted in between
    assert promote(v3).status == "promoted"
    result = promotion.apply_promotion(decision, settle_seconds=0)
    assert result.status == "refused" and result.decision.champion.version == v3
    assert f"champion moved from v{v1} to v{v3}" in result.notes[0]
    assert aliases()["champion"] == v3 and aliases()["previous-champion"] == v1


def test_a_write_after_ours_is_detected_and_reported(register):
    v1 = register(make_report(ood=(55.0, 53.0)))
    promote(v1)
    v2 = register(make_report(ood=(56.0, 54.0)))
    v3 = register(make_report(ood=(57.0, 55.0)))
    # A writer that read the champion before our write and writes while we settle.
    stalled = lambda seconds: MlflowClient().set_registered_model_alias(NAME, "champion", v3)  # noqa: E731
    result = promote(v2, sleep=stalled)
    assert result.status == "lost-race" and result.champion == v3
    assert promotion_text.exit_code(result.status) == 3
    assert f"outcome: lost race: {NAME} v{v2} is not champion (champion v{v3}" in promotion_text.format_result(result)
    assert "promoted_at" not in tags(v2)
    # A promotion during our settle period is judged against our version, then supersedes it.
    v4 = register(make_report(ood=(59.0, 57.0)))
    inner = []
    result = promote(v2, force=True, sleep=lambda seconds: inner.append(promote(v4)))
    assert inner[0].status == "promoted" and inner[0].decision.champion.version == v2
    assert result.status == "lost-race" and aliases()["champion"] == v4 and aliases()["previous-champion"] == v2


def _assert_consistent(exit_codes: dict[str, int], outputs: dict[str, str], name: str = NAME) -> None:
    """The printed outcomes read as one serial history that ends at the final alias."""
    final = aliases(name)
    winner = final["champion"]
    assert winner in exit_codes, final
    loser = next(v for v in exit_codes if v != winner)
    assert exit_codes[winner] == 0 and f"outcome: promoted {name} v{winner}" in outputs[winner]
    if exit_codes[loser] == 0:  # promoted first, then superseded by a promotion judged against it
        assert tags(winner, name)["promoted_from"] == loser and final["previous-champion"] == loser
        assert f"outcome: promoted {name} v{loser}" in outputs[loser]
    else:
        assert exit_codes[loser] in (1, 3), exit_codes
        assert ("outcome: lost race" if exit_codes[loser] == 3 else "outcome: refused") in outputs[loser]
        assert "promoted_at" not in tags(loser, name)


def test_two_promotion_processes_racing(register, store, tmp_path):
    v1 = register(make_report(ood=(55.0, 53.0)))
    promote(v1)
    va, vb = register(make_report(ood=(56.0, 54.0))), register(make_report(ood=(57.0, 55.0)))
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    procs = {v: subprocess.Popen([PYTHON, str(ROOT / "pipelines" / "promote.py"), "--tracking-uri", store,
                                  "--version", v, "--settle-seconds", "1"],
                                 cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for v in (va, vb)}
    outputs, exit_codes = {}, {}
    for v, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert "Traceback" not in err, err[-3000:]
        outputs[v], exit_codes[v] = out, proc.returncode
    _assert_consistent(exit_codes, outputs)
    assert all_versions() == [v1, va, vb]


def _promote_in_threads(name: str, versions, settle_seconds: float, before=lambda: None) -> dict:
    """promotion.promote of each version in a thread of its own, all at once; their results by version."""
    results: dict[str, promotion.PromotionResult] = {}
    errors: list[BaseException] = []

    def run(version: str) -> None:
        try:
            before()
            results[version] = promotion.promote(name, version, settle_seconds=settle_seconds)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(v,)) for v in versions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("first", [True, False], ids=["no-champion-yet", "over-a-champion"])
def test_two_promotion_threads_racing(register, first):
    # Both create an alias row at once (champion, or previous-champion): the SQL store's select-then-insert
    # makes one insert fail on the unique key; the write is retried, and the outcome stays consistent.
    for round_ in range(3):
        name = f"race-{round_}"
        v1 = register(make_report(ood=(55.0, 53.0)), name)
        if not first:
            promotion.promote(name, v1, settle_seconds=0)
        va, vb = register(make_report(ood=(56.0, 54.0)), name), register(make_report(ood=(57.0, 55.0)), name)
        start = threading.Barrier(2)
        results = _promote_in_threads(name, (va, vb), 0.5, before=lambda: start.wait(timeout=60))
        _assert_consistent({v: promotion_text.exit_code(r.status) for v, r in results.items()},
                           {v: promotion_text.format_result(r) for v, r in results.items()}, name)


@pytest.mark.parametrize("first", [True, False], ids=["no-champion-yet", "over-a-champion"])
def test_two_promotions_that_both_read_before_either_writes(register, monkeypatch, first):
    """The race made certain: both promotions have re-read the champion (step 2) before either writes its
    aliases (a barrier in front of the write). Both were judged against the same old champion; the later
    write stands and is the only "promoted"; the earlier one reads the other's version when it verifies and
    reports "lost-race", untagged."""
    name = f"overlap-{first}"
    v1 = register(make_report(ood=(55.0, 53.0)), name)
    if not first:
        promotion.promote(name, v1, settle_seconds=0)
    va, vb = register(make_report(ood=(56.0, 54.0)), name), register(make_report(ood=(57.0, 55.0)), name)
    both_read, a_written = threading.Barrier(2), threading.Event()
    order: list[str] = []  # the order of the champion writes
    move = promotion._move_champion

    def move_after_both_read(name_, new, old, settle_seconds, sleep):
        both_read.wait(timeout=60)
        if new == va:  # a writes first: _move_champion settles (sleeps) right after its champion write
            order.append(new)
            return move(name_, new, old, settle_seconds, lambda seconds: (a_written.set(), sleep(seconds)))
        assert a_written.wait(timeout=60)  # b writes second, while a settles
        order.append(new)
        return move(name_, new, old, settle_seconds, sleep)

    monkeypatch.setattr(promotion, "_move_champion", move_after_both_read)
    results = _promote_in_threads(name, (va, vb), 1.0)
    old = None if first else v1
    assert order == [va, vb]
    assert all(r.decision.champion is None if first else r.decision.champion.version == v1 for r in results.values())
    assert results[va].status == "lost-race" and results[va].champion == vb
    assert results[vb].status == "promoted" and results[vb].champion == vb
    assert aliases(name)["champion"] == vb and aliases(name).get("previous-champion") == old
    assert "promoted_at" not in tags(va, name) and tags(vb, name)["promoted_from"] == (old or "none")
    print({v: promotion_text.format_result(r).splitlines()[0] for v, r in results.items()})
