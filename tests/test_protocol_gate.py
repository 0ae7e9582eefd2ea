"""The weak-to-strong gate and the headline targets, decided on validation from the shared stages."""

from __future__ import annotations

import pytest

from anchor_rm.data.records import PreferencePair
from anchor_rm.data.splits import ProtocolSplits
from anchor_rm.mlflow_edge.runs import StageRun
from anchor_rm.pipeline.experiment import SharedStages


def _scores(**accuracies) -> dict:
    return {name.replace("_", "-"): {"accuracy": acc, "n_pairs": 400, "tie_rate": 0.0, "identical_after_truncation": 0}
            for name, acc in accuracies.items()}


def _pairs(n: int, name: str) -> list[PreferencePair]:
    return [PreferencePair(f"prompt {i}", "a", "b", name) for i in range(n)]


def _shared(teacher_val: dict, ceiling_val: dict | None, test_sizes: dict | None = None) -> SharedStages:
    test_sizes = test_sizes or {}
    ood = {name: {"val": _pairs(200, name), "test": _pairs(test_sizes.get(name, 400), name)}
           for name in ("ultrafeedback", "llmbar", "pandalm")}
    splits = ProtocolSplits("hh-helpful", [], [], [], [], ood)
    teacher = StageRun("t", {"scores": {"val": teacher_val, "test": teacher_val}}, False)
    ceiling = None if ceiling_val is None else StageRun("c", {"scores": {"val": ceiling_val, "test": ceiling_val}}, False)
    return SharedStages(splits, StageRun("d", {}, False), teacher, ceiling)


@pytest.mark.timeout(60)
def test_the_gate_stops_with_what_it_measured_and_what_to_change():
    teacher = _scores(hh_helpful=58.0, ultrafeedback=55.0, llmbar=45.0, pandalm=60.0)
    shared = _shared(teacher, _scores(hh_helpful=60.5, ultrafeedback=61.0, llmbar=41.0, pandalm=62.0))
    assert shared.gap() == pytest.approx(2.5)
    shared.check_gap(2.5)  # at the threshold: passes
    with pytest.raises(ValueError) as info:
        shared.check_gap(5.0)
    message = str(info.value)
    assert "on hh-helpful ID validation (400 pairs) the strong ceiling scores 60.5 and the weak teacher 58.0" in message
    assert "gap of +2.5 points, under --min-gap 5" in message and "Make the teacher weaker" in message
    _shared(teacher, None).check_gap(5.0)  # no ceiling trained: nothing to check


@pytest.mark.timeout(60)
def test_the_headline_keeps_targets_of_headline_size_whose_ceiling_is_clearly_above_chance_on_validation():
    teacher = _scores(hh_helpful=58.0, ultrafeedback=55.0, llmbar=45.0, pandalm=60.0)
    # 2 standard errors of a chance accuracy on 200 validation pairs: 7.1 points
    shared = _shared(teacher, _scores(hh_helpful=66.0, ultrafeedback=61.0, llmbar=56.0, pandalm=62.0),
                     test_sizes={"pandalm": 382})
    assert shared.headline_targets == ["ultrafeedback"] and shared.headline.note is None
    assert shared.headline.flags["llmbar"].startswith("no clear transfer signal: the strong ceiling scores 56.0")
    assert shared.headline.flags["pandalm"].startswith("too small for the headline: 200 validation and 382 test")
    assert _shared(teacher, None).headline_targets == ["ultrafeedback", "llmbar", "pandalm"]  # sizes alone
    fallback = _shared(teacher, _scores(hh_helpful=66.0, ultrafeedback=52.0, llmbar=41.0, pandalm=55.0))
    assert fallback.headline_targets == ["ultrafeedback", "llmbar", "pandalm"] and "read it as noise" in fallback.headline.note


@pytest.mark.timeout(60)
def test_an_over_refusal_target_is_reported_beside_the_headline_never_in_it():
    from anchor_rm.data.catalog import COUNTER_TARGETS
    from anchor_rm.evaluation.metrics import choose_headline_targets

    sizes = {name: {"val": 200, "test": 400} for name in ("safetext", "xstest-overrefusal")}
    choice = choose_headline_targets(sizes, {"safetext": 70.0, "xstest-overrefusal": 80.0}, list(sizes), COUNTER_TARGETS)
    assert choice.targets == ["safetext"] and choice.flags["xstest-overrefusal"].startswith("over-refusal")
    weak = choose_headline_targets(sizes, {"safetext": 51.0, "xstest-overrefusal": 80.0}, list(sizes), COUNTER_TARGETS)
    assert weak.targets == ["safetext"] and "read it as noise" in weak.note  # the fallback does not take it either
    assert choose_headline_targets({"xstest-overrefusal": sizes["xstest-overrefusal"]}, None, ["xstest-overrefusal"],
                                   COUNTER_TARGETS).targets == ["xstest-overrefusal"]  # all there is


@pytest.mark.timeout(60)
def test_students_get_the_teachers_labels_raw_or_scaled_by_its_fitted_temperature():
    from anchor_rm.method.training import TrainConfig

    shared = _shared(_scores(hh_helpful=58.0), None)
    raw = [0.52, 0.5, 0.47]
    shared.teacher.outputs.update(soft_labels=raw, calibration={"temperature_fit": {"temperature": 0.5}})
    assert shared.soft_labels("raw") is raw and shared.temperature == 0.5
    # sigmoid(logit(q) / 0.5): twice the margin; 0.5 stays 0.5 and the ranking is kept
    assert shared.soft_labels("calibrated") == pytest.approx([0.52**2 / (0.52**2 + 0.48**2), 0.5, 0.47**2 / (0.47**2 + 0.53**2)])
    with pytest.raises(ValueError, match="teacher labels must be raw or calibrated, got 'hard'"):
        shared.soft_labels("hard")
    with pytest.raises(ValueError, match="teacher_labels must be one of raw, calibrated, got 'scaled'"):
        TrainConfig(teacher_labels="scaled")
    shared.teacher.outputs["calibration"] = {"ece": 0.1}  # a teacher stage from before the temperature existed
    with pytest.raises(ValueError, match="teacher run t has no fitted temperature"):
        shared.soft_labels("calibrated")


@pytest.mark.timeout(60)
def test_the_final_report_takes_the_validation_scores_training_measured_instead_of_scoring_again(monkeypatch):
    from anchor_rm.evaluation.scores import scores_from_dict
    from anchor_rm.pipeline import experiment

    teacher = _scores(hh_helpful=58.0, ultrafeedback=55.0, llmbar=45.0, pandalm=60.0)
    shared = _shared(teacher, _scores(hh_helpful=66.0, ultrafeedback=61.0, llmbar=56.0, pandalm=62.0))
    shared.data = StageRun("d", {"digests": {}}, False)
    scored = []

    def evaluate_model(rm, splits, split, batch_size, *, precision):
        scored.append(split)
        return scores_from_dict(_scores(hh_helpful=61.0, ultrafeedback=57.0, llmbar=50.0, pandalm=59.0))

    monkeypatch.setattr(experiment, "evaluate_model", evaluate_model)
    measured = scores_from_dict(_scores(hh_helpful=63.0, ultrafeedback=58.0, llmbar=51.0, pandalm=64.0))
    info = {"name": "s", "student": "s", "teacher": "t", "method": "naive", "hyperparameters": {}, "run_id": None}
    report, test_scores = experiment.final_report(shared, None, info, 8, "fp32", validation_scores=measured)
    assert test_scores["hh-helpful"].accuracy == 61.0  # what the premise check reads of a naive W2S model
    assert scored == ["test"]  # the model is scored once, on the test splits
    assert {r.dataset: r.student_accuracy for r in report.validation_splits} == {
        "hh-helpful": 63.0, "ultrafeedback": 58.0, "llmbar": 51.0, "pandalm": 64.0}
    assert report.id_split.student_accuracy == 61.0

    scored.clear()
    experiment.final_report(shared, None, info, 8, "fp32")  # none measured: validation is scored here
    assert scored == ["val", "test"]
    with pytest.raises(ValueError, match=r"validation scores for \['hh-helpful', 'ultrafeedback'\], but the validation "
                                         r"sets are \['hh-helpful', 'llmbar', 'pandalm', 'ultrafeedback'\]"):
        experiment.final_report(shared, None, info, 8, "fp32",
                                validation_scores={k: measured[k] for k in ("hh-helpful", "ultrafeedback")})
