"""Bad input found by reading the code paths a user reaches (session 29's review): each gets one line naming what
is wrong and where, early, and nothing already written is lost. Fast: no server, Ray or training."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from helpers import run_pipeline


def _closed_port() -> int:
    with socket.socket() as s:  # bound and closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_an_unreachable_tracking_server_is_one_line_naming_its_uri_within_seconds(monkeypatch):
    from anchor_rm.mlflow_edge import store

    monkeypatch.setattr(store, "FIRST_CONTACT_RETRIES", 0)  # the retries' backoff is MLflow's; the message is ours
    uri = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(ValueError) as info:
        store.configure(uri, "anchor-rm-x")
    assert str(info.value).startswith(f"MLflow tracking server {uri} cannot be reached (connection refused): start it")
    assert store.unreachable_reason(Exception("API request failed: HTTP 503 status code 503")) == "HTTP 503"


@pytest.mark.timeout(60)
def test_clean_errors_prints_an_mlflow_error_as_one_line(capsys, monkeypatch):
    from mlflow.exceptions import MlflowException

    from anchor_rm.cli.common import clean_errors

    monkeypatch.delenv("ANCHOR_RM_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exited, clean_errors():
        raise MlflowException("Invalid model name 'team/rm'")
    assert exited.value.code == 2
    assert capsys.readouterr().err == "error: MLflow: Invalid model name 'team/rm'\n"
    with pytest.raises(RuntimeError), clean_errors():  # anything else keeps its traceback: a bug, not bad input
        raise RuntimeError("a bug")


@pytest.mark.timeout(60)
def test_resume_of_a_misspelt_experiment_is_refused_not_started_afresh(tmp_path):
    import mlflow

    from anchor_rm.evaluation import keys
    from anchor_rm.mlflow_edge.store import configure
    from tuning.main_job import check_resumable

    storage = tmp_path / "ray_results"
    (storage / "harmless-default-20261207-090000" / "anchor").mkdir(parents=True)
    (storage / "harmless-default-20261207-090000" / "anchor" / "experiment_state-x.json").write_text("{}")
    experiment_id = configure(f"sqlite:///{tmp_path}/mlflow.db", "anchor-rm-harmless")
    with pytest.raises(ValueError) as info:
        check_resumable("harmless-default-2026", storage, experiment_id, "anchor-rm-harmless")
    assert str(info.value) == (
        f"--resume --name harmless-default-2026: no such experiment (nothing at {storage / 'harmless-default-2026'}, "
        f"no tune run named harmless-default-2026 in MLflow experiment anchor-rm-harmless); experiments under "
        f"{storage}: harmless-default-20261207-090000; to start it, run without --resume")
    check_resumable("harmless-default-20261207-090000", storage, experiment_id, "anchor-rm-harmless")
    # a driver killed before Tune wrote anything left only its tune run in MLflow: resumable
    mlflow.MlflowClient().create_run(experiment_id, tags={keys.TUNE_NAME_TAG: "early"})
    check_resumable("early", storage, experiment_id, "anchor-rm-harmless")


def test_main_job_settings_refuse_a_model_name_mlflow_refuses_and_a_batch_the_workers_cannot_share():
    from tuning.main_job import MainJobSettings

    with pytest.raises(ValueError, match="--registered-name 'team/rm': MLflow's model names take no /"):
        MainJobSettings(registered_name="team/rm")
    settings = MainJobSettings(workers_per_trial=3)
    with pytest.raises(ValueError, match="--workers-per-trial 3 does not divide the preset's student batch of 16 pairs"):
        settings.check_batch(16)
    MainJobSettings(workers_per_trial=4).check_batch(16)


def test_a_negative_seed_is_refused_by_the_parser_naming_it():
    from anchor_rm.cli.common import seed_number

    assert seed_number("7") == 7
    for text in ("-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number >= 0"):
            seed_number(text)
    from anchor_rm.pipeline.study import StudyConfig

    with pytest.raises(ValueError, match="seeds must be distinct whole numbers >= 0"):
        StudyConfig(seeds=[0, -1])


def test_a_bad_lambda_range_is_refused_naming_what_is_wrong():
    from anchor_rm.cli.common import lambda_range

    from tuning.main_job import MainJobSettings

    assert lambda_range("1e-3,1e2") == (1e-3, 100.0)
    for text, why in (("1e-3", "is not LOW,HIGH"), ("a,b", "is not LOW,HIGH"), ("1,0.1", "needs 0 < LOW < HIGH"),
                      ("0,1", "needs 0 < LOW < HIGH")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            lambda_range(text)
    with pytest.raises(ValueError, match="--lambda-range needs 0 < low < high, not 1,0.1"):
        MainJobSettings(lambda_range=(1.0, 0.1))


def test_a_study_folder_holding_another_studys_results_is_not_written_over(tmp_path):
    from anchor_rm.pipeline.study import StudyConfig, check_out_folder

    study = StudyConfig(categories=["harmless"], seeds=[0, 1], lambdas=[1e-2])
    check_out_folder(tmp_path / "new", study)  # nothing there yet
    out = tmp_path / "out"
    out.mkdir()
    (out / "study.json").write_text(json.dumps({"config": json.loads(json.dumps(study.to_dict())), "instances": []}))
    check_out_folder(out, study)  # the same study again
    check_out_folder(out, StudyConfig(categories=["harmless"], seeds=[0, 1, 2], lambdas=[1e-2]))  # extends it
    with pytest.raises(ValueError) as info:
        check_out_folder(out, StudyConfig(categories=["harmless"], seeds=[0], lambdas=[1e-3]))
    assert str(info.value).startswith(f"--out {out}: its study.json holds another study's results (it differs in "
                                      f"lambdas, seeds [0, 1] not all in this study's [0])")
    assert f"--adopt {out / 'study.json'}" in str(info.value)
    (out / "study.json").write_text("[]")
    with pytest.raises(ValueError, match="is not a study.json this command wrote"):
        check_out_folder(out, study)


@pytest.mark.timeout(300)
def test_the_study_cli_refuses_to_write_over_another_study(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    kept = json.dumps({"config": {"categories": ["helpful"], "seeds": [0, 1, 2], "preset": "study"}, "instances": []})
    (out / "study.json").write_text(kept)
    bad = run_pipeline("study.py", "--preset", "smoke", "--seeds", "0", "--out", str(out),
                       "--tracking-uri", f"sqlite:///{tmp_path}/m.db", cwd=tmp_path, timeout=240)
    assert bad.returncode == 2 and f"error: --out {out}: its study.json holds another study's results" in bad.stderr
    assert "Traceback" not in bad.stderr and (out / "study.json").read_text() == kept
    assert not (tmp_path / "m.db").exists()  # refused before the store was touched


def test_max_length_over_the_models_positions_is_refused_naming_the_limit():
    from transformers import BertConfig, RobertaConfig

    from anchor_rm.model.loading import ModelError, check_max_length, load_model_config, position_limit

    minilm = load_model_config("minilm-l6")
    assert position_limit(minilm) == 512
    check_max_length(minilm, 512, "minilm-l6")
    with pytest.raises(ModelError, match=r"max length 1024 tokens is over what minilm-l6 reads \(512 positions, its "
                                         r"max_position_embeddings\): pass --max-length 512 or less"):
        check_max_length(minilm, 1024, "minilm-l6")
    assert position_limit(RobertaConfig(max_position_embeddings=514)) == 512  # positions start after padding
    assert position_limit(BertConfig(max_position_embeddings=0)) is None


def test_a_classifier_with_two_outputs_is_refused_as_a_reward_model(tmp_path, minilm_tokenizer):
    from transformers import BertConfig, BertForSequenceClassification

    from anchor_rm.model.loading import ModelError, load_reward_model, resolve_model

    config = BertConfig(vocab_size=minilm_tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(tmp_path / "sentiment")
    minilm_tokenizer.save_pretrained(tmp_path / "sentiment")
    with pytest.raises(ModelError, match="has a classification head with more than one output; a reward model has one"):
        load_reward_model(resolve_model(str(tmp_path / "sentiment")))


def test_frozen_layers_over_an_anchored_layer_are_refused_with_the_plan_for_every_search_choice():
    from anchor_rm.method.losses import check_layer_settings
    from anchor_rm.method.memory_plan import protocol_plans
    from anchor_rm.pipeline.config import preset

    check_layer_settings(2, ["last", "middle"], 6)  # middle is [3, 5]
    with pytest.raises(ValueError, match=r"frozen_layers 3 would freeze anchored layer 3 \(anchor_layers 'middle' -> \[3, 5\]\)"):
        check_layer_settings(3, ["last", "middle"], 6)
    with pytest.raises(ValueError, match="frozen_layers must be in 0..5 for a model of 6 layers, got 6"):
        check_layer_settings(6, [], 6)
    with pytest.raises(ValueError, match=r"anchor_layers \[9\] out of range"):
        check_layer_settings(0, ["2,9"], 6)
    cfg = preset("smoke", "harmless")
    cfg.student_train.frozen_layers = 3
    protocol_plans(cfg)  # naive W2S anchors nothing
    with pytest.raises(ValueError, match="would freeze anchored layer 3"):
        protocol_plans(cfg, anchor_layer_choices=("last", "middle"))


@pytest.mark.parametrize("content, words", [
    ([{"type": "text", "text": None}], "text part 0 has a text of type NoneType, not a string"),
    (3, "content must be a string or a list of text parts, got int"),
])
def test_a_message_whose_text_is_not_a_string_is_a_400_naming_the_field(content, words):
    from service import protocols
    from service.protocols import ClassifyRequest
    from service.schemas import RequestError, ServingLimits

    request = ClassifyRequest(model="m", messages=[{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": content}])
    with pytest.raises(RequestError) as info:
        protocols.classify_pairs(request, ServingLimits(4, 3, 200))
    assert info.value.field == "messages" and words in str(info.value)


def test_a_chat_turn_that_is_not_a_message_names_the_file_line_and_field(tmp_path):
    from anchor_rm.data.readers import read_generic
    from anchor_rm.data.records import DataError

    path = tmp_path / "pairs.jsonl"
    turn = {"role": "assistant", "content": "x"}
    path.write_text(json.dumps({"chosen": ["hi", turn], "rejected": ["hi", {**turn, "content": "y"}]}) + "\n")
    with pytest.raises(DataError, match=r"pairs.jsonl, line 1: field 'chosen': turn 0 is a str, not a message object"):
        read_generic(path, "mine")
    with pytest.raises(DataError, match=r"turn 0 is a str"):  # --skip-invalid skips the line; none is left
        read_generic(path, "mine", skip_invalid=True)


def test_a_data_file_is_read_whatever_the_case_of_its_suffix_and_another_suffix_is_named(tmp_path):
    from anchor_rm.data.readers import read_generic
    from anchor_rm.data.records import DataError

    upper = tmp_path / "pairs.JSONL"
    upper.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    assert [(p.prompt, p.chosen, p.rejected) for p in read_generic(upper, "mine")] == [("p", "a", "b")]
    text = tmp_path / "pairs.txt"
    text.write_text("p\ta\tb\n")
    with pytest.raises(DataError, match=r"pairs.txt: not a data file this reads \(its name ends in .txt\); use one of "
                                        r".jsonl, .jsonl.gz, .json, .parquet, .csv"):
        read_generic(text, "mine")


@pytest.mark.parametrize("environ, words", [
    ({"ANCHOR_RM_POLL_SECONDS": "nan"}, "non-negative finite number of seconds"),
    ({"ANCHOR_RM_TIMEOUT_SECONDS": "inf"}, "positive finite number of seconds"),
    ({"ANCHOR_RM_PORT": "70000"}, "expected a TCP port, 1 to 65535"),
])
def test_service_settings_refuse_non_finite_seconds_and_ports_past_65535(environ, words):
    from service.config import SettingsError, load_settings

    with pytest.raises(SettingsError, match=words):
        load_settings(environ)


def test_a_null_in_a_service_config_file_is_refused(tmp_path):
    from service.config import SettingsError, load_settings

    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"download_dir": None}))
    with pytest.raises(SettingsError, match=r"serve.json: download_dir=None: expected a single value"):
        load_settings({"ANCHOR_RM_CONFIG": str(config)})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_promote_refuses_a_settle_time_that_is_not_finite(tmp_path, value):
    bad = run_pipeline("promote.py", "--settle-seconds", value, cwd=tmp_path, timeout=240)
    assert bad.returncode == 2 and "--settle-seconds must be a finite number of seconds >= 0" in bad.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_an_ood_fit_of_another_models_width_is_refused_when_the_model_loads(tmp_path, minilm_tokenizer):
    """Else /readyz turns ready and every scoring request fails."""
    import numpy as np

    from helpers import tiny_reward_model

    from anchor_rm.model.ood_flag import fit_density
    from anchor_rm.model.reward_model import load_saved, save_reward_model

    rm = tiny_reward_model(minilm_tokenizer, 0, 40)  # 32 wide
    rng = np.random.default_rng(0)
    rm.density = fit_density(rng.normal(size=(60, 8)), rng.normal(size=(20, 8)), fit_split="student_train",
                             threshold_split="toy/val")
    save_reward_model(rm, tmp_path / "model")
    with pytest.raises(ValueError, match="the OOD flag's fit has 8 dimensions, the model's states 32: the fit "
                                         "belongs to another model"):
        load_saved(tmp_path / "model")
