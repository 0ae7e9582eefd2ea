"""The weak-to-strong gate and the headline targets, decided on validation from the shared stages."""

from __future__ import annotations

import pytest

from anchor_rm.experiment import SharedStages
from anchor_rm.splits import ProtocolSplits
from anchor_rm.mlflow_edge.runs import StageRun


def _scores(**accuracies) -> dict:
    return {name.replace("_", "-"): {"accuracy": acc, "n_pairs": 400, "tie_rate": 0.0, "identical_after_truncation": 0}
            for name, acc in accuracies.items()}


def _shared(teacher_val: dict, ceiling_val: dict | None) -> SharedStages:
    splits = ProtocolSplits("hh-helpful", [], [], [], [], {"ultrafeedback": {}, "llmbar": {}, "pandalm": {}})
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
def test_targets_where_the_ceiling_is_below_chance_on_validation_leave_the_headline():
    teacher = _scores(hh_helpful=58.0, ultrafeedback=55.0, llmbar=45.0, pandalm=60.0)
    shared = _shared(teacher, _scores(hh_helpful=66.0, ultrafeedback=61.0, llmbar=41.0, pandalm=62.0))
    assert shared.headline_targets == ["ultrafeedback", "pandalm"]
    assert _shared(teacher, None).headline_targets == ["ultrafeedback", "llmbar", "pandalm"]
