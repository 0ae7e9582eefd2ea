"""pipelines/evaluate.py and anchor_rm/pipeline/evaluate_any.py: real tiny models, a real SQLite MLflow registry."""

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from anchor_rm.cli import evaluate as cli  # what pipelines/evaluate.py and `anchor-rm evaluate` run
from helpers import run_pipeline, sqlite_store, tiny_model_folder

REGISTERED = "anchor-rm-test"
TEACHER_TAG = "anchor_rm.teacher_run"


def write_pairs(path: Path, n: int = 12, extra: list[str] | None = None) -> Path:
    lines = [json.dumps({"prompt": f"Question {i}: how do I get to place number {i}?",
                         "chosen": f"Take the bus {i} and walk {i % 3 + 1} blocks north.",
                         "rejected": f"I don't know, maybe {'nowhere' if i % 2 else 'ask someone'}."})
             for i in range(n)]
    path.write_text("\n".join(lines + (extra or [])) + "\n")
    return path


def cleaned(name):
    from anchor_rm.data.catalog import load_dataset_pairs
    from anchor_rm.data.splits import clean_pairs

    return clean_pairs(load_dataset_pairs(name))[0]


def reward_model(model, tokenizer, name):
    from anchor_rm.model.encoding import RewardEncoder
    from anchor_rm.model.reward_model import RewardModel

    return RewardModel(model, tokenizer, RewardEncoder(tokenizer, 64, decoder=False), name)


def accuracy_of(folder, pairs):
    from anchor_rm.evaluation.scores import evaluate_pairs
    from anchor_rm.model.reward_model import load_saved

    return evaluate_pairs(load_saved(folder), pairs).accuracy


def run_main(capsys, *args):
    """The CLI in this process: (exit status, stdout, stderr)."""
    try:
        status = cli.main([str(a) for a in args])
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# ---------------------------------------------------------------------------------------------------
# A registry like the one training leaves behind: a teacher stage run that logged model/, and a
# registered version whose run points at it with anchor_rm.teacher_run.

@dataclass
class Store:
    uri: str
    version: str
    student_run: str
    teacher_run: str
    student_folder: Path
    teacher_folder: Path
    root: Path


@pytest.fixture(scope="module")
def store(tmp_path_factory, minilm_tokenizer):
    root = tmp_path_factory.mktemp("registry")
    # sqlite_store gives the URIs and their environment back afterwards: restored with mlflow.set_registry_uri
    # alone, MLflow's default registry stayed exported as MLFLOW_REGISTRY_URI for the later modules on this
    # worker (outside any test, where the autouse fixture cannot restore it).
    with sqlite_store(root, "anchor-rm-test") as uri:
        yield _registered_store(uri, root, minilm_tokenizer)


def _registered_store(uri: str, root, minilm_tokenizer):
    import mlflow

    from anchor_rm.evaluation.report import SplitResult, build_report
    from anchor_rm.mlflow_edge import registry

    experiment_id = mlflow.get_experiment_by_name("anchor-rm-test").experiment_id
    teacher_folder = tiny_model_folder(root / "teacher", minilm_tokenizer, 1, 64, "tiny-teacher", {"stage": "teacher"})
    student_folder = tiny_model_folder(root / "student", minilm_tokenizer, 0, 64, "tiny-student",
                                       {"method": "anchor", "teacher": "tiny-teacher"})
    # As experiment._gold_stage / _log_model do: the teacher's folder as the run's model/ artifacts.
    with mlflow.start_run(experiment_id=experiment_id, run_name="teacher") as teacher_run:
        mlflow.set_tags({"anchor_rm.stage": "teacher"})
        mlflow.log_artifacts(str(teacher_folder), "model")
    rows = [SplitResult("hhh-harmless", "id", "test", 20, 55.0, 60.0, None, 0.0),
            SplitResult("pku-saferlhf", "ood", "test", 20, 50.0, 52.0, None, 0.0)]
    training_report = build_report({"name": REGISTERED, "student": "tiny-student", "teacher": "tiny-teacher",
                                    "method": "anchor", "hyperparameters": {"anchor_lambda": 0.01}},
                                   rows, selection_splits="val", figure_splits="test")
    with mlflow.start_run(experiment_id=experiment_id, run_name="anchor") as student_run:
        mlflow.set_tags({"anchor_rm.stage": "student", "anchor_rm.method": "anchor",
                         TEACHER_TAG: teacher_run.info.run_id})
        mlflow.log_params({"source": "hhh-harmless", "train.anchor_lambda": 0.01})
        version = registry.log_and_register(student_folder, training_report, REGISTERED)
    return Store(uri, version.version, student_run.info.run_id, teacher_run.info.run_id, student_folder,
                 teacher_folder, root)


@pytest.fixture
def student_folder(tmp_path, tiny_bert, minilm_tokenizer):
    from anchor_rm.model.reward_model import save_reward_model

    return save_reward_model(reward_model(tiny_bert(0), minilm_tokenizer, "tiny-student"), tmp_path / "student",
                             {"method": "anchor", "teacher": "tiny-teacher"})


# ---------------------------------------------------------------------------------------------------
# The command line as a real process.

def test_help_is_enough_to_start(tmp_path):
    result = run_pipeline("evaluate.py", "--help", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    for text in ("--model", "--data", "--id", "--teacher", "--out", "--tracking-uri", "--no-log", "--skip-invalid",
                 "--prompt-column", "models:/NAME@ALIAS", "runs:/RUN_ID/PATH", "anchor-rm-evaluations",
                 "MLFLOW_TRACKING_URI", "hhh-harmless"):
        assert text in result.stdout, text


def test_registered_alias_gets_teacher_columns_and_an_evaluation_run(store, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    from anchor_rm.data.catalog import dataset_digest

    pairs_file = write_pairs(tmp_path / "pairs.jsonl")
    work = tmp_path / "work"
    work.mkdir()
    result = run_pipeline("evaluate.py", "--model", f"models:/{REGISTERED}@challenger", "--data", str(pairs_file),
                          "--data", "hhh-harmless", "--id", "hhh-harmless", "--tracking-uri", store.uri,
                          cwd=work, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"data {pairs_file}: 12 pairs read, 12 kept" in result.stdout
    assert f"teacher: runs:/{store.teacher_run}/model" in result.stderr

    (out,) = work.glob("evaluation-*")  # the default --out
    report = json.loads((out / "report.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "report.png"]
    assert report["kind"] == "evaluation" and report["figure_splits"] == "all"
    assert report["model"]["name"] == f"models:/{REGISTERED}/1"
    assert report["model"]["teacher"] == f"runs:/{store.teacher_run}/model"
    assert report["model"]["method"] == "anchor" and report["model"]["hyperparameters"] == {"anchor_lambda": "0.01"}
    rows = {row["dataset"]: row for row in report["splits"]}
    assert rows["hhh-harmless"]["role"] == "id" and rows[str(pairs_file)]["role"] == "ood"
    for name, pairs in ((str(pairs_file), cleaned(pairs_file)), ("hhh-harmless", cleaned("hhh-harmless"))):
        # The same numbers as the library's evaluate_pairs on the same pairs, for student and teacher.
        assert rows[name]["student_accuracy"] == pytest.approx(accuracy_of(store.student_folder, pairs), abs=1e-9)
        assert rows[name]["teacher_accuracy"] == pytest.approx(accuracy_of(store.teacher_folder, pairs), abs=1e-9)
        assert report["data_digests"][name] == dataset_digest(pairs)
    id_row, ood_row = rows["hhh-harmless"], rows[str(pairs_file)]
    assert report["wrg"] == pytest.approx(id_row["student_accuracy"] - id_row["teacher_accuracy"])
    assert report["aog"] == {str(pairs_file): pytest.approx(ood_row["student_accuracy"] - ood_row["teacher_accuracy"])}
    assert set(report["nts"]) == {str(pairs_file)} and report["mean_nts"] is not None
    assert "| teacher acc |" in result.stdout and "WRG (student - teacher, ID `hhh-harmless`)" in result.stdout

    mlflow.set_tracking_uri(store.uri)
    client = MlflowClient(store.uri)
    experiment = client.get_experiment_by_name("anchor-rm-evaluations")
    (run,) = client.search_runs([experiment.experiment_id])
    assert report["model"]["run_id"] == run.info.run_id
    params = run.data.params
    assert params["model_uri"] == f"models:/{REGISTERED}@challenger" and params["model_version"] == "1"
    assert params["registered_model"] == REGISTERED and params["model_run"] == store.student_run
    assert params["data.2.name"] == "hhh-harmless" and params["data.2.digest"] == report["data_digests"]["hhh-harmless"]
    assert run.data.tags[TEACHER_TAG] == store.teacher_run and run.data.tags["anchor_rm.stage"] == "evaluation"
    assert run.data.metrics["acc/hhh-harmless"] == id_row["student_accuracy"] and "wrg" in run.data.metrics
    assert {Path(f.path).name for f in client.list_artifacts(run.info.run_id, "report")} == {
        "report.json", "report.md", "report.png"}


# ---------------------------------------------------------------------------------------------------
# The command line in this process.

def test_local_folder_on_a_jsonl_file(student_folder, tmp_path, capsys):
    from anchor_rm.evaluation.report_files import read_report

    # Two more lines: an exact repeat and a pair with identical responses; cleaning drops and counts both.
    first = json.loads(write_pairs(tmp_path / "x.jsonl", 1).read_text())
    pairs_file = write_pairs(tmp_path / "pairs.jsonl", 12, [json.dumps(first), json.dumps(
        {"prompt": "Same?", "chosen": "Yes.", "rejected": "Yes."})])
    status, out, err = run_main(capsys, "--model", student_folder, "--data", pairs_file, "--no-log",
                                "--out", tmp_path / "out")
    assert status == 0, err
    assert f"data {pairs_file}: 14 pairs read, 12 kept (dropped: 1 identical, 1 duplicates)" in out
    report = read_report(tmp_path / "out")
    assert report.kind == "evaluation" and report.model["run_id"] is None
    assert report.model["name"] == str(student_folder) and report.model["student"] == "tiny-student"
    assert report.model["teacher"] == "tiny-teacher"  # as anchor_rm.json records it; there are no weights to score
    (row,) = report.splits
    assert row.role == "ood" and row.split == "all" and row.teacher_accuracy is None and row.n_pairs == 12
    assert row.student_accuracy == accuracy_of(student_folder, cleaned(pairs_file))
    assert report.wrg is None and report.mean_nts is None and report.aog == {} and report.nts == {}
    assert "| dataset | role | split | pairs | student acc | student ties |" in out
    assert "| teacher acc |" not in out and "No teacher accuracies" in out
    assert (tmp_path / "out" / "report.png").read_bytes().startswith(b"\x89PNG")


def test_catalog_name_with_an_explicit_teacher_folder(store, tmp_path, capsys):
    status, out, err = run_main(capsys, "--model", store.student_folder, "--teacher", store.teacher_folder,
                                "--data", "hhh-harmless", "--max-pairs", "30", "--no-log", "--out", tmp_path / "out")
    assert status == 0, err
    assert "data hhh-harmless: 58 pairs read, 58 kept; 30 of the 58 sampled (--max-pairs)" in out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (row,) = report["splits"]
    assert row["n_pairs"] == 30 and row["teacher_accuracy"] is not None
    assert report["model"]["teacher"] == str(store.teacher_folder)
    assert report["aog"] == {"hhh-harmless": pytest.approx(row["student_accuracy"] - row["teacher_accuracy"])}
    assert report["wrg"] is None and report["nts"] == {} and "| AOG |" in out and "| NTS |" not in out


def test_version_number_latest_and_run_uri_are_the_same_model(store, tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="anchor_rm")
    pairs_file = write_pairs(tmp_path / "pairs.jsonl")
    accuracies = set()
    for uri in (f"models:/{REGISTERED}/{store.version}", f"models:/{REGISTERED}/latest", f"runs:/{store.student_run}/model"):
        out_dir = tmp_path / uri.replace("/", "_").replace(":", "")
        status, out, err = run_main(capsys, "--model", uri, "--data", pairs_file, "--data", "hhh-harmless",
                                    "--tracking-uri", store.uri, "--no-log", "--out", out_dir)
        assert status == 0, err
        report = json.loads((out_dir / "report.json").read_text())
        assert all(row["teacher_accuracy"] is not None for row in report["splits"]), uri
        accuracies.add(tuple(row["student_accuracy"] for row in report["splits"]))
    assert len(accuracies) == 1
    # The training run logged source=hhh-harmless: the CLI says how to get WRG and NTS.
    assert "--id hhh-harmless adds WRG and NTS" in caplog.text


def test_registry_mistakes_give_one_clear_line(store, tmp_path, capsys):
    pairs_file = write_pairs(tmp_path / "pairs.jsonl")
    cases = {
        f"models:/{REGISTERED}@champion": f"registered model '{REGISTERED}' has no alias 'champion'; "
                                          "its aliases: @challenger (version 1)",
        # It names what the registry holds: the smoke preset registers another category than the service asks for.
        "models:/no-such-model@champion": f"no registered model 'no-such-model' in the registry at {store.uri}",
        "models:/no-such-model/1": f"it holds: {REGISTERED} (@challenger)",
        f"models:/{REGISTERED}/7": f"registered model '{REGISTERED}' has no version 7; its versions: 1",
        f"models:/{REGISTERED}/Production": "version 'Production' is not a number",
        "runs:/0123456789abcdef/model": "no run '0123456789abcdef'",
        str(tmp_path / "missing-folder"): "no such folder",
    }
    for uri, message in cases.items():
        status, out, err = run_main(capsys, "--model", uri, "--data", pairs_file, "--tracking-uri", store.uri,
                                    "--no-log", "--out", tmp_path / "never")
        assert status == 2, uri
        assert err.startswith("error: ") and message in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "never").exists()


def test_teacher_run_without_a_model_means_no_teacher_columns(store, tmp_path, capsys, caplog):
    import mlflow

    caplog.set_level(logging.INFO, logger="anchor_rm")
    mlflow.set_tracking_uri(store.uri)
    experiment_id = mlflow.get_experiment_by_name("anchor-rm-test").experiment_id
    with mlflow.start_run(experiment_id=experiment_id, run_name="empty teacher") as empty:
        mlflow.set_tags({"anchor_rm.stage": "teacher"})
    with mlflow.start_run(experiment_id=experiment_id, run_name="student") as run:
        mlflow.set_tags({TEACHER_TAG: empty.info.run_id})
        mlflow.log_artifacts(str(store.student_folder), "model")
    status, out, err = run_main(capsys, "--model", f"runs:/{run.info.run_id}/model", "--data", "hhh-harmless",
                                "--tracking-uri", store.uri, "--no-log", "--out", tmp_path / "out")
    assert status == 0, err
    assert "no teacher: the teacher run named by anchor_rm.teacher_run has no usable model/ artifact" in caplog.text
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["splits"][0]["teacher_accuracy"] is None and report["aog"] == {}


def test_bad_data_file_names_the_file_and_line(student_folder, tmp_path, capsys):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "chosen": "a"}\n')
    status, out, err = run_main(capsys, "--model", student_folder, "--data", bad, "--no-log", "--out", tmp_path / "o")
    assert status == 2
    assert err.strip() == f"error: {bad}, line 2: field 'rejected' is missing (fields present: ['chosen', 'prompt'])"
    # --skip-invalid scores what is valid and says what it skipped.
    good = write_pairs(tmp_path / "good.jsonl", 3, ["{not json"])
    status, out, err = run_main(capsys, "--model", student_folder, "--data", good, "--skip-invalid", "--no-log",
                                "--out", tmp_path / "o")
    assert status == 0, err
    assert f"data {good}: 3 pairs read, 3 kept; 1 invalid records skipped" in out


def test_argument_mistakes(student_folder, tmp_path, capsys):
    pairs_file = write_pairs(tmp_path / "pairs.jsonl")
    for args, message in [
        (["--data", pairs_file, "--id", "hhh-harmless"], "--id 'hhh-harmless' is not one of the --data entries"),
        (["--data", pairs_file, "--data", pairs_file], "--data: each data set once"),
        (["--data", "no-such-dataset"], "dataset 'no-such-dataset': not a known name"),
        (["--data", pairs_file, "--max-pairs", "0"], "--max-pairs must be at least 1"),
        (["--data", pairs_file, "--out", pairs_file], "is a file, not a folder"),
    ]:
        status, out, err = run_main(capsys, "--model", student_folder, "--no-log", *args)
        assert status == 2 and message in err, err


# ---------------------------------------------------------------------------------------------------
# The library functions.

def test_score_sets_marks_the_id_set_and_matches_evaluate_pairs(tiny_bert, minilm_tokenizer, tmp_path):
    from anchor_rm.evaluation.report_files import read_report, write_report
    from anchor_rm.evaluation.scores import evaluate_pairs
    from anchor_rm.pipeline.evaluate_any import evaluation_premise, evaluation_report, load_evaluation_set, score_sets

    student = reward_model(tiny_bert(0), minilm_tokenizer, "s")
    teacher = reward_model(tiny_bert(1), minilm_tokenizer, "t")
    sets = [load_evaluation_set(str(write_pairs(tmp_path / "a.jsonl"))), load_evaluation_set("hhh-harmless")]
    rows, flagged, correct = score_sets(student, sets, teacher=teacher, id_name=sets[0].name)
    assert [r.role for r in rows] == ["id", "ood"] and flagged == []  # no OOD flag fitted: none measured
    for row, s in zip(rows, sets):
        assert row.student_accuracy == evaluate_pairs(student, s.pairs).accuracy
        assert row.teacher_accuracy == evaluate_pairs(teacher, s.pairs).accuracy
    info = {"name": "m", "student": "s", "teacher": "t", "method": "anchor", "hyperparameters": {}}
    report = evaluation_report(info, rows, sets)
    assert report.wrg == rows[0].student_accuracy - rows[0].teacher_accuracy and report.mean_nts is not None
    # The premise check of the evaluated model, from the same pass: its WRG and mean AOG are the report's.
    report.premise = evaluation_premise(rows, correct, "anchor")
    assert report.premise["verdict"] in ("present", "absent") and report.premise["relative"] is None  # no ceiling
    assert report.premise["absolute"]["wrg"] == pytest.approx(report.wrg)
    assert report.premise["summary"].split(": ")[1].startswith("the evaluated model (anchor) WRG")
    write_report(report, tmp_path / "r")
    assert read_report(tmp_path / "r") == report
    assert "Does the failure ANCHOR targets happen here?" in (tmp_path / "r" / "report.md").read_text()
    no_teacher = score_sets(student, sets, id_name=sets[0].name)
    assert evaluation_premise(no_teacher[0], no_teacher[2], None)["verdict"] == "not measured"
    no_id = score_sets(student, sets, teacher=teacher)
    assert "no ID set" in evaluation_premise(no_id[0], no_id[2], None)["summary"]
    with pytest.raises(ValueError, match="'nope' is not among the data sets"):
        score_sets(student, sets, id_name="nope")

    # With an OOD flag, the same pass measures it on every set, against the validation responses of its fit.
    from anchor_rm.evaluation.scores import fit_ood_flag
    from anchor_rm.model.ood_flag import measure_sets

    fit_ood_flag(student, sets[0].pairs, sets[0].pairs[:10], fit_split="student_train", threshold_split="a/val")
    flagged_rows, flagged, _ = score_sets(student, sets, teacher=teacher, id_name=sets[0].name)
    assert flagged_rows == rows and [f.dataset for f in flagged] == [s.name for s in sets]
    block = measure_sets(student.density, flagged)
    assert block["auroc_reference"] == "a/val (stored with the fit)" and all(r["auroc"] is not None for r in block["sets"])
    report = evaluation_report(info, rows, sets, ood_flag=block)
    write_report(report, tmp_path / "flagged")
    assert read_report(tmp_path / "flagged").ood_flag["sets"][1]["dataset"] == "hhh-harmless"


def test_reward_model_folder_reads_a_pyfunc_model(store, tmp_path):
    import mlflow

    from anchor_rm.mlflow_edge.model_package import reward_model_folder
    from anchor_rm.model.loading import ModelError

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{REGISTERED}/1",
                                                     dst_path=str(tmp_path / "dl")))
    assert (local / "MLmodel").is_file()
    folder = reward_model_folder(local)  # the pyfunc keeps the source folder's name, not the artifact key
    assert (folder / "anchor_rm.json").is_file() and folder.name == store.student_folder.name
    with pytest.raises(ModelError, match="neither a reward model folder"):
        reward_model_folder(tempfile.mkdtemp(dir=tmp_path))
