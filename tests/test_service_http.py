"""The reward service as users meet it: a real `bentoml serve` process on 127.0.0.1, serving the champion of
a registry in a temporary SQLite store, called over HTTP. Scores must equal the library scorer's; bad input
must get a 4xx that names the field and the limit, never a 5xx; moving the alias must reach the service
(through /reload and through polling) without failing requests in flight."""

from __future__ import annotations

import json
import math
import os
import random
import select
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from anchor_rm.model.precision import resolve_precision
from service.config import KEEP_ALIVE_SECONDS
from service_fixtures import KEY, MAX_LENGTH, NAME, PROMPTS, RESPONSES, SECRET_TEXT, served_report

pytestmark = pytest.mark.slow

def _library(store, version, prompts, responses):
    return store["scorers"][version].score(prompts, responses)


def _champion(version: str) -> None:
    MlflowClient().set_registered_model_alias(NAME, "champion", version)


# ---------------------------------------------------------------------------------------------------

def test_binds_loopback_by_default(server):
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port = local.rsplit(":", 1)
                if state == "0A" and int(port, 16) == server["port"]:
                    listening.add(address)
    assert listening == {"0100007F"}, listening  # 127.0.0.1 only, not 0.0.0.0 or ::


def test_an_idle_connection_outlives_a_pooled_clients_5_s(server):
    """BentoML's default 5 s keep-alive equals httpx's pool expiry, and a client reusing a connection as the
    server closes it gets a reset (docs/reliability.md). The service keeps idle connections open longer."""
    assert KEEP_ALIVE_SECONDS > 7
    conn = HTTPConnection("127.0.0.1", server["port"], timeout=10)
    try:
        for attempt in range(2):
            conn.request("GET", "/livez")
            response = conn.getresponse()
            assert response.status == 200 and response.read() == b"\n", attempt
            if attempt == 0:
                used = conn.sock
                time.sleep(7)  # idle, longer than the 5 s of BentoML's default and of httpx's pool
                readable, _, _ = select.select([used], [], [], 0)
                assert not readable, "the server closed the idle connection"  # its FIN would make it readable
        assert conn.sock is used  # the second request went over the same connection
    finally:
        conn.close()


def test_api_key_guards_everything_but_health_checks(server, http):
    url = server["url"]
    for path in ("/livez", "/healthz", "/readyz"):
        assert httpx.get(url + path).status_code == 200
    body = {"items": [{"prompt": "p", "response": "r"}]}
    assert httpx.post(url + "/score", json=body).status_code == 401
    assert httpx.post(url + "/score", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.post(url + "/score", json=body, headers={"X-API-Key": KEY}).status_code == 200
    assert http.get("/metrics").status_code == 200


def test_score_equals_the_library_scorer(store, http):
    _champion("1")
    http.post("/reload")
    response = http.post("/score", json={"items": [{"prompt": p, "response": r} for p, r in zip(PROMPTS, RESPONSES)]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == {"name": NAME, "version": "1"}
    expected = _library(store, "1", PROMPTS, RESPONSES)
    np.testing.assert_allclose(body["rewards"], expected.rewards, atol=1e-5)
    assert body["truncated"] == expected.truncated.tolist() == [False, False, True, False]
    # The OOD flag, as the library's scorer computes it with the version's fit.
    np.testing.assert_allclose(body["ood_score"], expected.ood_scores, rtol=1e-4)
    assert body["in_domain"] == expected.in_domain.tolist()


def test_best_of_n_and_compare(store, http):
    candidates = ["Boil it.", "Put it in boiling water for eight minutes, then cool it.", "I like eggs.", "No."]
    response = http.post("/best_of_n", json={"prompt": PROMPTS[0], "candidates": candidates})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = _library(store, "1", [PROMPTS[0]] * 4, candidates).rewards
    np.testing.assert_allclose(body["rewards"], expected, atol=1e-5)
    assert body["ranking"] == sorted(range(4), key=lambda i: -expected[i])
    assert body["best_index"] == body["ranking"][0] and body["model"]["version"] == "1"
    compared = http.post("/compare", json={"prompt": PROMPTS[0], "response_a": candidates[1], "response_b": candidates[2]})
    assert compared.status_code == 200, compared.text
    c = compared.json()
    np.testing.assert_allclose([c["reward_a"], c["reward_b"]], [expected[1], expected[2]], atol=1e-5)
    assert c["p_a_preferred"] == pytest.approx(1 / (1 + math.exp(-(c["reward_a"] - c["reward_b"]))), abs=1e-9)
    assert c["model"] == {"name": NAME, "version": "1"}


def test_openrlhf_get_reward_protocol(store, http):
    prompts = [PROMPTS[0], PROMPTS[1]]
    queries = [PROMPTS[0] + " " + RESPONSES[0], PROMPTS[1] + RESPONSES[1]]
    # exactly what openrlhf.utils.remote_rm_utils posts, labels included
    response = http.post("/get_reward", json={"query": queries, "prompts": prompts, "labels": [None, None]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert {"rewards", "scores", "extra_logs"} <= set(body)
    expected = _library(store, "1", prompts, [" " + RESPONSES[0], RESPONSES[1]]).rewards
    np.testing.assert_allclose(body["rewards"], expected, atol=1e-5)
    assert body["scores"] == body["rewards"]
    flag = _library(store, "1", prompts, [" " + RESPONSES[0], RESPONSES[1]])
    assert set(body["extra_logs"]) == {"truncated", "prompt_found", "ood_score", "in_domain"}
    assert body["extra_logs"]["truncated"] == [0.0, 0.0] and body["extra_logs"]["prompt_found"] == [1.0, 1.0]
    assert body["extra_logs"]["in_domain"] == [float(d) for d in flag.in_domain] and body["in_domain"] == flag.in_domain.tolist()
    np.testing.assert_allclose(body["extra_logs"]["ood_score"], flag.ood_scores, rtol=1e-4)
    assert body["model"]["version"] == "1"
    bare = http.post("/get_reward", json={"query": queries[:1]}).json()  # older clients send the query alone
    np.testing.assert_allclose(bare["rewards"], _library(store, "1", [""], queries[:1]).rewards, atol=1e-5)
    assert bare["extra_logs"]["prompt_found"] == [0.0]


def test_model_and_report(store, http):
    info = http.post("/model").json()
    assert (info["name"], info["version"], info["alias"]) == (NAME, "1", "champion")
    assert info["run_id"] == MlflowClient().get_model_version(NAME, "1").run_id
    assert info["headline_metrics"]["mean_nts"] == pytest.approx(served_report(54.0).mean_nts, abs=0.01)
    assert info["max_length"] == MAX_LENGTH and "left" in info["truncation_policy"]
    assert info["precision"] == resolve_precision("auto")  # ANCHOR_RM_PRECISION unset: the hardware decides
    assert info["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")  # ANCHOR_RM_DEVICE unset: auto
    invariance = info["batch_invariance"]  # what tests/test_batching.py asserts
    assert (invariance["width_bucket"], invariance["bound"]) == (32, 1e-6) and "padded" in invariance["how"]
    density = store["scorers"]["1"].density
    flag = info["ood_flag"]
    assert flag["enabled"] is True and flag["threshold"] == pytest.approx(density.threshold, rel=1e-6)
    assert (flag["n_fit"], flag["fit_split"], flag["threshold_quantile"], flag["dimensions"]) == (120, "student_train", 0.95, 32)
    report = http.post("/report").json()
    assert report["mean_nts"] == pytest.approx(served_report(54.0).mean_nts)
    assert [row["dataset"] for row in report["splits"]] == ["hh-helpful-base", "pandalm"]


def _metric(http, name: str) -> float:
    # a gauge carries the worker's pid as a label (prometheus_client's multiprocess mode), a counter none
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith((name + " ", name + "{"))]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_every_scoring_endpoint_carries_the_ood_flag_and_the_metrics_count_it(store, http):
    """Per pair, in each protocol's own shape, the flag the library computes; /metrics counts what it judged
    and flagged. Text unlike the fit pairs is flagged; a version without a fit answers null and says why."""
    _champion("1")
    http.post("/reload")
    checked, flagged = _metric(http, "anchor_rm_ood_checked_pairs_total"), _metric(http, "anchor_rm_ood_flagged_pairs_total")
    prompt = "\n\nHuman: how do I look after a cat?\n\nAssistant:"  # /classify splits it off again
    texts = ["Gently, and check on tea every day.", "qzx " * 12 + "Ω≈ç√ " * 6, "I do not know about soup."]
    expected = _library(store, "1", [prompt] * 3, texts)
    assert not expected.in_domain.all() and expected.in_domain.any(), expected.ood_scores  # both kinds here
    inside, scores = expected.in_domain.tolist(), expected.ood_scores

    answers = {
        "/score": http.post("/score", json={"items": [{"prompt": prompt, "response": t} for t in texts]}).json(),
        "/best_of_n": http.post("/best_of_n", json={"prompt": prompt, "candidates": texts}).json(),
    }
    for path, body in answers.items():
        assert body["in_domain"] == inside, path
        np.testing.assert_allclose(body["ood_score"], scores, rtol=1e-4, err_msg=path)
    compared = http.post("/compare", json={"prompt": prompt, "response_a": texts[0], "response_b": texts[1]}).json()
    assert [compared["in_domain_a"], compared["in_domain_b"]] == inside[:2]
    np.testing.assert_allclose([compared["ood_score_a"], compared["ood_score_b"]], scores[:2], rtol=1e-4)
    for path in ("/classify", "/pooling"):
        items = http.post(path, json={"input": [prompt + " " + t for t in texts]}).json()["data"]
        assert [item["in_domain"] for item in items] == inside, path
        np.testing.assert_allclose([item["ood_score"] for item in items], scores, rtol=1e-4, err_msg=path)
    slime = http.post("/reward", json={"prompt": prompt, "response": texts[1]}).json()
    assert slime["in_domain"] == inside[1] and slime["ood_score"] == pytest.approx(scores[1], rel=1e-4)
    cohere = http.post("/v1/rerank", json={"query": prompt, "documents": texts}).json()["results"]
    tei = http.post("/rerank", json={"query": prompt, "texts": texts}).json()
    for results in (cohere, tei):
        assert {r["index"]: r["in_domain"] for r in results} == dict(enumerate(inside))
    judged = 3 + 3 + 2 + 3 + 3 + 1 + 3 + 3  # score, best_of_n, compare, classify, pooling, reward, two reranks
    out = inside.count(False)
    assert _metric(http, "anchor_rm_ood_checked_pairs_total") - checked == judged
    assert _metric(http, "anchor_rm_ood_flagged_pairs_total") - flagged == 6 * out + inside[:2].count(False) + (not inside[1])
    assert 0 < _metric(http, "anchor_rm_ood_flagged_fraction") <= 1

    _champion("2")  # registered without a fit: rewards as ever, the flag null, /model says why
    assert http.post("/reload").json()["current_version"] == "2"
    try:
        body = http.post("/score", json={"items": [{"prompt": prompt, "response": texts[0]}]}).json()
        assert body["ood_score"] == [None] and body["in_domain"] == [None] and len(body["rewards"]) == 1
        info = http.post("/model").json()["ood_flag"]
        assert info["enabled"] is False and "no fitted density" in info["reason"]
    finally:
        _champion("1")
        http.post("/reload")


def test_openapi_documents_every_endpoint(http):
    spec = http.get("/docs.json").json()
    for path in ("/score", "/best_of_n", "/compare", "/get_reward", "/classify", "/pooling", "/reward", "/v1/rerank",
                 "/v2/rerank", "/rerank", "/report", "/model", "/reload"):
        assert path in spec["paths"], path
    score_schema = json.dumps(spec["paths"]["/score"])
    assert "items" in score_schema or "ScoreRequest" in score_schema


BAD = [
    ("/score", {}, "items"),
    ("/score", {"items": []}, "items"),
    ("/score", {"items": [{"prompt": "p"}]}, "items[0].response"),
    ("/score", {"items": [{"prompt": 5, "response": "r"}]}, "items[0].prompt"),
    ("/score", {"items": [{"prompt": "", "response": "r"}]}, "items[0].prompt"),
    ("/score", {"items": "not a list"}, "items"),
    ("/score", {"items": [{"prompt": "p", "response": "r"}] * 9}, "limit of 8"),
    ("/score", {"items": [{"prompt": "p", "response": "x" * 4001}]}, "limit of 4000 bytes"),
    ("/score", {"items": [{"prompt": "p", "response": "r", "extra": SECRET_TEXT}]}, "items[0].extra"),
    ("/best_of_n", {"prompt": "p", "candidates": []}, "candidates"),
    ("/best_of_n", {"prompt": "p", "candidates": ["a"] * 5}, "limit of 4"),
    ("/best_of_n", {"prompt": "p"}, "candidates"),
    ("/best_of_n", {"prompt": "p", "candidates": ["a", None]}, "candidates[1]"),
    ("/compare", {"prompt": "p", "response_a": "a"}, "response_b"),
    ("/compare", {"prompt": "p", "response_a": "a", "response_b": "  "}, "response_b"),
    ("/get_reward", {"query": ["q1", "q2"], "prompts": ["q"]}, "prompts"),
    ("/get_reward", {"query": [], "prompts": ["p"]}, "query"),
    ("/get_reward", {"query": "q"}, "query"),
    ("/get_reward", {"prompts": ["p"]}, "query"),
]


@pytest.mark.parametrize("path, body, words", BAD)
def test_bad_input_is_a_4xx_naming_field_and_limit(http, path, body, words):
    response = http.post(path, json=body)
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert words in response.json()["error"], response.text


def test_malformed_bodies_never_give_a_5xx(http):
    cases = [b"", b"{", b"null", b"[]", b"\"text\"", b"{\"items\": [[1, 2]]}", SECRET_TEXT.encode(),
             b'{"items": [{"prompt": "\\ud800", "response": "r"}]}', b"\xff\xfe", b"{\"prompt\": {}}" * 3,
             b"[" * 5000 + b"]" * 5000]
    rng = random.Random(0)
    cases += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))) for _ in range(10)]
    for path in ("/score", "/best_of_n", "/compare", "/get_reward"):
        for content in cases:
            response = http.post(path, content=content, headers={"Content-Type": "application/json"})
            assert 400 <= response.status_code < 500, (path, content[:40], response.status_code, response.text[:300])
            assert "error" in response.text
    big = http.post("/score", content=b"x" * 200001, headers={"Content-Type": "application/json"})
    assert big.status_code == 413 and "200000 bytes" in big.json()["error"]
    text = http.post("/score", content=b"prompt=x", headers={"Content-Type": "text/plain"})
    assert 400 <= text.status_code < 500


def test_reward_does_not_depend_on_the_batch(store, http):
    """One pair alone, then inside a crowd of concurrent requests of other lengths (the batcher mixes them);
    its reward may move by at most 1e-4."""
    pair = {"prompt": PROMPTS[1], "response": RESPONSES[1]}
    alone = http.post("/score", json={"items": [pair]}).json()["rewards"][0]
    others = [{"prompt": "x " * n, "response": "y " * (n // 2 + 1)} for n in range(1, 40, 3)]
    with ThreadPoolExecutor(16) as pool:
        futures = []
        for round_ in range(4):
            for i, other in enumerate(others):
                items = [other, pair] if (i + round_) % 2 else [pair, other]
                futures.append((items.index(pair), pool.submit(http.post, "/score", json={"items": items})))
        results = [(idx, f.result()) for idx, f in futures]
    for idx, response in results:
        assert response.status_code == 200, response.text
        assert abs(response.json()["rewards"][idx] - alone) <= 1e-4
    # the service's histogram of requests per batch: some batches must have held more than one request
    single = total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("anchor_rm_batch_requests_bucket") and 'le="1.0"' in line:
            single += float(line.rsplit(" ", 1)[1])
        elif line.startswith("anchor_rm_batch_requests_count"):
            total += float(line.rsplit(" ", 1)[1])
    assert total > single, (single, total)


def test_alias_moves_reach_the_service_without_failing_requests(store, server, http):
    prompts, responses = PROMPTS[:2], RESPONSES[:2]
    expected = {v: _library(store, v, prompts, responses).rewards for v in ("1", "2")}
    body = {"items": [{"prompt": p, "response": r} for p, r in zip(prompts, responses)]}
    stop = threading.Event()
    seen, failures = [], []

    def traffic():
        with httpx.Client(base_url=server["url"], headers={"X-API-Key": KEY}, timeout=60) as client:
            while not stop.is_set():
                r = client.post("/score", json=body)
                if r.status_code != 200:
                    failures.append((r.status_code, r.text))
                    continue
                out = r.json()
                seen.append(out["model"]["version"])
                if not np.allclose(out["rewards"], expected[out["model"]["version"]], atol=1e-5):
                    failures.append(("wrong rewards for the named version", out))

    threads = [threading.Thread(target=traffic) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        # 1. the authenticated reload endpoint
        assert httpx.post(server["url"] + "/reload").status_code == 401
        _champion("2")
        reloaded = http.post("/reload").json()
        assert reloaded["current_version"] == "2" and reloaded["error"] is None
        assert http.post("/model").json()["version"] == "2"
        assert http.post("/score", json=body).json()["model"]["version"] == "2"
        time.sleep(1)
        # 2. polling (every 2 s here): move the alias back and wait
        _champion("1")
        deadline = time.time() + 60
        while http.post("/model").json()["version"] != "1" and time.time() < deadline:
            time.sleep(0.5)
        assert http.post("/model").json()["version"] == "1"
        time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not failures, failures[:3]
    assert {"1", "2"} <= set(seen)


def test_logs_hold_no_bodies_and_no_keys(server, http):
    http.post("/score", json={"items": [{"prompt": SECRET_TEXT, "response": SECRET_TEXT}]})
    http.post("/score", content=b"{" + SECRET_TEXT.encode(), headers={"Content-Type": "application/json"})
    time.sleep(0.5)
    log = Path(server["log"]).read_text(errors="replace")
    assert "Service anchor_rm_reward initialized" in log or "anchor_rm_reward" in log
    assert SECRET_TEXT not in log
    assert KEY not in log
