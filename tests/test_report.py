"""Evaluation report: derived metrics, round trip, rendering, validation, atomic writes."""

import copy
import json
import os
import re

import pytest

from anchor_rm.evaluation import report_files
from anchor_rm.evaluation.report import EvaluationReport, SplitResult, build_report, file_sha256, report_from_dict
from anchor_rm.evaluation.report_checks import load_report_schema, validate_report_dict
from anchor_rm.evaluation.report_files import read_report, report_to_markdown, report_to_png, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DIGEST = "a" * 64
MODEL_INFO = {
    "name": "anchor-rm-helpful",
    "student": "sentence-transformers/all-MiniLM-L12-v2",
    "teacher": "sentence-transformers/all-MiniLM-L6-v2",
    "method": "anchor-last",
    "hyperparameters": {"lambda": 0.5, "layer": "last", "lr": 5e-5},
    "run_id": "0123abcd",
}


def split_rows(ceiling=True):
    return [
        SplitResult("hh-helpful-base", "id", "test", 470, 60.0, 55.0, 70.0 if ceiling else None, 1.5),
        SplitResult("ultrafeedback", "ood", "test", 500, 50.0, 58.0, 66.0 if ceiling else None, 0.0),
        SplitResult("hh-helpful-online", "ood", "test", 300, 62.0, 61.0, None, 4.0),
    ]


def example_report(**overrides):
    kwargs = dict(selection_splits="val", figure_splits="test", data_digests={"hh-helpful-base": DIGEST},
                  created_at="2025-01-02T03:04:05+00:00")
    kwargs.update(overrides)
    return build_report(MODEL_INFO, split_rows(), **kwargs)


def test_build_report_derives_metrics():
    report = example_report()
    assert report.schema_version == "1"
    assert report.wrg == -5.0
    assert report.aog == {"ultrafeedback": 8.0, "hh-helpful-online": -1.0}
    assert report.nts == {"ultrafeedback": 3.0, "hh-helpful-online": -6.0}
    assert report.mean_nts == pytest.approx(-1.5)
    assert report.pgr == pytest.approx(-0.5)  # (55 - 60) / (70 - 60)
    assert report.id_split.dataset == "hh-helpful-base"


def test_build_report_with_id_gain_and_no_ceiling():
    rows = [SplitResult("hh", "id", "test", 100, 60.0, 65.0, None, 0.0),
            SplitResult("uf", "ood", "test", 100, 50.0, 58.0, None, 0.0)]
    report = build_report({k: v for k, v in MODEL_INFO.items() if k != "run_id"}, rows,
                          selection_splits="val", figure_splits="test")
    assert report.nts == {"uf": 8.0} and report.mean_nts == 8.0 and report.wrg == 5.0
    assert report.pgr is None and report.model["run_id"] is None
    assert "n/a (no ceiling accuracy" in report_to_markdown(report)
    assert "| ceiling acc |" not in report_to_markdown(report)


def test_build_report_requires_exactly_one_id_row():
    rows = split_rows()
    rows[1].role = "id"
    with pytest.raises(ValueError, match=r"exactly one row with role 'id', got 2: \['hh-helpful-base', 'ultrafeedback'\]"):
        build_report(MODEL_INFO, rows, selection_splits="val", figure_splits="test")
    with pytest.raises(ValueError, match="exactly one row with role 'id', got 0"):
        build_report(MODEL_INFO, split_rows()[1:], selection_splits="val", figure_splits="test")
    with pytest.raises(ValueError, match="role 'ood'"):
        build_report(MODEL_INFO, split_rows()[:1], selection_splits="val", figure_splits="test")


def test_build_report_enforces_split_policy():
    with pytest.raises(ValueError, match="figure_splits: 'test' was also used for selection"):
        example_report(selection_splits="test")
    rows = split_rows()
    rows[2].split = "val"
    with pytest.raises(ValueError, match=r"splits\[2\]\.split: expected 'test'"):
        build_report(MODEL_INFO, rows, selection_splits="val", figure_splits="test")
    rows = split_rows()
    rows[2].dataset = "ultrafeedback"
    with pytest.raises(ValueError, match="repeated: \\['ultrafeedback'\\]"):
        build_report(MODEL_INFO, rows, selection_splits="val", figure_splits="test")


def test_build_report_names_bad_fields():
    rows = split_rows()
    rows[2].n_pairs = -1
    with pytest.raises(ValueError, match=r"splits\[2\]\.n_pairs: -1 is less than the minimum of 1"):
        build_report(MODEL_INFO, rows, selection_splits="val", figure_splits="test")
    with pytest.raises(ValueError, match=r"model\.method: missing required field"):
        build_report({k: v for k, v in MODEL_INFO.items() if k != "method"}, split_rows(),
                     selection_splits="val", figure_splits="test")
    with pytest.raises(ValueError, match=r"data_digests\.hh: 'not-a-digest' does not match '\^\[0-9a-f\]\{64\}\$'"):
        example_report(data_digests={"hh": "not-a-digest"})
    with pytest.raises(ValueError, match="model.hyperparameters: not JSON-serialisable"):
        build_report({**MODEL_INFO, "hyperparameters": {"x": object()}}, split_rows(),
                     selection_splits="val", figure_splits="test")


def test_round_trip_through_dict_and_json():
    report = example_report()
    report_dict = report.to_dict()
    assert list(report_dict) == ["schema_version", "created_at", "model", "selection_splits", "figure_splits",
                                 "splits", "wrg", "aog", "nts", "mean_nts", "pgr", "data_digests"]
    assert report_dict["splits"][0] == {
        "dataset": "hh-helpful-base", "role": "id", "split": "test", "n_pairs": 470, "teacher_accuracy": 60.0,
        "student_accuracy": 55.0, "ceiling_accuracy": 70.0, "student_tie_rate": 1.5,
    }
    assert report_from_dict(report_dict) == report
    assert report_from_dict(json.loads(json.dumps(report_dict))) == report


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["splits"][2].__setitem__("n_pairs", "300"), r"splits\[2\]\.n_pairs: '300' is not of type 'integer'"),
        (lambda d: d["splits"][1].__setitem__("n_pairs", True), r"splits\[1\]\.n_pairs: True is not of type 'integer'"),
        (lambda d: d["splits"][0].pop("student_accuracy"), r"splits\[0\]\.student_accuracy: missing required"),
        (lambda d: d["splits"][1].__setitem__("teacher_accuracy", 150.0),
         r"splits\[1\]\.teacher_accuracy: 150\.0 is greater than the maximum of 100"),
        (lambda d: d["splits"][1].__setitem__("role", "train"), r"splits\[1\]\.role: 'train' is not one of \['id', 'ood'\]"),
        (lambda d: d["splits"][1].__setitem__("role", "id"), r"splits: Too many items match the given schema \(expected at most 1\) \(wanted: row with role 'id'\)"),
        (lambda d: d.__setitem__("schema_version", "2"), r"schema_version: '1' was expected"),
        (lambda d: d.__setitem__("created_at", "yesterday"), r"created_at: 'yesterday' does not match '\^\[0-9\]\{4\}"),
        (lambda d: d["model"].__setitem__("extra", 1), r"model\.extra: unexpected field"),
        (lambda d: d.pop("mean_nts"), r"mean_nts: missing required field"),
        (lambda d: d.__setitem__("wrg", float("nan")), r"wrg: nan is not a finite number"),
        (lambda d: d["splits"][0].__setitem__("student_accuracy", float("inf")),
         r"splits\[0\]\.student_accuracy: inf is not a finite number"),
        (lambda d: d["model"]["hyperparameters"].__setitem__("lr", float("nan")),
         r"model\.hyperparameters\.lr: nan is not a finite number"),
        (lambda d: d["splits"][0].__setitem__("role", "ood"),
         r"splits: no item matches the given schema \(wanted: row with role 'id'\)"),
        (lambda d: d.__setitem__("mean_nts", 9.0), r"mean_nts: stored 9.0 but the splits give -1.5"),
        (lambda d: d["nts"].__setitem__("ultrafeedback", 8.0), r"nts\.ultrafeedback: stored 8.0 but the splits give 3.0"),
        (lambda d: d["aog"].pop("ultrafeedback"), r"aog: keys .* differ from the OOD datasets"),
        (lambda d: d.__setitem__("pgr", None), r"pgr: stored None but the splits give -0.5"),
    ],
)
def test_validation_names_the_field(mutate, message):
    report_dict = copy.deepcopy(example_report().to_dict())
    mutate(report_dict)
    with pytest.raises(ValueError, match=message):
        report_from_dict(report_dict)


def test_validation_rejects_non_object():
    with pytest.raises(ValueError, match=r"report: \[1, 2\] is not of type 'object'"):
        validate_report_dict([1, 2])


def test_integral_floats_are_integers_as_in_json_schema():
    report_dict = example_report().to_dict()
    report_dict["splits"][0]["n_pairs"] = 470.0
    assert report_from_dict(report_dict).splits[0].n_pairs == 470


def test_markdown_lists_every_row_and_the_summary():
    text = report_to_markdown(example_report())
    assert "| dataset | role | split | pairs | teacher acc | student acc | ceiling acc | AOG | NTS |" in text
    # 60.0 ± 100*sqrt(.6*.4/470) = 2.26; 55.0 ± 2.29; 70.0 ± 2.11
    assert "| hh-helpful-base | id | test | 470 | 60.0 ±2.3 | 55.0 ±2.3 | 70.0 ±2.1 | - | - | 1.5 |" in text
    # a gain's ± is hypot of the two accuracies' standard errors: hypot(2.21, 2.24) = 3.1, hypot(2.82, 2.80) = 4.0
    assert "| ultrafeedback | ood | test | 500 | 50.0 ±2.2 | 58.0 ±2.2 | 66.0 ±2.1 | +8.0 ±3.1 | +3.0 ±3.1 | 0.0 |" in text
    assert "| hh-helpful-online | ood | test | 300 | 62.0 ±2.8 | 61.0 ±2.8 | - | -1.0 ±4.0 | -6.0 ±4.0 | 4.0 |" in text
    assert "WRG (student - teacher, ID `hh-helpful-base`): -5.0 ±3.2 points" in text
    assert "Ceiling - teacher (ID): +10.0 ±3.1 points" in text
    assert "Mean NTS over 2 OOD targets (`ultrafeedback`, `hh-helpful-online`): -1.5 points" in text
    assert "PGR (ID): -0.50" in text
    assert "model selection used `val`" in text and "comes from `test`" in text
    assert "anchor-last" in text and "`lambda=0.5`" in text and "0123abcd" in text
    assert DIGEST in text


def test_markdown_marks_undefined_pgr():
    rows = split_rows()
    rows[0].ceiling_accuracy = 60.0
    text = report_to_markdown(build_report(MODEL_INFO, rows, selection_splits="val", figure_splits="test"))
    assert "PGR (ID): undefined (ceiling equals teacher" in text


def test_png_is_a_png(tmp_path):
    for report in (example_report(), build_report(MODEL_INFO, split_rows(ceiling=False),
                                                  selection_splits="none", figure_splits="test")):
        path = report_to_png(report, tmp_path / f"{report.pgr}.png")
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5000
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_write_and_read_report(tmp_path):
    report = example_report()
    paths = write_report(report, tmp_path / "out")
    assert {k: p.name for k, p in paths.items()} == {"json": "report.json", "markdown": "report.md",
                                                     "png": "report.png"}
    assert sorted(os.listdir(tmp_path / "out")) == ["report.json", "report.md", "report.png"]
    assert read_report(paths["json"]) == report
    assert read_report(tmp_path / "out") == report
    assert paths["png"].read_bytes().startswith(PNG_SIGNATURE)
    assert "| ultrafeedback |" in paths["markdown"].read_text()
    assert oct(paths["json"].stat().st_mode & 0o777) == oct(0o644)
    # Overwriting in place leaves exactly the three files.
    write_report(report, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["report.json", "report.md", "report.png"]


def test_failed_write_leaves_no_temp_files(tmp_path, monkeypatch):
    def failing_replace(source, target):
        raise OSError("disk full")

    monkeypatch.setattr(report_files.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        write_report(example_report(), tmp_path)
    assert os.listdir(tmp_path) == []


def test_rendering_error_writes_nothing(tmp_path, monkeypatch):
    def failing_render(report):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(report_files, "_render_png", failing_render)
    with pytest.raises(RuntimeError):
        write_report(example_report(), tmp_path)
    assert os.listdir(tmp_path) == []


def test_file_sha256(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b"abc")
    assert file_sha256(path) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_example_report_validates_against_the_schema_file():
    jsonschema = pytest.importorskip("jsonschema")
    schema = load_report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for report in (example_report(), build_report(MODEL_INFO, split_rows(ceiling=False),
                                                  selection_splits="val", figure_splits="test")):
        validator.validate(json.loads(json.dumps(report.to_dict())))


@pytest.mark.parametrize("field_path, bad_value", [
    (("splits", 2, "n_pairs"), -1), (("splits", 0, "role"), "train"), (("created_at",), "yesterday"),
    (("data_digests", "x"), "XYZ"), (("schema_version",), "2"), (("model", "run_id"), 5),
])
def test_schema_file_and_hand_validator_agree(field_path, bad_value):
    jsonschema = pytest.importorskip("jsonschema")
    report_dict = copy.deepcopy(example_report().to_dict())
    target = report_dict
    for key in field_path[:-1]:
        target = target[key]
    target[field_path[-1]] = bad_value
    assert not jsonschema.Draft202012Validator(load_report_schema()).is_valid(report_dict)
    with pytest.raises(ValueError):
        validate_report_dict(report_dict)


def test_report_dataclass_is_public():
    assert EvaluationReport.__dataclass_fields__.keys() >= {"wrg", "aog", "nts", "mean_nts", "pgr", "splits"}


def test_build_report_normalises_numbers():
    rows = [SplitResult("hh", "id", "test", 100, 60, 65, None, 0), SplitResult("uf", "ood", "test", 100, 50, 58, None, 0)]
    report = build_report(MODEL_INFO, rows, selection_splits="val", figure_splits="test")
    assert isinstance(report.splits[0].teacher_accuracy, float) and report.splits[0] is not rows[0]
    assert report_from_dict(json.loads(json.dumps(report.to_dict()))) == report


# ---------------------------------------------------------------------------------------------------
# Evaluation reports (kind "evaluation"): any model on any data, teacher and ID row optional.

def evaluation_rows(teacher=True, id_row=False):
    return [
        SplitResult("my-pairs.jsonl", "id" if id_row else "ood", "all", 40, 60.0 if teacher else None, 65.0, None, 2.5),
        SplitResult("hhh-harmless", "ood", "all", 58, 50.0 if teacher else None, 55.0, None, 0.0),
    ]


def evaluation_report(rows, **overrides):
    kwargs = dict(selection_splits="unknown", figure_splits="all", created_at="2025-01-02T03:04:05+00:00",
                  data_digests={"hhh-harmless": DIGEST}, kind="evaluation")
    kwargs.update(overrides)
    info = {**MODEL_INFO, "name": "models:/anchor-rm-helpful/3"}
    if rows and all(row.teacher_accuracy is None for row in rows):
        info["teacher"] = None
    return build_report(info, rows, **kwargs)


def test_evaluation_report_without_teacher_or_id_row():
    report = evaluation_report(evaluation_rows(teacher=False))
    assert report.kind == "evaluation" and report.id_split is None
    assert (report.wrg, report.mean_nts, report.pgr, report.aog, report.nts) == (None, None, None, {}, {})
    report_dict = report.to_dict()
    assert list(report_dict)[:2] == ["schema_version", "kind"] and report_dict["kind"] == "evaluation"
    assert report_dict["model"]["teacher"] is None and report_dict["splits"][0]["teacher_accuracy"] is None
    assert report_from_dict(json.loads(json.dumps(report_dict))) == report
    text = report_to_markdown(report)
    assert "| dataset | role | split | pairs | student acc | student ties |" in text
    assert "| my-pairs.jsonl | ood | all | 40 | 65.0 ±7.5 | 2.5 |" in text
    assert "teacher: not known (not scored)" in text and "No teacher accuracies" in text
    assert "no dataset is marked in-distribution" in text and "whole data set as given" in text
    assert "PGR" not in text and "Mean NTS" not in text and "kind evaluation" in text


def test_evaluation_report_with_teacher_but_no_id_row_has_aog_only():
    report = evaluation_report(evaluation_rows())
    assert report.aog == {"my-pairs.jsonl": 5.0, "hhh-harmless": 5.0}
    assert report.nts == {} and report.wrg is None and report.mean_nts is None
    text = report_to_markdown(report)
    assert "| dataset | role | split | pairs | teacher acc | student acc | AOG | student ties |" in text
    assert "| hhh-harmless | ood | all | 58 | 50.0 ±6.6 | 55.0 ±6.5 | +5.0 ±9.3 | 0.0 |" in text


def test_evaluation_report_with_teacher_and_id_row_matches_the_protocol_metrics():
    rows = evaluation_rows(id_row=True)
    report = evaluation_report(rows)
    protocol_rows = [SplitResult(**{**row.__dict__, "split": "test"}) for row in rows]
    protocol = build_report(MODEL_INFO, protocol_rows, selection_splits="val", figure_splits="test")
    assert (report.wrg, report.aog, report.nts, report.mean_nts, report.pgr) == (
        protocol.wrg, protocol.aog, protocol.nts, protocol.mean_nts, protocol.pgr)
    assert "WRG (student - teacher, ID `my-pairs.jsonl`): +5.0 points" in report_to_markdown(report)


def test_evaluation_report_with_a_partial_teacher():
    rows = evaluation_rows(id_row=True)
    rows[1].teacher_accuracy = None
    report = evaluation_report(rows)
    assert report.aog == {} and report.nts == {} and report.wrg == 5.0 and report.mean_nts is None
    assert "| hhh-harmless | ood | all | 58 | - | 55.0 ±6.5 |" in report_to_markdown(report)


def test_evaluation_report_rules():
    rows = evaluation_rows()
    rows[0].role = rows[1].role = "id"
    with pytest.raises(ValueError, match=r"at most one row with role 'id', got 2"):
        evaluation_report(rows)
    with pytest.raises(ValueError, match=r"kind: expected one of \['protocol', 'evaluation'\], got 'other'"):
        evaluation_report(evaluation_rows(), kind="other")
    rows = evaluation_rows()
    rows[1].split = "test"
    with pytest.raises(ValueError, match=r"splits\[1\]\.split: expected 'all'"):
        evaluation_report(rows)
    report_dict = evaluation_report(evaluation_rows()).to_dict()
    report_dict["aog"]["hhh-harmless"] = 9.0
    with pytest.raises(ValueError, match=r"aog\.hhh-harmless: stored 9.0 but the splits give 5.0"):
        report_from_dict(report_dict)
    report_dict = evaluation_report(evaluation_rows()).to_dict()
    report_dict["wrg"] = 1.0
    with pytest.raises(ValueError, match=r"wrg: stored 1.0 but the splits give None"):
        report_from_dict(report_dict)


def test_protocol_reports_keep_the_strict_rules():
    rows = split_rows()
    rows[1].teacher_accuracy = None
    with pytest.raises(ValueError, match=r"splits\[1\]\.teacher_accuracy: None is not of type 'number'"):
        build_report(MODEL_INFO, rows, selection_splits="val", figure_splits="test")
    rows = split_rows()
    for row in rows:
        row.split = "all"
    with pytest.raises(ValueError, match=r"splits\[0\]\.split: 'all' is not one of \['val', 'test'\]"):
        build_report(MODEL_INFO, rows, selection_splits="val", figure_splits="all")
    with pytest.raises(ValueError, match=r"model\.teacher: None is not of type 'string'"):
        build_report({**MODEL_INFO, "teacher": None}, split_rows(), selection_splits="val", figure_splits="test")
    two_rows = build_report(MODEL_INFO, split_rows()[:2], selection_splits="val", figure_splits="test").to_dict()
    for mutate, message in [
        (lambda d: d.__setitem__("wrg", None), r"wrg: None is not of type 'number'"),
        (lambda d: d.__setitem__("mean_nts", None), r"mean_nts: None is not of type 'number'"),
        (lambda d: d["splits"][0].__setitem__("teacher_accuracy", None), r"splits\[0\]\.teacher_accuracy: None is not"),
        (lambda d: d.update(kind="protocol", splits=d["splits"][:1]), r"splits: .* is too short"),
        (lambda d: d.__setitem__("kind", "sloppy"), r"kind: 'sloppy' is not one of \['protocol', 'evaluation'\]"),
    ]:
        report_dict = copy.deepcopy(two_rows)
        mutate(report_dict)
        with pytest.raises(ValueError, match=message):
            report_from_dict(report_dict)


def test_protocol_report_json_is_unchanged_by_kinds():
    # No "kind" key is written for a protocol report, so every reader of schema 1 still reads it; a
    # report that names kind "protocol" explicitly reads the same.
    report = example_report()
    report_dict = report.to_dict()
    assert "kind" not in report_dict and report.kind == "protocol"
    assert report_from_dict({**report_dict, "kind": "protocol"}) == report


def test_evaluation_png_and_files(tmp_path):
    for report in (evaluation_report(evaluation_rows(teacher=False)), evaluation_report(evaluation_rows(id_row=True))):
        paths = write_report(report, tmp_path / str(report.wrg))
        assert paths["png"].read_bytes().startswith(PNG_SIGNATURE)
        assert read_report(paths["json"]) == report


def test_evaluation_report_validates_against_the_schema_file():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(load_report_schema())
    for report in (evaluation_report(evaluation_rows(teacher=False)), evaluation_report(evaluation_rows(id_row=True))):
        validator.validate(json.loads(json.dumps(report.to_dict())))
    # Without kind "evaluation" the same dict is held to the protocol rules by the schema file itself.
    report_dict = evaluation_report(evaluation_rows(teacher=False)).to_dict()
    report_dict.pop("kind")
    assert not validator.is_valid(report_dict)
    with pytest.raises(ValueError):
        validate_report_dict(report_dict)


def test_headline_targets_leave_a_no_signal_target_out_of_the_mean_nts(tmp_path):
    """A target on which the ceiling is below chance stays in the report, flagged, and out of the mean."""
    report = build_report(MODEL_INFO, split_rows(), selection_splits="val", figure_splits="test",
                          headline_targets=["ultrafeedback"])
    assert report.mean_nts == pytest.approx(report.nts["ultrafeedback"])
    assert set(report.nts) == {"ultrafeedback", "hh-helpful-online"}  # still computed for every target
    text = report_to_markdown(report)
    assert "Mean NTS over 1 OOD targets (`ultrafeedback`): +3.0 points" in text
    assert "Left out of the mean NTS, no transfer signal: `hh-helpful-online`" in text  # no flags kept: as before
    assert "| -6.0 ±4.0 (no signal) |" in text
    paths = write_report(report, tmp_path)
    assert read_report(paths["json"]).headline_targets == ["ultrafeedback"]
    raw = json.loads(paths["json"].read_text())
    raw["headline_targets"] = ["pandalm"]
    with pytest.raises(ValueError, match=r"headline_targets: \['pandalm'\] must name OOD datasets"):
        report_from_dict(raw)
    raw["headline_targets"] = ["ultrafeedback", "hh-helpful-online"]  # the mean no longer matches
    with pytest.raises(ValueError, match="mean_nts: stored"):
        report_from_dict(raw)
    del raw["headline_targets"]
    raw["mean_nts"] = report.mean_nts
    with pytest.raises(ValueError, match="mean_nts: stored"):
        report_from_dict(raw)  # absent: the mean is over every target


def test_headline_targets_need_headline_size_and_a_ceiling_clearly_above_chance():
    from anchor_rm.evaluation.metrics import choose_headline_targets

    sizes = {"big": {"val": 200, "test": 400}, "weak": {"val": 200, "test": 400}, "tiny": {"val": 29, "test": 29},
             "short": {"val": 200, "test": 399}}
    # 2 standard errors of a chance accuracy on 200 pairs: 7.07 points
    choice = choose_headline_targets(sizes, {"big": 57.5, "weak": 57.0, "tiny": 90.0, "short": 70.0},
                                     ["big", "weak", "tiny", "short"])
    assert choice.targets == ["big"] and choice.note is None
    assert choice.flags["tiny"] == "too small for the headline: 29 validation and 29 test pairs, under 200 and 400"
    assert choice.flags["short"].startswith("too small for the headline: 200 validation and 399 test pairs")
    assert choice.flags["weak"] == ("no clear transfer signal: the strong ceiling scores 57.0 on its 200 validation "
                                    "pairs, not above chance by 2 standard errors (7.1 points)")
    assert choose_headline_targets(sizes, None, ["big", "weak", "tiny"]).targets == ["big", "weak"]  # no ceiling: sizes
    # nothing passes: the targets of headline size, else all, with a note saying so
    fallback = choose_headline_targets(sizes, {"big": 50.0, "weak": 41.0}, ["big", "weak", "tiny"])
    assert fallback.targets == ["big", "weak"] and "no target of headline size shows" in fallback.note
    assert set(fallback.flags) == {"big", "weak", "tiny"}
    small = choose_headline_targets(sizes, {}, ["tiny", "short"])
    assert small.targets == ["tiny", "short"] and small.note.startswith("no target has headline size")


def test_target_flags_are_kept_rendered_and_checked(tmp_path):
    flags = {"hh-helpful-online": "too small for the headline: 200 validation and 399 test pairs, under 200 and 400"}
    report = build_report(MODEL_INFO, split_rows(), selection_splits="val", figure_splits="test",
                          headline_targets=["ultrafeedback"], target_flags=flags)
    text = report_to_markdown(report)
    assert "| -6.0 ±4.0 (left out: too small) |" in text
    assert "- `hh-helpful-online` left out of the mean NTS, too small for the headline: 200 validation" in text
    paths = write_report(report, tmp_path)
    again = read_report(paths["json"])
    assert again.target_flags == flags and again.headline_note is None
    noted = build_report(MODEL_INFO, split_rows(), selection_splits="val", figure_splits="test",
                         target_flags={"ultrafeedback": "no clear transfer signal: ..."}, headline_note="read it as noise")
    text = report_to_markdown(noted)
    assert "**Headline fallback**: read it as noise." in text and "(flagged: no clear signal)" in text
    assert "`ultrafeedback` kept in the mean NTS, no clear transfer signal" in text
    over = build_report(MODEL_INFO, split_rows(), selection_splits="val", figure_splits="test",
                        headline_targets=["ultrafeedback"],
                        target_flags={"hh-helpful-online": "over-refusal: complying with a safe request preferred"})
    assert "(left out: over-refusal) |" in report_to_markdown(over)  # its own reason, not "no clear signal"
    raw = json.loads(paths["json"].read_text())
    raw["target_flags"] = {"pandalm": "too small"}
    with pytest.raises(ValueError, match=r"target_flags: \['pandalm'\] are not OOD datasets"):
        report_from_dict(raw)


def validation_rows():
    return [SplitResult("hh-helpful-base", "id", "val", 300, 61.0, 58.0, 69.0, 0.0),
            SplitResult("ultrafeedback", "ood", "val", 200, 50.0, 56.0, 64.0, 0.0),
            SplitResult("hh-helpful-online", "ood", "val", 200, 60.0, 62.0, None, 0.0)]


def test_validation_rows_round_trip_with_their_derived_metrics(tmp_path):
    report = example_report(validation_results=validation_rows())
    # validation WRG 58 - 61 = -3; NTS = AOG - 3: ultrafeedback 6 - 3 = 3, online 2 - 3 = -1; mean 1
    assert report.validation["wrg"] == pytest.approx(-3.0) and report.validation["mean_nts"] == pytest.approx(1.0)
    assert report.wrg == pytest.approx(-5.0)  # the figures stay on test
    data = report.to_dict()
    assert data["validation"]["mean_nts"] == pytest.approx(1.0) and len(data["validation"]["splits"]) == 3
    again = report_from_dict(json.loads(json.dumps(data)))
    assert again.validation_splits == report.validation_splits and again.validation_id_split.student_accuracy == 58.0
    assert "Validation (what promotion compares; not a figure)" in report_to_markdown(report)
    assert example_report().validation is None and "validation" not in example_report().to_dict()


@pytest.mark.parametrize("mutate, message", [
    (lambda v: v["splits"][0].update(split="test"), "validation.splits[0].split: expected 'val', got 'test'"),
    (lambda v: v["splits"].pop(), "validation.splits: datasets"),
    (lambda v: v["splits"][1].update(role="id"), "validation.splits: a dataset's role differs"),
    (lambda v: v.update(mean_nts=7.0), "validation.mean_nts: stored 7.0 but its splits give"),
    (lambda v: v.update(extra=1), "validation"),
])
def test_bad_validation_blocks_are_named(mutate, message):
    data = example_report(validation_results=validation_rows()).to_dict()
    mutate(data["validation"])
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_report_dict(data)


def test_a_search_selection_round_trips_is_rendered_and_its_fields_are_checked():
    candidate = {"trial_id": "a1", "method": "anchor", "anchor_lambda": 1e-3, "anchor_layers": "last",
                 "val_mean_nts": 1.01, "val_id_acc": 60.3}
    selection = {"rule": "highest validation mean NTS; ties: higher val ID accuracy, then smaller lambda",
                 "candidates": 4, "selected": candidate, "tied_with": [{**candidate, "trial_id": "a2", "anchor_lambda": 1e-2}],
                 "naive_val_mean_nts": 1.01, "difference_from_naive": 0.0, "difference_standard_error": 2.89,
                 "distinguishable_from_naive": False}
    report = example_report(selection=selection)
    again = report_from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.selection == selection and "selection" not in example_report().to_dict()
    text = report_to_markdown(report)
    assert "- Selection among 4 candidates: highest validation mean NTS; ties:" in text
    assert "difference +0.00 ±2.89 points: **not distinguishable**" in text
    data = report.to_dict()
    data["selection"]["selected"].pop("val_id_acc")
    with pytest.raises(ValueError, match="selection.selected"):
        validate_report_dict(data)


def test_teacher_calibration_round_trips_and_is_rendered(tmp_path):
    measured = {"dataset": "hh-helpful-base", "split": "val", "n_pairs": 300, "bins": 10, "ece": 0.041,
                "mean_margin": 0.062, "accuracy": 58.7, "mean_confidence": 0.562}
    report = example_report(teacher_calibration=measured)
    again = read_report(write_report(report, tmp_path)["json"])
    assert again.teacher_calibration == measured and "teacher_calibration" not in example_report().to_dict()
    assert ("- Teacher calibration on `hh-helpful-base` val (300 pairs): ECE 0.041 over 10 bins, mean |q - 0.5| "
            "0.062, accuracy 58.7, mean confidence 0.562") in report_to_markdown(report)
    data = report.to_dict()
    data["teacher_calibration"]["mean_margin"] = 0.7
    with pytest.raises(ValueError, match="teacher_calibration.mean_margin"):
        validate_report_dict(data)


def test_the_teachers_temperature_and_scaled_labels_round_trip_and_are_rendered(tmp_path):
    measured = {"dataset": "pku-saferlhf", "split": "val", "n_pairs": 300, "bins": 10, "ece": 0.071,
                "mean_margin": 0.02, "accuracy": 57.0, "mean_confidence": 0.52,
                "temperature_fit": {"split": "teacher_calibration", "temperature": 0.25, "n_pairs": 494,
                                    "nll_raw": 0.6901, "nll_calibrated": 0.6822},
                "calibrated": {"n_pairs": 300, "bins": 10, "ece": 0.03, "mean_margin": 0.08, "accuracy": 57.0,
                               "mean_confidence": 0.58}}
    report = example_report(teacher_calibration=measured)
    assert read_report(write_report(report, tmp_path)["json"]).teacher_calibration == measured
    assert ("- Teacher temperature 0.25, fitted on 494 gold `teacher_calibration` pairs (NLL 0.6901 -> 0.6822); "
            "scaled labels on the same val split: ECE 0.030, mean |q - 0.5| 0.080") in report_to_markdown(report)
    data = report.to_dict()
    data["teacher_calibration"]["temperature_fit"]["temperature"] = 0
    with pytest.raises(ValueError, match="teacher_calibration.temperature_fit.temperature"):
        validate_report_dict(data)


def test_what_the_teachers_labels_say_round_trips_and_is_rendered(tmp_path):
    """The labels the students learn from: nats per pair (of ln 2 for hard labels) and how often they are right."""
    from anchor_rm.pipeline.experiment import label_summary

    labels = label_summary([0.9, 0.6, 0.4, 0.55], temperature=2.0)
    assert labels["n_pairs"] == 4 and labels["accuracy"] == 75.0
    assert 0 < labels["calibrated_information_nats"] < labels["information_nats"] < 0.6932  # scaling by T > 1 softens
    measured = {"dataset": "pku-saferlhf", "split": "val", "n_pairs": 300, "bins": 10, "ece": 0.071,
                "mean_margin": 0.02, "accuracy": 57.0, "mean_confidence": 0.52, "information_nats": 0.0154,
                "student_train_labels": labels}
    report = example_report(teacher_calibration=measured)
    assert read_report(write_report(report, tmp_path)["json"]).teacher_calibration == measured
    assert (f"- The labels the students learn from (4 student-train pairs): {labels['information_nats']:.4f} nats per "
            f"pair raw, {labels['calibrated_information_nats']:.4f} scaled, of ln 2 = 0.693 for hard labels (0: no "
            "information); right on 75.0% of them (gold)") in report_to_markdown(report)
    data = report.to_dict()
    data["teacher_calibration"]["student_train_labels"]["information_nats"] = 0.8
    with pytest.raises(ValueError, match="student_train_labels.information_nats"):
        validate_report_dict(data)
