"""Hostile input and load against a real `bentoml serve` (the server of test_service_http: two tiny
registered versions, an API key, small limits), over HTTP on 127.0.0.1 (docs/reliability.md):

- every endpoint of the service's own OpenAPI schema fuzzed with schemathesis, inputs that fit the schema and
  inputs that do not: no 5xx;
- requests without the API key (or with a wrong one): 401, and nothing is scored;
- 64 concurrent clients while the champion alias moves: no failed request, memory stable. The 60-second
  version is bench/load_service.py.
"""

from __future__ import annotations

import sys
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from mlflow.tracking import MlflowClient
from schemathesis.generation import GenerationMode

from helpers import ROOT
from service_fixtures import KEY, NAME, PROMPTS, RESPONSES

sys.path.insert(0, str(ROOT / "bench"))
import load_service  # noqa: E402

pytestmark = pytest.mark.slow

ENDPOINTS = ("/score", "/best_of_n", "/compare", "/get_reward", "/classify", "/pooling", "/reward", "/v1/rerank",
             "/v2/rerank", "/rerank", "/model", "/report", "/reload")
BODY_ENDPOINTS = ("/score", "/best_of_n", "/compare", "/get_reward", "/classify", "/pooling", "/reward", "/v1/rerank",
                  "/v2/rerank", "/rerank")
FUZZ_EXAMPLES = 40  # per endpoint and mode: about 1,000 requests in all
AUTH = {"Authorization": f"Bearer {KEY}"}


def _counter(metrics_text: str, endpoint: str, status: int | None = None) -> float:
    """BentoML's request counter for one endpoint, summed over status codes (or for one)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if (line.startswith("bentoml_service_request_total") and f'endpoint="{endpoint}"' in line
                and (status is None or f'http_response_code="{status}"' in line)):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _scored_pairs(metrics_text: str) -> float:
    """The service's own counter of pairs the model scored (service/service.py)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
              if line.startswith("anchor_rm_scored_pairs_total")]
    return sum(values)


def test_requests_without_the_key_are_refused_and_nothing_is_scored(server, http):
    url = server["url"]
    bodies = {"/score": {"items": [{"prompt": "p", "response": "r"}]}, "/best_of_n": {"prompt": "p", "candidates": ["a"]},
              "/compare": {"prompt": "p", "response_a": "a", "response_b": "b"}, "/get_reward": {"query": ["q"]},
              "/classify": {"input": "q"}, "/pooling": {"input": "q"}, "/reward": {"prompt": "p", "response": "r"},
              "/v1/rerank": {"query": "q", "documents": ["a"]}, "/v2/rerank": {"query": "q", "documents": ["a"]},
              "/rerank": {"query": "q", "texts": ["a"]}, "/model": {}, "/report": {}, "/reload": {}}
    # the counter counts: one authenticated score moves it
    before = _scored_pairs(http.get("/metrics").text)
    assert http.post("/score", json=bodies["/score"]).status_code == 200
    metrics = http.get("/metrics").text
    scored_once = _scored_pairs(metrics)
    assert scored_once == before + 1
    refused_before = {path: _counter(metrics, path, 401) for path in ENDPOINTS}

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": KEY + "x"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        for path in ENDPOINTS:
            response = httpx.post(url + path, json=bodies[path], headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers, response.status_code)
            assert "API key" in response.json()["error"] and KEY not in response.text
        assert httpx.get(url + "/docs.json", headers=headers).status_code == 401
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 401
    metrics = http.get("/metrics").text
    assert _scored_pairs(metrics) == scored_once  # nothing was scored
    for path in ("/score", "/best_of_n", "/compare", "/get_reward", "/classify", "/reward", "/v1/rerank", "/reload"):
        assert _counter(metrics, path, 401) - refused_before[path] == 5, path  # each refusal was counted as a 401


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(server["url"] + "/docs.json", headers=AUTH, timeout=30)
    schema.config.generation.update(deterministic=True, database="none")
    return schema


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzing_every_endpoint_from_the_openapi_schema_gives_no_5xx(server, api_schema, mode):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert set(ENDPOINTS) <= paths, paths
    statuses: dict[str, set[int]] = {}
    server_errors: list[str] = []
    sent: Counter = Counter()
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case) -> None:
            response = case.call(base_url=server["url"], headers=AUTH, timeout=60)
            statuses.setdefault(operation.path, set()).add(response.status_code)
            sent[response.status_code] += 1
            if response.status_code >= 500:
                server_errors.append(f"{operation.method.upper()} {operation.path} {case.body!r:.300} -> "
                                     f"{response.status_code} {response.text[:300]}")

        try:
            call()
        except Unsatisfiable:  # no input can violate the schema (an endpoint without fields)
            assert mode == GenerationMode.NEGATIVE and operation.path not in BODY_ENDPOINTS, operation.path
    print(f"fuzz {mode.value}: {sum(sent.values())} requests, status codes {dict(sorted(sent.items()))}")
    assert not server_errors, server_errors[:5]
    assert set(ENDPOINTS if mode == GenerationMode.POSITIVE else BODY_ENDPOINTS) <= set(statuses), statuses
    if mode == GenerationMode.NEGATIVE:  # schema-violating bodies were refused, not scored
        assert all(4 in {code // 100 for code in statuses[p]} for p in ("/score", "/best_of_n", "/compare")), statuses
    else:
        assert 200 in statuses["/score"] and 200 in statuses["/model"], statuses


def test_64_clients_while_the_alias_moves_fail_nothing(store, server):
    """The short CI version of bench/load_service.py: 64 clients for 10 s steady, then 10 s while the champion
    moves 1 -> 2 -> 1 ... every 2 s (each move followed by /reload). Every HTTP answer must be 200 or 503."""
    url, pid = server["url"], server["proc"].pid
    pairs = list(zip(PROMPTS[:2], RESPONSES[:2]))
    MlflowClient().set_registered_model_alias(NAME, "champion", "1")
    httpx.post(url + "/reload", headers=AUTH, timeout=60)
    load_service.drive(url, pairs, 8, 2, api_key=KEY)  # warm-up
    steady, steady_rss = load_service.drive(url, pairs, 64, 10, pid, api_key=KEY)
    moves: list = []
    moving, moving_rss = load_service.drive(url, pairs, 64, 10, pid, api_key=KEY,
                                            during=load_service.alias_mover(url, 2, moves, api_key=KEY))
    for phase in (steady, moving):  # every request answered (no reset connection), with 200 or 503
        assert phase["failures"] == 0 and phase["transport_errors"] == 0, phase["failure_examples"]
        assert set(phase["status_codes"]) <= {"200", "503"}, phase
    assert steady["ok"] > 64, steady
    assert len(moves) >= 3 and all(m["served"] == m["to"] and m["error"] is None for m in moves), moves
    assert set(moving["versions_seen"]) == {"1", "2"}, moving
    start, end = steady_rss[0][1], moving_rss[-1][1]
    assert end < start * 1.25, (steady_rss, moving_rss)  # memory stable under 20 s of load
