"""The serving logic behind the HTTP service (service/schemas.py, holder.py, guard.py, config.py), without a server:
request limits and their messages, best-of-n and compare, OpenRLHF's query split, the API-key guard as a
plain ASGI app, the model holder's reload, and scoring a registered version through the library's path."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from anchor_rm.evaluation.report import SplitResult, build_report
from anchor_rm.model import scoring
from anchor_rm.model.reward_model import load_saved
from helpers import register_version, sqlite_store, tiny_model_folder
from service import schemas
from service.config import Settings, SettingsError, load_settings
from service.guard import HEALTH_PATHS, ApiGuard, validation_message
from service.holder import ModelHolder, in_fresh_thread, load_served_model, target_version
from service.schemas import RequestError, ServingLimits

LIMITS = ServingLimits(max_items=4, max_candidates=3, max_text_bytes=20)


# ---------------------------------------------------------------------------------------------------
# Limits and messages.

@pytest.mark.parametrize("call, field, words", [
    (lambda: schemas.check_pairs([], [], LIMITS), "items", ["empty"]),
    (lambda: schemas.check_pairs(["p"] * 5, ["r"] * 5, LIMITS), "items", ["5 entries", "limit of 4", "ANCHOR_RM_MAX_ITEMS"]),
    (lambda: schemas.check_pairs(["p", " "], ["r", "r"], LIMITS), "items[1].prompt", ["empty"]),
    (lambda: schemas.check_pairs(["p"], ["é" * 11], LIMITS), "items[0].response", ["22 bytes", "limit of 20 bytes", "ANCHOR_RM_MAX_TEXT_BYTES"]),
    (lambda: schemas.check_pairs(["p"], [5], LIMITS), "items[0].response", ["must be a string", "int"]),
    (lambda: schemas.check_pairs(["\ud800"], ["r"], LIMITS), "items[0].prompt", ["lone surrogate"]),
    (lambda: schemas.check_best_of_n("p", [], LIMITS), "candidates", ["empty"]),
    (lambda: schemas.check_best_of_n("p", ["a"] * 4, LIMITS), "candidates", ["4 entries", "limit of 3", "ANCHOR_RM_MAX_CANDIDATES"]),
    (lambda: schemas.check_best_of_n("", ["a"], LIMITS), "prompt", ["empty"]),
    (lambda: schemas.check_best_of_n("p", "ab", LIMITS), "candidates", ["must be a list"]),
    (lambda: schemas.check_compare("p", "a", "x" * 21, LIMITS), "response_b", ["21 bytes", "limit of 20"]),
    (lambda: schemas.split_queries([], ["p"], LIMITS), "query", ["empty"]),
    (lambda: schemas.split_queries(["q1", "q2"], ["q"], LIMITS), "prompts", ["1 entries", "query has 2"]),
    (lambda: schemas.split_queries(["q1", ""], None, LIMITS), "query[1]", ["empty"]),
    (lambda: schemas.split_queries(["q"], None, LIMITS, labels="x"), "labels", ["must be a list"]),
])
def test_bad_requests_name_the_field_and_the_limit(call, field, words):
    with pytest.raises(RequestError) as info:
        call()
    assert info.value.field == field
    message = str(info.value)
    assert message.startswith(f"{field}: ")
    for word in words:
        assert word in message
    assert info.value.to_dict() == {"error": message, "field": field}


def test_an_empty_response_or_candidate_is_scored_not_refused():
    """A policy may stop at once: TRL's reward function scores through /score and must not fail on it."""
    schemas.check_pairs(["p", "q"], ["", "  "], LIMITS)
    schemas.check_best_of_n("p", ["", "a"], LIMITS)


def test_limits_at_the_edge_pass():
    schemas.check_pairs(["p"] * 4, ["é" * 10] * 4, LIMITS)  # exactly 4 items of exactly 20 bytes
    schemas.check_best_of_n("p", ["a", "b", "c"], LIMITS)
    with pytest.raises(ValueError, match="max_items must be at least 1"):
        ServingLimits(max_items=0)


def test_openrlhf_queries_split_at_their_prompt():
    split = schemas.split_queries(["Q: hi\nA: hello", "Q: hi\nA:", "unrelated text"], ["Q: hi\nA:", "Q: hi\nA:", "Q: x"],
                                  LIMITS, labels=[None, "a", 3])
    assert split.prompts == ["Q: hi\nA:", "Q: hi\nA:", ""]
    assert split.responses == [" hello", "", "unrelated text"]  # a policy that stopped at once: empty response
    assert split.prompt_found == [True, True, False]
    absent = schemas.split_queries(["whole text"], None, LIMITS)
    assert (absent.prompts, absent.responses, absent.prompt_found) == ([""], ["whole text"], [False])
    # OpenRLHF with several reward servers sends each server after the first {"query": [], "prompts": [], ...}
    for prompts in ([], None):
        nothing = schemas.split_queries([], prompts, LIMITS, labels=[])
        assert (nothing.prompts, nothing.responses, nothing.prompt_found) == ([], [], [])


def test_ranking_and_preference_probability():
    assert scoring.rank([0.1, 2.0, -1.0, 2.0]) == [1, 3, 0, 2]  # ties keep request order
    assert scoring.preference_probability(1.0, 1.0) == 0.5
    assert scoring.preference_probability(2.0, 0.5) == pytest.approx(1 / (1 + math.exp(-1.5)))
    assert scoring.preference_probability(2.0, 0.5) + scoring.preference_probability(0.5, 2.0) == pytest.approx(1.0)
    assert scoring.preference_probability(1000.0, -1000.0) == 1.0  # no overflow either way
    assert scoring.preference_probability(-1000.0, 1000.0) == 0.0


def test_validation_messages_name_fields():
    detail = [{"loc": ["items", 0, "prompt"], "msg": "Field required"}, {"loc": [], "msg": "Invalid JSON: x"}]
    assert validation_message(detail) == "items[0].prompt: Field required; body: Invalid JSON: x"


def test_request_models_keep_inputs_out_of_error_messages():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        schemas.ScoreRequest.model_validate_json('{"items": [{"prompt": 5, "response": "r"}], "x": "SECRET-TEXT"}')
    assert "SECRET-TEXT" not in str(info.value) and "input_value" not in str(info.value)
    ok = schemas.GetRewardRequest.model_validate({"query": ["q"], "labels": [1, None], "newer_field": 1})
    assert ok.prompts is None and ok.labels == [1, None]


# ---------------------------------------------------------------------------------------------------
# Settings.

def test_settings_defaults_environment_and_file(tmp_path):
    defaults = load_settings({})
    assert defaults == Settings()
    assert defaults.model_uri == "models:/anchor-rm-harmless@champion" and defaults.host == "127.0.0.1"
    assert defaults.poll_seconds == 60 and defaults.api_key is None and defaults.batching
    config = tmp_path / "serve.toml"
    config.write_text('model_uri = "models:/x/3"\npoll_seconds = 5\nmax_candidates = 8\n')
    settings = load_settings({"ANCHOR_RM_CONFIG": str(config), "ANCHOR_RM_POLL_SECONDS": "0",
                              "ANCHOR_RM_API_KEY": "s3cret", "ANCHOR_RM_BATCHING": "off"})
    assert settings.model_uri == "models:/x/3" and settings.max_candidates == 8
    assert settings.poll_seconds == 0 and not settings.batching  # the environment wins over the file
    assert defaults.ood_flag and not load_settings({"ANCHOR_RM_OOD_FLAG": "0"}).ood_flag
    assert settings.api_key == "s3cret" and "s3cret" not in repr(settings)
    assert settings.limits() == ServingLimits(256, 8, 32768)
    as_json = tmp_path / "serve.json"
    as_json.write_text(json.dumps({"max_items": 9}))
    assert load_settings({"ANCHOR_RM_CONFIG": str(as_json)}).max_items == 9


@pytest.mark.parametrize("environ, words", [
    ({"ANCHOR_RM_MAX_ITEMS": "0"}, ["ANCHOR_RM_MAX_ITEMS='0'", "positive whole number"]),
    ({"ANCHOR_RM_MAX_TEXT_BYTES": "lots"}, ["ANCHOR_RM_MAX_TEXT_BYTES", "positive whole number"]),
    ({"ANCHOR_RM_POLL_SECONDS": "-1"}, ["ANCHOR_RM_POLL_SECONDS", "non-negative"]),
    ({"ANCHOR_RM_BATCHING": "maybe"}, ["ANCHOR_RM_BATCHING", "1 or 0"]),
    ({"ANCHOR_RM_OOD_FLAG": "sometimes"}, ["ANCHOR_RM_OOD_FLAG", "1 or 0"]),
    ({"ANCHOR_RM_MAX_BATCH_SIZE": "1"}, ["at least 2", "ANCHOR_RM_BATCHING=0"]),
    ({"ANCHOR_RM_CONFIG": "/nonexistent/serve.toml"}, ["no such file"]),
    ({"ANCHOR_RM_DEVICE": "gpu"}, ["ANCHOR_RM_DEVICE='gpu'", "auto, cpu, cuda or cuda:N"]),
])
def test_bad_settings_say_which_and_why(environ, words):
    with pytest.raises(SettingsError) as info:
        load_settings(environ)
    for word in words:
        assert word in str(info.value)


def test_api_key_never_comes_from_a_file(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text('api_key = "in-a-file"\n')
    with pytest.raises(SettingsError, match="ANCHOR_RM_API_KEY only") as info:
        load_settings({"ANCHOR_RM_CONFIG": str(config)})
    assert "in-a-file" not in str(info.value)
    config.write_text('max_itemz = 3\n')
    with pytest.raises(SettingsError, match="unknown setting 'max_itemz'"):
        load_settings({"ANCHOR_RM_CONFIG": str(config)})


# ---------------------------------------------------------------------------------------------------
# The ASGI guard, in front of a small echo app.

async def _echo(scope, receive, send):
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/invalid":  # the framework's pydantic 400
        payload = {"error": "1 validation error for ScoreRequest",
                   "detail": [{"type": "missing", "loc": ["items", 0, "response"], "msg": "Field required"}]}
        status = 400
    else:
        payload, status = {"path": scope["path"], "bytes": len(body)}, 200
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def _call(guard, method: str, path: str, **kwargs) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_guard_requires_the_key_except_for_health_checks():
    guard = ApiGuard(_echo, api_key="k3y")
    assert _call(guard, "POST", "/score", json={}).status_code == 401
    assert _call(guard, "GET", "/metrics").status_code == 401
    wrong = _call(guard, "POST", "/score", json={}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "API key" in wrong.json()["error"] and "k3y" not in wrong.text
    assert wrong.headers["www-authenticate"] == "Bearer"
    assert _call(guard, "POST", "/score", json={}, headers={"Authorization": "Bearer k3y"}).status_code == 200
    assert _call(guard, "POST", "/score", json={}, headers={"authorization": "bearer k3y"}).status_code == 200
    assert _call(guard, "POST", "/score", json={}, headers={"X-API-Key": "k3y"}).status_code == 200
    for path in HEALTH_PATHS:
        assert _call(guard, "GET", path).status_code == 200


def test_guard_without_a_key_lets_requests_through_and_limits_bodies():
    guard = ApiGuard(_echo, max_body_bytes=100)
    ok = _call(guard, "POST", "/score", content=b"x" * 100)
    assert ok.status_code == 200 and ok.json()["bytes"] == 100  # the body still reaches the app
    big = _call(guard, "POST", "/score", content=b"x" * 101)
    assert big.status_code == 413
    assert "limit of 100 bytes" in big.json()["error"] and "ANCHOR_RM_MAX_BODY_BYTES" in big.json()["error"]

    async def chunks():  # no content-length: counted as it arrives
        for _ in range(3):
            yield b"x" * 40

    assert _call(guard, "POST", "/score", content=chunks()).status_code == 413


def test_guard_rewrites_validation_errors_to_name_fields():
    response = _call(ApiGuard(_echo), "POST", "/invalid", json={})
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "items[0].response: Field required"
    assert body["detail"][0]["loc"] == ["items", 0, "response"]
    assert int(response.headers["content-length"]) == len(response.content)


# ---------------------------------------------------------------------------------------------------
# The holder: load fully, then swap; a failed load keeps the old model.

class _FakeModel:
    def __init__(self, version):
        self.version = version
        self.resolved = f"models:/m/{version}"
        self.folder = None


def test_holder_swaps_only_when_the_alias_moves_and_keeps_serving_on_failure(tmp_path):
    target = {"version": "1"}
    loads = []

    def loader(uri, folder):
        loads.append(target["version"])
        if target["version"] == "bad":
            raise RuntimeError("corrupt weights")
        return _FakeModel(target["version"])

    holder = ModelHolder("models:/m@champion", tmp_path, loader=loader, target=lambda uri: target["version"])
    assert not holder.loaded
    holder.load()
    in_flight = holder.current  # a request that took the model before the reload
    assert holder.refresh().to_dict() == {"changed": False, "previous_version": "1", "current_version": "1",
                                          "error": None}
    target["version"] = "2"
    result = holder.refresh()
    assert result.changed and (result.previous, result.current) == ("1", "2")
    assert holder.current.version == "2" and in_flight.version == "1"  # the old object is untouched
    target["version"] = "bad"
    failed = holder.refresh()
    assert not failed.changed and "corrupt weights" in failed.error and holder.current.version == "2"
    assert holder.last_error == failed.error
    assert loads == ["1", "2", "bad"]


def test_holder_polls_in_the_background(tmp_path):
    target = {"version": "1"}
    holder = ModelHolder("models:/m@champion", tmp_path, loader=lambda uri, folder: _FakeModel(target["version"]),
                                 target=lambda uri: target["version"])
    holder.load()
    holder.start_polling(0.05)
    try:
        target["version"] = "7"
        deadline = time.time() + 10
        while holder.current.version != "7" and time.time() < deadline:
            time.sleep(0.02)
        assert holder.current.version == "7"
    finally:
        holder.close()
    assert not any(t.name == "anchor-rm-model-poll" and t.is_alive() for t in threading.enumerate())


def test_lookup_failures_are_reported_not_raised(tmp_path):
    def target(uri):
        raise ConnectionError("registry down")

    holder = ModelHolder("models:/m@champion", tmp_path, loader=lambda uri, folder: _FakeModel("1"), target=target)
    holder.load()
    result = holder.refresh()
    assert not result.changed and "registry down" in result.error and holder.current.version == "1"


# ---------------------------------------------------------------------------------------------------
# A registered version, served through the library's scoring path.

def _report():
    rows = [SplitResult("hh-helpful-base", "id", "test", 470, 60.0, 61.0, None, 0.0),
            SplitResult("pandalm", "ood", "test", 300, 50.0, 54.0, None, 0.0)]
    model = {"name": "anchor-rm-helpful", "student": "tiny-bert", "teacher": "tiny-teacher", "method": "anchor",
             "hyperparameters": {}}
    return build_report(model, rows, selection_splits="val", figure_splits="test",
                        data_digests={"hh-helpful-base/id_test": "a" * 64, "pandalm/test": "b" * 64})


@pytest.fixture
def registered(tmp_path, monkeypatch, minilm_tokenizer):
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with sqlite_store(tmp_path, "service-tests"):
        folders = {}
        for seed in (0, 1):
            folder = tiny_model_folder(tmp_path / f"model{seed}", minilm_tokenizer, seed)
            folders[register_version(folder, _report(), "anchor-rm-helpful")] = folder
        MlflowClient().set_registered_model_alias("anchor-rm-helpful", "champion", "1")
        yield folders


def test_served_model_scores_like_the_library_and_carries_its_report(registered, tmp_path):
    served = load_served_model("models:/anchor-rm-helpful@champion", tmp_path / "dl")
    assert (served.registered_name, served.version, served.alias) == ("anchor-rm-helpful", "1", "champion")
    assert served.ref.model_dump() == {"name": "anchor-rm-helpful", "version": "1"}
    info = served.describe()
    assert info["run_id"] and info["max_length"] == 32 and info["has_report"]
    assert info["headline_metrics"]["mean_nts"] == pytest.approx(_report().mean_nts, abs=0.01)
    assert info["headline_metrics"]["method"] == "anchor" and "aog.pandalm" in info["headline_metrics"]
    assert served.report["mean_nts"] == pytest.approx(_report().mean_nts)
    prompts = ["How do I boil an egg?", "word " * 60, "Hi"]
    responses = ["Boil it for eight minutes.", "A short answer.", "Hello there, how can I help?"]
    expected = load_saved(registered["1"]).scorer().score(prompts, responses)
    got = served.score(prompts, responses)
    np.testing.assert_allclose(got.rewards, expected.rewards, atol=1e-6)
    assert got.truncated.tolist() == [False, True, False]  # 60 words of prompt do not fit in 32 tokens


def test_the_ood_flag_setting_turns_the_flag_off_and_says_so(registered, tmp_path):
    """ANCHOR_RM_OOD_FLAG=0 reaches load_served_model as ood_flag=False: rewards alone, /model says why."""
    from service_fixtures import fit_pairs

    from anchor_rm.evaluation.scores import fit_ood_flag

    fitted = load_saved(registered["1"])
    fit_ood_flag(fitted, fit_pairs(40), fit_pairs(20, offset=1), fit_split="student_train", threshold_split="fit/val")
    fitted.density.save(registered["1"])  # the folder, as a run or folder URI serves it
    on = load_served_model(str(registered["1"]), tmp_path / "on")
    off = load_served_model(str(registered["1"]), tmp_path / "off", ood_flag=False)
    scored, plain = on.score(["Hi"], ["Hello."]), off.score(["Hi"], ["Hello."])
    assert scored.ood_scores is not None and plain.ood_scores is None and plain.in_domain is None
    np.testing.assert_allclose(plain.rewards, scored.rewards, atol=1e-6)
    assert on.describe()["ood_flag"]["enabled"] and on.describe()["ood_flag"]["n_fit"] == 80
    assert off.describe()["ood_flag"] == {"enabled": False, "reason": "turned off (ANCHOR_RM_OOD_FLAG=0)"}


def test_a_bf16_cpu_service_holds_its_matmul_weights_in_bf16_and_scores_as_the_library_does(registered, tmp_path):
    from anchor_rm.model.scoring import reward_head

    served = load_served_model("models:/anchor-rm-helpful/1", tmp_path / "dl", precision="bf16", device="cpu")
    model = served.scorer.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert reward_head(model).weight.dtype == torch.float32
    assert all(m.weight.dtype == torch.bfloat16 for m in linears if m is not reward_head(model))
    prompts, responses = ["How do I boil an egg?", "word " * 60, "Hi"], ["Boil it.", "A short answer.", "Hello there."]
    expected = load_saved(registered["1"]).scorer(precision="bf16").score(prompts, responses).rewards
    assert served.score(prompts, responses).rewards.tolist() == expected.tolist()  # bit for bit: the same bf16 weights


def test_a_reward_does_not_depend_on_its_batch(registered, tmp_path):
    served = load_served_model("models:/anchor-rm-helpful/1", tmp_path / "dl")
    assert served.alias is None and target_version("models:/anchor-rm-helpful/1") is None
    alone = served.score(["What is 2+2?"], ["4"]).rewards[0]
    prompts = ["long " * 50, "What is 2+2?", "x", "Tell me a story about a cat."]
    responses = ["y " * 40, "4", "z", "Once upon a time a cat sat."]
    mixed = served.score(prompts, responses).rewards[1]
    assert abs(alone - mixed) <= 1e-4


def test_target_version_follows_the_alias(registered, tmp_path):
    assert target_version("models:/anchor-rm-helpful@champion") == "1"
    assert target_version("models:/anchor-rm-helpful/latest") == "2"
    assert target_version(str(registered["1"])) is None
    holder = ModelHolder("models:/anchor-rm-helpful@champion", tmp_path / "dl")
    holder.load()
    first = holder.current
    MlflowClient().set_registered_model_alias("anchor-rm-helpful", "champion", "2")
    assert holder.refresh().changed and holder.current.version == "2"
    assert first.folder is not None and not first.folder.exists()  # the retired version's files are gone
    rewards = holder.current.score(["p"], ["r"]).rewards
    np.testing.assert_allclose(rewards, load_saved(registered["2"]).scorer().score(["p"], ["r"]).rewards, atol=1e-6)
    holder.close()


def test_a_folder_uri_serves_without_registry_details(registered, tmp_path):
    served = load_served_model(str(registered["1"]), tmp_path / "dl")
    assert served.version is None and served.registered_name is None
    assert served.ref.name == str(registered["1"]) and served.report is None
    assert "no evaluation report" in served.report_error
    assert served.describe()["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():  # a device the machine does not have is named, not a torch traceback
        with pytest.raises(RuntimeError, match="ANCHOR_RM_DEVICE=cuda: cannot place the model there"):
            load_served_model(str(registered["1"]), tmp_path / "dl2", device="cuda")


def test_in_fresh_thread_returns_raises_and_leaves_no_thread():
    caller = threading.get_ident()
    ran_on = []

    def work(x):
        ran_on.append(threading.get_ident())
        return x * 2

    assert in_fresh_thread(work, 21) == 42
    assert ran_on and ran_on[0] != caller
    assert not [t for t in threading.enumerate() if t.name == "anchor-rm-load"]
    with pytest.raises(KeyError, match="missing"):
        in_fresh_thread(lambda: {}["missing"])


def test_forward_batch_size_is_a_positive_setting():
    assert load_settings({"ANCHOR_RM_FORWARD_BATCH_SIZE": "4"}).forward_batch_size == 4
    with pytest.raises(SettingsError, match="ANCHOR_RM_FORWARD_BATCH_SIZE='0': expected a positive whole number"):
        load_settings({"ANCHOR_RM_FORWARD_BATCH_SIZE": "0"})
