"""The RLHF trainers' protocols without a server (service/protocols.py), the loading 503 of the guard and
the GET routes, the background first load, and the Python client against a mock transport."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from anchor_rm.client import AsyncRewardClient, RewardClient, RewardServiceError, Scores, TRLRewardFunction
from anchor_rm.model.scoring import conversation_to_pair, sigmoid, split_transcript
from service import protocols
from service.get_routes import GetRoutes
from service.guard import ApiGuard
from service.holder import ModelHolder
from service.protocols import ClassifyRequest, RerankRequest, SampleRequest
from service.schemas import RequestError, ServingLimits

LIMITS = ServingLimits(max_items=4, max_candidates=3, max_text_bytes=200)
HH = "\n\nHuman: How do I boil an egg?\n\nAssistant:"


def test_conversations_and_transcripts_become_pairs():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "text", "text": "Egg?"}]},
                {"role": "assistant", "content": "Boil it."}]
    assert conversation_to_pair(messages) == ("Be brief.\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: Egg?\n\nAssistant:",
                                              "Boil it.")
    with pytest.raises(ValueError, match="last message must be the assistant"):
        conversation_to_pair([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="role must be system, user or assistant"):
        conversation_to_pair([{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}])
    assert split_transcript(HH + " Boil it.") == (HH, "Boil it.", True)
    chat = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>"
    assert split_transcript(chat) == ("", chat, False)


def test_classify_takes_input_or_messages_and_names_what_is_wrong():
    one = protocols.classify_pairs(ClassifyRequest(model="m", input=HH + " Boil it."), LIMITS)
    assert (one.prompts, one.responses, one.prompt_found) == ([HH], ["Boil it."], [True])
    many = protocols.classify_pairs(ClassifyRequest(input=["plain text", HH + " x"]), LIMITS)
    assert many.prompts == ["", HH] and many.prompt_found == [False, True]
    chat = protocols.classify_pairs(ClassifyRequest(messages=[{"role": "user", "content": "Egg?"},
                                                              {"role": "assistant", "content": "Boil it."}]), LIMITS)
    assert chat.prompts == ["\n\nHuman: Egg?\n\nAssistant:"] and chat.responses == ["Boil it."]
    cases = [({}, "input", "exactly one"), ({"input": "a", "messages": []}, "input", "exactly one"),
             ({"input": []}, "input", "empty"), ({"input": ["a"] * 5}, "input", "limit of 4"),
             ({"input": [[1, 2, 3]]}, "input[0]", "token ids"), ({"input": "x" * 201}, "input[0]", "limit of 200 bytes"),
             ({"messages": []}, "messages", "empty"), ({"messages": [{"role": "user", "content": "q"}]}, "messages",
                                                       "assistant")]
    for body, field_name, words in cases:
        with pytest.raises(RequestError) as err:
            protocols.classify_pairs(ClassifyRequest.model_validate(body), LIMITS)
        assert err.value.field == field_name and words in str(err.value), (body, str(err.value))


def test_activation_follows_vllm_and_older_clients():
    assert protocols.use_activation(ClassifyRequest(input="x")) is True  # vLLM's default for classify
    assert protocols.use_activation(ClassifyRequest(input="x", use_activation=False)) is False  # verl
    assert protocols.use_activation(ClassifyRequest(input="x", activation=False)) is False  # older verl
    assert protocols.use_activation(ClassifyRequest(input="x", use_activation=True, activation=False)) is True
    assert protocols.use_activation(ClassifyRequest(input="x"), default=False) is False  # /pooling
    raw = protocols.classify_response("m", [2.0, -1.0], [7, 5], activation=False)
    assert raw["object"] == "list" and raw["model"] == "m" and raw["id"].startswith("classify-")
    assert raw["data"][-1]["probs"][-1] == -1.0 and raw["data"][0] == {"index": 0, "label": "reward", "probs": [2.0],
                                                                        "num_classes": 1}
    assert raw["usage"] == {"prompt_tokens": 12, "total_tokens": 12, "completion_tokens": 0, "prompt_tokens_details": None}
    assert protocols.classify_response("m", [2.0], [1], activation=True)["data"][0]["probs"] == [pytest.approx(sigmoid(2.0))]
    pooled = protocols.pooling_response("m", [2.0], [3], activation=False)
    assert pooled["data"] == [{"index": 0, "object": "pooling", "data": [2.0]}] and pooled["id"].startswith("pool-")
    listing = protocols.models_response("anchor-rm-helpful", "models:/anchor-rm-helpful/1", 192, 1700000000)
    assert listing["object"] == "list" and listing["data"][0]["id"] == "anchor-rm-helpful"
    assert listing["data"][0]["max_model_len"] == 192 and listing["data"][0]["object"] == "model"


def test_slime_sample_and_rerank_shapes():
    assert protocols.sample_pair(SampleRequest(prompt="p", response="r", label="4"), LIMITS) == ("p", "r")
    assert protocols.sample_pair(SampleRequest(prompt=[{"role": "user", "content": "Egg?"}], response=""), LIMITS) == \
        ("\n\nHuman: Egg?\n\nAssistant:", "")
    cohere = RerankRequest(model="m", query="q", documents=["a", {"text": "b"}, "c"], top_n=2, return_documents=True)
    rerank = protocols.rerank_candidates(cohere, LIMITS)
    assert rerank.documents == ["a", "b", "c"] and not rerank.tei
    answer = protocols.rerank_response(cohere, rerank, [0.5, 2.0, -1.0], "m", [3, 3, 3])
    assert [r["index"] for r in answer["results"]] == [1, 0]  # best first, top_n
    assert answer["results"][0] == {"index": 1, "relevance_score": pytest.approx(sigmoid(2.0)), "document": {"text": "b"}}
    tei = RerankRequest(query="q", texts=["a", "b"], raw_scores=True)
    assert protocols.rerank_response(tei, protocols.rerank_candidates(tei, LIMITS), [0.5, 2.0], "m", [1, 1]) == \
        [{"index": 1, "score": 2.0}, {"index": 0, "score": 0.5}]
    for body, field_name in [({"query": "q"}, "documents"), ({"query": "q", "documents": ["a"] * 4}, "documents"),
                             ({"query": "q", "texts": [""]}, "texts[0]"), ({"query": "", "texts": ["a"]}, "query"),
                             ({"query": "q", "documents": [{"text": 3}]}, "documents[0].text"),
                             ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n")]:
        with pytest.raises(RequestError) as err:
            protocols.rerank_candidates(RerankRequest.model_validate(body), LIMITS)
        assert err.value.field == field_name, (body, err.value)


# ---------------------------------------------------------------------------------------------------
# ASGI layers and the first load.

def _asgi(app, method: str, path: str, headers=()) -> tuple[int, dict, dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": method, "path": path, "headers": list(headers)}, receive, send))
    head = sent[0]
    return head["status"], dict(head["headers"]), json.loads(sent[1]["body"] or b"null")


def test_while_loading_model_paths_answer_503_with_retry_after_and_readyz_says_why():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{\"ok\": true}"})

    reason = ["loading models:/x@champion (since now)"]
    guard = ApiGuard(app, api_key="k", not_ready=lambda: reason[0], model_paths=("/score", "/v1/models"))
    auth = [(b"authorization", b"Bearer k")]
    assert _asgi(guard, "POST", "/score")[0] == 401  # the key is checked first
    status, headers, body = _asgi(guard, "POST", "/score", auth)
    assert status == 503 and headers[b"retry-after"] == b"5" and "not loaded yet: loading models:/x" in body["error"]
    status, _, body = _asgi(guard, "GET", "/readyz")
    assert (status, body) == (503, {"ready": False, "reason": reason[0]})
    assert _asgi(guard, "GET", "/livez")[0] == 200  # liveness is not readiness
    reason[0] = None  # loaded
    assert _asgi(guard, "POST", "/score", auth)[0] == 200 and _asgi(guard, "GET", "/readyz")[0] == 200

    routes = GetRoutes(app, routes={"/v1/models": lambda: (200, {"object": "list"})})
    status, headers, body = _asgi(routes, "GET", "/v1/models")
    assert (status, headers[b"content-type"], body) == (200, b"application/json", {"object": "list"})
    assert _asgi(routes, "POST", "/v1/models")[2] == {"ok": True}  # other methods pass through


def test_the_first_load_runs_in_the_background_and_is_retried_until_it_works(tmp_path):
    attempts = []

    def loader(uri, folder):
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise FileNotFoundError(f"no registered model behind {uri}")
        return type("Served", (), {"resolved": uri, "version": "1", "folder": None})()

    holder = ModelHolder("models:/x@champion", tmp_path, loader=loader, target=lambda uri: "1")
    thread = holder.load_in_background(retry_seconds=0.2)
    assert holder.not_ready_reason() is not None
    deadline = time.time() + 20
    while not holder.loaded and time.time() < deadline:
        reason = holder.not_ready_reason()
        assert reason.startswith("loading models:/x@champion")
        time.sleep(0.05)
    thread.join(timeout=5)
    assert holder.loaded and holder.not_ready_reason() is None and len(attempts) == 3
    holder.close()


def test_a_failed_first_load_is_reported_with_its_error(tmp_path):
    def loader(uri, folder):
        raise FileNotFoundError("no registered model 'x'")

    holder = ModelHolder("models:/x@champion", tmp_path, loader=loader)
    holder.load_in_background(retry_seconds=30)
    deadline = time.time() + 10
    while holder.load_error is None and time.time() < deadline:
        time.sleep(0.05)
    assert "failed: FileNotFoundError: no registered model 'x'; retrying every 30 s" in holder.not_ready_reason()
    holder.close()


# ---------------------------------------------------------------------------------------------------
# The client.

def _client_with(responses: list, **kwargs) -> tuple[RewardClient, list]:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content), request.headers.get("authorization")))
        answer = responses.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    client = RewardClient("http://rm", api_key="k", backoff=0.01, **kwargs)
    client._http = httpx.Client(base_url="http://rm", transport=httpx.MockTransport(handler),
                                headers={"Authorization": "Bearer k"})
    return client, seen


def test_the_client_retries_503_and_connection_errors_only():
    ok = httpx.Response(200, json={"rewards": [0.5]})
    client, seen = _client_with([httpx.Response(503, headers={"Retry-After": "0"}, json={"error": "loading"}),
                                 httpx.ConnectError("refused"), ok])
    assert client.score([("p", "r")]) == [0.5] and len(seen) == 3
    assert seen[0] == ("/score", {"items": [{"prompt": "p", "response": "r"}]}, "Bearer k")
    client, seen = _client_with([httpx.Response(400, json={"error": "items[0].prompt: is empty"})])
    with pytest.raises(RewardServiceError, match="HTTP 400: items\\[0\\].prompt: is empty") as err:
        client.score([("", "r")])
    assert err.value.status == 400 and len(seen) == 1  # a 4xx is final
    client, seen = _client_with([httpx.Response(503, json={"error": "overloaded"})] * 3, retries=2)
    with pytest.raises(RewardServiceError, match="HTTP 503"):
        client.score([("p", "r")])
    assert len(seen) == 3
    client, _ = _client_with([httpx.Response(200, json={"rewards": [1.0, 3.0], "ranking": [1, 0], "best_index": 1,
                                                        "truncated": [False, False], "model": {"name": "m"}}),
                              httpx.Response(200, json={"p_a_preferred": 0.25})])
    assert client.best_of_n("p", ["a", "b"]).best_index == 1 and client.compare("p", "a", "b") == 0.25


def test_the_clients_wait_follows_retry_after_clamped_with_jitter():
    from anchor_rm.client import _delay

    def waits(retry_after: str, attempt: int = 0) -> list[float]:
        response = httpx.Response(503, headers={"Retry-After": retry_after})
        return [_delay(attempt, response, backoff=0.5, max_backoff=30.0) for _ in range(200)]

    assert all(5.0 <= w <= 5.5 for w in waits("5")) and len(set(waits("5"))) > 1  # jitter up to 10%
    assert all(0.0 <= w <= 0.0 for w in waits("-3"))  # a negative Retry-After: no wait, never a ValueError
    assert all(30.0 <= w <= 33.0 for w in waits("3600"))  # clamped to max_backoff
    for unusable in ("nan", "inf", "Wed, 21 Oct 2026 07:28:00 GMT", ""):
        assert all(2.0 <= w <= 2.2 for w in waits(unusable, attempt=2)), unusable  # backoff 0.5 * 2**2


def test_the_async_client_and_the_trl_reward_function():
    async def run():
        def handler(request):
            return httpx.Response(200, json={"rewards": [0.1] * len(json.loads(request.content)["items"])})

        client = AsyncRewardClient("http://rm")
        client._http = httpx.AsyncClient(base_url="http://rm", transport=httpx.MockTransport(handler))
        async with client:
            return await client.score([("p", "r"), ("p", "s")])

    assert asyncio.run(run()) == [0.1, 0.1]
    calls = []

    class Fake:
        def score_details(self, pairs):
            calls.append(pairs)
            return Scores([float(len(r)) for _, r in pairs], [len(r) / 2 for _, r in pairs],
                          [len(r) < 3 for _, r in pairs], [False] * len(pairs), {"name": "m", "version": "1"})

    seen = []
    reward = TRLRewardFunction(Fake(), batch_size=2, on_scores=seen.append)
    assert reward(prompts=["a", "b", "c"], completions=["x", "yy", "zzz"], trainer_state=None) == [1.0, 2.0, 3.0]
    assert [len(c) for c in calls] == [2, 1]
    # The OOD flag of every completion of the call, in order, reaches the callback once (and last_scores).
    assert len(seen) == 1 and seen[0] is reward.last_scores
    assert seen[0].ood_score == [0.5, 1.0, 1.5] and seen[0].in_domain == [True, True, False]
    conversational = reward(prompts=[[{"role": "user", "content": "Egg?"}]],
                            completions=[[{"role": "assistant", "content": "Boil."}]])
    assert conversational == [5.0] and calls[-1] == [("\n\nHuman: Egg?\n\nAssistant:", "Boil.")]
    assert reward.__name__ == "anchor_rm_reward"  # TRL names the logged reward after it
