"""The preference-shift study: drift measurement, bf16 scoring, selection on validation, tables, and the
resumable pipeline."""

import json
import math

import mlflow
import numpy as np
import pytest
import torch

from anchor_rm.data.records import PreferencePair
from anchor_rm.model.encoding import RewardEncoder
from anchor_rm.model.reward_model import RewardModel
from anchor_rm.model.scoring import RewardScorer, encode_pairs
from helpers import run_pipeline


def _pairs(n=24):
    return [PreferencePair(f"question number {i}", f"good answer {i % 7} " * (1 + i % 3), f"bad answer {i % 5}", "toy")
            for i in range(n)]


def _rm(model, tokenizer, max_length=32):
    return RewardModel(model, tokenizer, RewardEncoder(tokenizer, max_length, decoder=False), "tiny")


def test_drift_is_zero_for_the_reference_itself_and_grows_with_perturbation(tiny_bert, minilm_tokenizer):
    from anchor_rm.evaluation.scores import evaluate_pairs
    from anchor_rm.method.drift import evaluate_with_drift, evaluation_reference

    pairs = _pairs()
    reference = tiny_bert(0).eval()
    rm = _rm(tiny_bert(0), minilm_tokenizer)
    states = evaluation_reference(reference, rm, pairs, [1, 2], batch_size=5)
    score, drift = evaluate_with_drift(rm, pairs, states, {"last": [2], "both": [1, 2]}, batch_size=7)
    assert score == evaluate_pairs(rm, pairs, 7)  # the same scoring pass, the same accuracy
    assert len(score.correct) == score.n_pairs and set(score.correct) <= {"0", "1"}  # per-pair outcomes
    assert 100 * score.correct.count("1") / score.n_pairs == pytest.approx(score.accuracy)
    assert drift["last"].msd == pytest.approx(0.0, abs=1e-6) and drift["last"].cosine == pytest.approx(1.0, abs=1e-5)
    assert drift["both"].n_sequences == 2 * len(pairs)

    with torch.no_grad():
        for p in rm.model.bert.encoder.layer[1].parameters():
            p.add_(0.05 * torch.randn_like(p))
    _, moved = evaluate_with_drift(rm, pairs, states, {"first": [1], "last": [2]})
    assert moved["first"].msd == pytest.approx(0.0, abs=1e-6)  # layer 1's output did not change
    assert moved["last"].msd > 1e-4 and moved["last"].cosine < 1.0


def test_drift_refuses_states_of_other_pairs(tiny_bert, minilm_tokenizer):
    from anchor_rm.method.drift import evaluate_with_drift, evaluation_reference

    rm = _rm(tiny_bert(0), minilm_tokenizer)
    states = evaluation_reference(tiny_bert(0), rm, _pairs(24), [2])
    with pytest.raises(ValueError, match="other pairs"):
        evaluate_with_drift(rm, _pairs(20), states, {"last": [2]})
    with pytest.raises(ValueError, match="not \\[1\\]"):
        evaluate_with_drift(rm, _pairs(24), states, {"first": [1]})


def test_bf16_scoring_is_close_to_fp32_and_the_hook_sees_every_sequence(tiny_bert, minilm_tokenizer):
    encoder = RewardEncoder(minilm_tokenizer, 32, decoder=False)
    encoded = encode_pairs(encoder, _pairs())
    model = tiny_bert(3)
    seen = []
    fp32 = RewardScorer(model, encoder, batch_size=5, precision="fp32").score_pairs(encoded, lambda idx, hs, mask: seen.extend(idx))
    bf16 = RewardScorer(model, encoder, batch_size=5, precision="bf16").score_pairs(encoded)
    assert sorted(seen) == list(range(2 * len(encoded)))
    np.testing.assert_allclose(bf16[0], fp32[0], atol=0.05)
    assert not np.array_equal(bf16[0], fp32[0])  # it really ran in bf16


def _instance(seed: int, val_nts_by_lambda: dict, test_acc_by_lambda: dict) -> dict:
    """A synthetic protocol instance: teacher at 60 everywhere; ANCHOR students whose validation and test
    accuracies on the OOD target are given per lambda."""
    teacher = {"val": {"src": _s(60), "ood": _s(60)}, "test": {"src": _s(60), "ood": _s(60)}}
    students = [{"setting": "naive", "method": "naive", "anchor_lambda": 0.0, "anchor_layers": None,
                 "confidence_alpha": None, "val": {"src": _s(61), "ood": _s(60)}, "test": {"src": _s(61), "ood": _s(59)},
                 "drift": _drift(0.3)},
                {"setting": "confidence alpha=0.75", "method": "confidence", "anchor_lambda": 0.0, "anchor_layers": None,
                 "confidence_alpha": 0.75, "val": {"src": _s(61), "ood": _s(59)}, "test": {"src": _s(61), "ood": _s(58)},
                 "drift": _drift(0.4)}]
    for lam, val_nts in val_nts_by_lambda.items():
        students.append({"setting": f"anchor last lambda={lam:g}", "method": "anchor", "anchor_lambda": lam,
                         "anchor_layers": "last", "confidence_alpha": None,
                         "val": {"src": _s(60), "ood": _s(60 + val_nts)},
                         "test": {"src": _s(60), "ood": _s(test_acc_by_lambda[lam])}, "drift": _drift(0.1 / (1 + lam))})
    return {"category": "helpful", "seed": seed, "source": "src", "targets": ["ood"], "student": "s", "teacher": "t",
            "teacher_scores": teacher, "ceiling_scores": {"test": {"src": _s(66), "ood": _s(62)}}, "students": students}


def _s(acc: float) -> dict:
    return {"accuracy": acc, "n_pairs": 100, "tie_rate": 0.0, "identical_after_truncation": 0}


def _drift(msd: float) -> dict:
    return {"ood": {"last": {"msd": msd, "cosine": 0.9, "n_sequences": 200},
                    "middle": {"msd": msd / 2, "cosine": 0.95, "n_sequences": 200}}}


def test_tuned_rows_select_on_validation_never_on_test(tmp_path):
    from anchor_rm.pipeline.study_report import write_study_report
    from anchor_rm.pipeline.study_tables import rows_for

    # Validation prefers lambda 1e-3; test would prefer 1e-1. The tuned row must report 1e-3's test figures.
    instances = [_instance(seed, {1e-3: 4.0, 1e-1: 1.0}, {1e-3: 61.0 + seed, 1e-1: 70.0}) for seed in (0, 1)]
    rows = {label: (per_seed, chosen) for label, per_seed, chosen in rows_for(instances)}
    per_seed, chosen = rows["ANCHOR last (lambda tuned on val)"]
    assert chosen == ["anchor last lambda=0.001"] * 2
    assert [m["mean_nts"] for m in per_seed] == [1.0, 2.0]  # test AOG 1 and 2, no ID loss
    assert rows["ANCHOR last, lambda 0.1"][0][0]["mean_nts"] == 10.0
    assert rows["naive W2S"][0][0]["wrg"] == 1.0 and rows["naive W2S"][0][0]["ood_drop"] == 2.0
    assert rows["weak teacher"][0][0]["id_acc"] == 60.0
    assert math.isclose(rows["naive W2S"][0][0]["pgr"], 1 / 6)

    paths = write_study_report(instances, tmp_path)
    text = (tmp_path / "tables.md").read_text()
    assert "| ANCHOR last (lambda tuned on val) | 60.0 ± 0.0 (100) | +0.0 ± 0.0 | +1.5 ± 0.7 | +1.50 ± 0.71 |" in text
    assert "anchor last lambda=0.001; anchor last lambda=0.001" in text
    assert "ANCHOR last (lambda tuned on val) minus naive W2S, mean_nts: +2.50 (per seed +2.00, +3.00; SE 0.50, 95% CI -3.85 to +8.85) -> within noise" in text
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)


def test_study_settings_put_every_method_on_the_chosen_labels_and_the_other_labels_on_naive_only():
    from anchor_rm.method.training import TrainConfig
    from anchor_rm.pipeline.study import StudyConfig, budget_settings, setting_label, student_settings

    study = StudyConfig(categories=["harmless"], seeds=[0], lambdas=[1e-3], layer_choices=["last"],
                        confidence_alphas=[0.5], teacher_labels=["raw", "calibrated"], budgets=[(1e-4, 2), (3e-4, 1)],
                        precision="fp32")
    base = TrainConfig(learning_rate=3e-4, epochs=1)
    searched = budget_settings(study, base)
    assert [(t.teacher_labels, t.learning_rate, t.epochs, t.method) for t in searched] == [
        ("raw", 1e-4, 2, "naive"), ("raw", 3e-4, 1, "naive"), ("calibrated", 1e-4, 2, "naive"), ("calibrated", 3e-4, 1, "naive")]
    # the search chose calibrated labels at 3e-4/1; raw labels did best at 1e-4/2: its naive row keeps that budget
    settings = student_settings(study, base, "calibrated", {"raw": searched[0], "calibrated": searched[3]})
    assert [setting_label(t, "calibrated") for t in settings] == [
        "naive", "naive, raw teacher labels", "confidence alpha=0.5", "anchor last lambda=0.001"]
    assert settings[0].to_dict() == searched[3].to_dict()  # the same inputs: the search's run is reused
    assert settings[1].to_dict() == searched[0].to_dict()
    assert {t.teacher_labels for t in settings[2:]} == {"calibrated"} and {t.learning_rate for t in settings[2:]} == {3e-4}
    # without a search: the first labels (by default the preset's: calibrated) train every method at the base budget
    plain = student_settings(StudyConfig(categories=["harmless"], lambdas=[], confidence_alphas=[], precision="fp32"), base)
    assert [(t.method, t.teacher_labels, t.learning_rate) for t in plain] == [("naive", "calibrated", 3e-4), ("naive", "raw", 3e-4)]
    for bad, match in (({"teacher_labels": ["raw", "raw"]}, "teacher labels must be distinct"),
                       ({"teacher_labels": ["hard"]}, "among raw, calibrated"),
                       ({"budgets": [(0.0, 2)]}, "budgets must be distinct"),
                       ({"budgets": [(1e-4, 2), (1e-4, 2)]}, "budgets must be distinct")):
        with pytest.raises(ValueError, match=match):
            StudyConfig(categories=["harmless"], precision="fp32", **bad)


def test_label_rows_compare_naive_on_raw_and_scaled_labels_and_the_teacher_table_shows_the_temperature(tmp_path):
    from anchor_rm.pipeline.study_report import write_study_report
    from anchor_rm.pipeline.study_tables import rows_for

    instances = [_instance(seed, {1e-3: 4.0}, {1e-3: 61.0}) for seed in (0, 1)]
    for inst in instances:
        inst["teacher_labels"] = "calibrated"
        for s in inst["students"]:
            s["teacher_labels"] = "calibrated"
        raw = {**inst["students"][0], "setting": "naive, raw teacher labels", "teacher_labels": "raw",
               "test": {"src": _s(58), "ood": _s(57)}}
        inst["students"].insert(1, raw)
        inst["teacher_calibration"] = {"ece": 0.08, "mean_margin": 0.02, "temperature_fit": {"temperature": 0.2, "n_pairs": 494},
                                       "calibrated": {"ece": 0.03, "mean_margin": 0.09}}
        inst["budget"] = {"learning_rate": 1e-4, "epochs": 2, "searched": [
            {"teacher_labels": "raw", "learning_rate": 1e-4, "epochs": 2, "val_id_acc": 60.0},
            {"teacher_labels": "calibrated", "learning_rate": 1e-4, "epochs": 2, "val_id_acc": 61.0}]}
    rows = {label: per_seed for label, per_seed, _ in rows_for(instances)}
    assert rows["naive W2S"][0]["id_acc"] == 61.0  # the chosen labels' naive student, not the raw one
    assert rows["naive W2S, raw teacher labels"][0]["id_acc"] == 58.0
    assert rows["naive W2S, calibrated teacher labels"][0]["id_acc"] == 61.0
    assert rows["ANCHOR last (lambda tuned on val)"][0]["id_acc"] == 60.0
    write_study_report(instances, tmp_path)
    text = (tmp_path / "tables.md").read_text()
    assert "| 0 | 0.2 (494) | 0.080 -> 0.030 | 0.020 -> 0.090 | calibrated | 0.0001, 2 (raw 0.0001/2: 60.0; calibrated 0.0001/2: 61.0) |" in text
    assert "- naive W2S, calibrated teacher labels minus naive W2S, raw teacher labels, id_acc: +3.00" in text
    assert ("mean over the seeds: calibrated 0.0001/2: 61.00; raw 0.0001/2: 60.00. Validation prefers calibrated "
            "labels at learning rate 0.0001, 2 epochs.") in text


@pytest.mark.slow
def test_study_pipeline_runs_logs_and_resumes(tmp_path):
    args = ["--preset", "smoke", "--categories", "harmless", "--seeds", "0", "--lambdas", "1e-2", "--layers", "last",
            "--confidence-alphas", "0.75", "--budgets", "1e-4:1,3e-4:1", "--out", str(tmp_path / "out"),
            "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"]
    first = run_pipeline("study.py", *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "[8/8] harmless seed 0 anchor last lambda=0.01" in first.stdout
    data = json.loads((tmp_path / "out" / "study.json").read_text())
    (instance,) = data["instances"]
    # the budget search: naive W2S on raw and on calibrated labels at each budget; the best on validation ID
    # accuracy trains every method, and the other labels' naive row keeps its own best budget
    searched = instance["budget"]["searched"]
    assert [(b["teacher_labels"], b["learning_rate"]) for b in searched] == [
        ("raw", 1e-4), ("raw", 3e-4), ("calibrated", 1e-4), ("calibrated", 3e-4)]
    best = max(searched, key=lambda b: (b["val_id_acc"], -searched.index(b)))
    main, other = best["teacher_labels"], {"raw": "calibrated", "calibrated": "raw"}[best["teacher_labels"]]
    assert instance["teacher_labels"] == main and instance["budget"]["learning_rate"] == best["learning_rate"]
    assert f"{main} teacher labels, lr={best['learning_rate']:g}, epochs=1" in first.stdout
    assert [s["setting"] for s in instance["students"]] == ["naive", f"naive, {other} teacher labels",
                                                            "confidence alpha=0.75", "anchor last lambda=0.01"]
    assert instance["students"][0]["run_id"] == best["run_id"]  # the search's run, reused
    assert first.stdout.count("reused a finished run") == 2
    assert [s["teacher_labels"] for s in instance["students"]] == [main, other, main, main]
    # the teacher's calibration, its temperature and why each target is flagged, per seed (smoke splits are all
    # under headline size)
    calibration = instance["teacher_calibration"]
    assert calibration["dataset"] == "pku-saferlhf" and calibration["split"] == "val"
    assert calibration["temperature_fit"]["split"] == "teacher_calibration" and calibration["temperature_fit"]["temperature"] > 0
    assert calibration["calibrated"]["accuracy"] == calibration["accuracy"]  # scaling keeps the ranking
    assert set(instance["target_flags"]) == {"hh-harmless-base", "safetext", "hhh-harmless", "diasafety",
                                             "xstest-harmful", "xstest-overrefusal"}
    assert instance["headline_note"].startswith("no target has headline size")
    for s in instance["students"]:
        assert set(s["test"]) == {"hh-harmless-base", "safetext", "pku-saferlhf", "hhh-harmless", "diasafety",
                                  "xstest-harmful", "xstest-overrefusal"}
        assert set(s["drift"]["pku-saferlhf"]) == {"last", "middle"}
    assert (tmp_path / "out" / "tables.md").exists() and (tmp_path / "out" / "nts_vs_lambda.png").exists()

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["anchor-rm-study"], filter_string="tags.`anchor_rm.stage` = 'study-student'")
    assert len(runs) == 6 and set(runs["status"]) == {"FINISHED"}
    assert "metrics.drift/last/msd/pku-saferlhf" in runs.columns

    # the finished instance is recorded with the key of its inputs and where it was computed
    record = tmp_path / "out" / "instances" / "harmless-seed0.json"
    assert json.loads(record.read_text())["instance"] == instance
    assert instance["provenance"]["how"] == "computed" and instance["provenance"]["machine"]
    record.unlink()

    again = run_pipeline("study.py", *args, cwd=tmp_path)  # resumed from MLflow: nothing is trained twice
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("reused a finished run") == 8 and "training" not in again.stderr
    assert len(mlflow.search_runs(experiment_names=["anchor-rm-study"])) == len(runs) + 3  # + data, teacher, ceiling
    rerun = json.loads((tmp_path / "out" / "study.json").read_text())["instances"]
    assert [{**i, "provenance": None} for i in rerun] == [{**i, "provenance": None} for i in data["instances"]]
    assert record.exists()

    # another machine: an empty MLflow store, the instance record (committed, copied) read back, nothing trained
    elsewhere = [*args[:-1], f"sqlite:///{tmp_path}/elsewhere.db"]
    third = run_pipeline("study.py", *elsewhere, cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "[8/8] harmless seed 0: reused the finished instance" in third.stdout and "training" not in third.stderr
    assert json.loads((tmp_path / "out" / "study.json").read_text())["instances"] == rerun
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/elsewhere.db")
    assert len(mlflow.search_runs(experiment_names=["anchor-rm-study"])) == 0

    # a study that extends this one into another folder adopts its instance (same settings and split sizes)
    extended = [*elsewhere[:elsewhere.index("--out")], "--out", str(tmp_path / "out2"), *elsewhere[elsewhere.index("--out") + 2:],
                "--adopt", str(tmp_path / "out" / "study.json")]
    fourth = run_pipeline("study.py", *extended, cwd=tmp_path)
    assert fourth.returncode == 0, fourth.stderr[-3000:]
    assert "[8/8] harmless seed 0: adopted from" in fourth.stdout and "training" not in fourth.stderr
    (adopted,) = json.loads((tmp_path / "out2" / "study.json").read_text())["instances"]
    assert adopted["provenance"]["how"].startswith("adopted from") and adopted["provenance"]["earlier"]["how"] == "computed"
    assert {**adopted, "provenance": None} == {**rerun[0], "provenance": None}
    assert (tmp_path / "out2" / "instances" / "harmless-seed0.json").exists()


def test_instance_records_are_keyed_by_their_inputs_and_a_bad_one_is_named(tmp_path):
    from anchor_rm.pipeline.study import instance_path, read_instance, write_instance

    path = instance_path(tmp_path, "harmless", 3)
    assert path == tmp_path / "instances" / "harmless-seed3.json" and read_instance(path, "k1") is None
    write_instance(path, "k1", {"seed": 3, "students": []})
    assert read_instance(path, "k1") == {"seed": 3, "students": []}
    assert read_instance(path, "k2") is None  # other inputs: computed again
    assert [p.name for p in path.parent.iterdir()] == ["harmless-seed3.json"]  # no temporary file left
    path.write_text('{"key": "k1", "instance": ')
    with pytest.raises(ValueError, match=r"harmless-seed3.json: not a study instance record \(line 1"):
        read_instance(path, "k1")
    path.write_text('{"seed": 3}')
    with pytest.raises(ValueError, match="no 'key' and 'instance'"):
        read_instance(path, "k1")


def test_an_instance_key_follows_its_data_training_and_settings():
    from anchor_rm.pipeline.study import StudyConfig, instance_key, protocol_for

    study = StudyConfig(categories=["harmless"], seeds=[0], lambdas=[1e-3], precision="fp32")
    cfg, digests = protocol_for(study, "harmless", 0), {"pku-saferlhf/id_test": "d1"}
    key = instance_key(study, cfg, digests)
    assert instance_key(study, protocol_for(study, "harmless", 0), dict(digests)) == key
    assert instance_key(study, cfg, {"pku-saferlhf/id_test": "d2"}) != key  # other data
    slower = protocol_for(study, "harmless", 0)
    slower.student_train.learning_rate *= 3
    assert instance_key(study, slower, digests) != key  # other training
    assert instance_key(StudyConfig(categories=["harmless"], seeds=[0], lambdas=[1e-2], precision="fp32"), cfg, digests) != key
    gated = protocol_for(study, "harmless", 0)
    gated.min_gap = 5.0  # the study applies no gap gate: not part of what an instance depends on
    assert instance_key(study, gated, digests) == key


def test_an_earlier_instance_is_adopted_only_with_the_same_settings_and_split_sizes():
    from anchor_rm.pipeline.study import StudyConfig, adoptable

    study = StudyConfig(categories=["harmless"], seeds=[0, 1, 5], lambdas=[1e-3], budgets=[(1e-4, 2)], precision="fp32")
    sizes = {"pku-saferlhf": {"id_test": 661}, "safetext": {"test": 400}}
    earlier = {"config": json.loads(json.dumps({**study.to_dict(), "seeds": [0, 1]})),  # as read from study.json
               "instances": [{"category": "harmless", "seed": 0, "split_sizes": sizes, "students": []},
                             {"category": "harmless", "seed": 1, "split_sizes": {**sizes, "safetext": {"test": 399}}}]}
    instance, why = adoptable(earlier, study, "harmless", 0, sizes)
    assert instance is earlier["instances"][0] and why == "same settings and split sizes"
    assert adoptable(earlier, study, "harmless", 1, sizes) == (None, "other split sizes")
    assert adoptable(earlier, study, "harmless", 5, sizes) == (None, "no harmless seed 5")
    assert adoptable(earlier, study, "helpful", 0, sizes) == (None, "no helpful seed 0")
    typed_otherwise = StudyConfig(categories=["harmless"], seeds=[0], lambdas=[0.001], budgets=[(1e-4, 2)],
                                  confidence_alphas=[0.5, 0.75], precision="fp32")
    assert adoptable(earlier, typed_otherwise, "harmless", 0, sizes)[0] is instance
    assert StudyConfig(lambdas=[10], confidence_alphas=[1]).settings() == StudyConfig(lambdas=[10.0], confidence_alphas=[1.0]).settings()
    other = StudyConfig(categories=["harmless"], seeds=[0], lambdas=[1e-3, 1e-2], confidence_alphas=[0.5], precision="fp32")
    assert adoptable(earlier, other, "harmless", 0, sizes) == (None, "other study settings (budgets, confidence_alphas, lambdas)")


def test_study_cli_names_bad_arguments(tmp_path):
    bad = run_pipeline("study.py", "--lambdas", "0,1e-3", "--out", str(tmp_path / "o"),
                       "--tracking-uri", f"sqlite:///{tmp_path}/m.db", cwd=tmp_path)
    assert bad.returncode == 2 and "lambdas must be > 0" in bad.stderr
    bad = run_pipeline("study.py", "--seeds", "a", cwd=tmp_path)
    assert bad.returncode == 2 and "comma-separated integers" in bad.stderr
    assert not (tmp_path / "o").exists()  # refused before anything was written
    (tmp_path / "old.json").write_text('{"config": {}, "instances": ')
    bad = run_pipeline("study.py", "--adopt", str(tmp_path / "old.json"), "--out", str(tmp_path / "o"),
                       "--tracking-uri", f"sqlite:///{tmp_path}/m.db", cwd=tmp_path)
    assert bad.returncode == 2 and f"--adopt {tmp_path / 'old.json'}: not JSON (line 1" in bad.stderr
    bad = run_pipeline("study.py", "--adopt", str(tmp_path / "none.json"), "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert bad.returncode == 2 and "none.json: cannot read it (No such file or directory)" in bad.stderr
    assert not (tmp_path / "o").exists()


def _bits(accuracy_points: int, n: int = 100) -> str:
    return "1" * accuracy_points + "0" * (n - accuracy_points)


def test_paired_bootstrap_resamples_pairs_for_both_models_alike():
    from anchor_rm.pipeline.study_tables import paired_bootstrap

    inst = _instance(0, {1e-3: 4.0}, {1e-3: 70.0})
    naive, anchor = inst["students"][0], inst["students"][2]
    for student in (naive, anchor):
        for name, score in student["test"].items():
            score["correct"] = _bits(int(score["accuracy"]))
    observed, low, high = paired_bootstrap(inst, anchor, naive)
    # anchor: ID 60 (teacher 60), OOD 70 -> NTS 10; naive: ID 61, OOD 59 -> NTS -1
    assert math.isclose(observed, 11.0)
    assert low < observed < high and low > 0  # 11 points on 100 pairs, paired: clearly above zero
    same = paired_bootstrap(inst, naive, naive)
    assert same == (0.0, 0.0, 0.0)  # one model against itself: every resample gives 0
    del naive["test"]["ood"]["correct"]
    assert paired_bootstrap(inst, anchor, naive) is None  # scores stored before per-pair outcomes existed


def test_the_primary_comparison_is_written_first_with_its_bootstrap(tmp_path):
    from anchor_rm.pipeline.study_report import write_study_report

    instances = [_instance(seed, {1e-3: 4.0}, {1e-3: 61.0 + seed}) for seed in (0, 1)]
    for inst in instances:
        for student in inst["students"]:
            for score in student["test"].values():
                score["correct"] = _bits(int(score["accuracy"]))
    write_study_report(instances, tmp_path)
    text = (tmp_path / "tables.md").read_text()
    primary = text.index("the primary comparison (fixed before the run)")
    assert primary < text.index("paired comparisons (per seed")
    assert "  - seed 0: +2.00, paired bootstrap over test pairs (2,000 resamples) 95% interval" in text


def test_the_gap_table_marks_each_seed_by_its_ceiling_over_teacher_interval_and_names_flagged_targets(tmp_path):
    from anchor_rm.pipeline.study_report import write_study_report
    from anchor_rm.pipeline.study_tables import gap_table, id_gap

    clear, unclear = _instance(0, {1e-3: 4.0}, {1e-3: 61.0}), _instance(1, {1e-3: 4.0}, {1e-3: 61.0})
    # Seed 0, paired: the ceiling gets right every pair the teacher does and 6 more of 100: +6, SE 2.39 -> clear.
    clear["teacher_scores"]["test"]["src"]["correct"] = _bits(60)
    clear["ceiling_scores"]["test"]["src"] = {**_s(66), "correct": _bits(66)}
    gap, low, high = id_gap(clear)
    assert math.isclose(gap, 6.0) and math.isclose(high - gap, 1.96 * 100 * math.sqrt(0.06 * 0.94 * 100 / 99) / 10)
    assert low > 0
    # Seed 1, no per-pair outcomes: the two binomial errors, 60 and 66 of 100: +6 within noise.
    gap, low, high = id_gap(unclear)
    assert math.isclose(gap, 6.0) and low < 0 < high
    unclear["headline_targets"] = ["ood"]  # the fallback: every target of headline size, with a note
    unclear["headline_note"] = "no target of headline size shows a clear transfer signal"
    unclear["target_flags"] = {"ood": "no clear transfer signal: the strong ceiling scores 55.0 on its 100 validation pairs"}
    lines = gap_table([clear, unclear])
    assert lines[2].startswith("| 0 | 60.0 (100) | 66.0 | +6.0 (+1.3 to +10.7) | clear | ood | - |")
    assert "| within noise | ood (no target of headline size shows a clear transfer signal) | ood: no clear transfer" in lines[3]
    assert lines[-1] == ("The gap is clear (its 95% interval above zero) on 1 of 2 seeds; on seed(s) 1 this category's "
                         "weak-to-strong rows stand on a protocol without a clear gap.")
    del clear["ceiling_scores"]
    assert id_gap(clear) is None and "| 0 | 60.0 (100) | - | - | - |" in gap_table([clear])[2]
    write_study_report([unclear], tmp_path)
    assert "### helpful: the weak-to-strong gap and the headline, per seed" in (tmp_path / "tables.md").read_text()


def test_a_decoder_students_options_are_settings_only_when_set_and_reach_its_protocol():
    """Studies recorded before the student's options existed compare equal (their settings lack them); a decoder
    study's options key it and reach the student's TrainConfig."""
    from anchor_rm.pipeline.study import StudyConfig, protocol_for

    plain = StudyConfig(categories=["harmless"], seeds=[0], precision="fp32")
    assert not {"student", "lora_rank", "lora_alpha", "lora_learning_rate", "activation_checkpointing"} & set(plain.settings())
    decoder = StudyConfig(categories=["harmless"], seeds=[0], precision="fp32", student="smollm2-135m", lora_rank=16,
                          lora_alpha=32.0, lora_learning_rate=1e-3)
    assert decoder.settings()["student"] == "smollm2-135m" and decoder.settings()["lora_rank"] == 16
    cfg = protocol_for(decoder, "harmless", 0)
    assert cfg.student == "smollm2-135m" and cfg.student_train.lora_rank == 16
    assert cfg.student_train.lora_alpha == 32.0 and cfg.student_train.lora_learning_rate == 1e-3
    assert protocol_for(plain, "harmless", 0).student == "minilm-l6"


def test_the_t_quantile_is_students_at_any_degrees_of_freedom():
    from anchor_rm.pipeline.study_tables import t95

    assert t95(1) == pytest.approx(12.706, abs=1e-3) and t95(9) == pytest.approx(2.262, abs=1e-3)
    assert t95(29) == pytest.approx(2.045, abs=1e-3)  # past 9 the old table said 2.0
