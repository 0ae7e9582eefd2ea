"""The RLHF trainers' own requests against a real `bentoml serve` (the served service of
tests/service_fixtures.py): OpenRLHF's /get_reward client replayed with its timeout and retries, verl's
/classify, a plain OpenAI-style client (GET /v1/models, then /classify with messages), /pooling, slime's
/reward, rerank in Cohere's and TEI's shapes, the package's client, a TRL GRPOTrainer scoring through the
service; and a service whose model is not there yet, answering 503 until it is."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.request

import httpx
import pytest

from anchor_rm.client import RewardClient, TRLRewardFunction
from anchor_rm.model.scoring import sigmoid
from helpers import ROOT, free_port, register_version, sqlite_store, stop_process_group, tiny_model_folder
from service.config import serve_command
from service_fixtures import KEY, MAX_LENGTH, NAME, served_report

pytestmark = pytest.mark.slow

HH_PROMPT = "\n\nHuman: How do I boil an egg?\n\nAssistant:"
RESPONSE = "Put it in boiling water for eight minutes."


def _library(store, prompts, responses, version="1"):
    return [float(r) for r in store["scorers"][version].score(prompts, responses).rewards]


def test_openrlhf_client_replayed_with_two_reward_servers(store, server):
    """OpenRLHF's SingleTurnAgentExecutor._fetch_rewards_via_http (openrlhf/utils/agent.py, v0.11.0): one sample
    per call, split over the servers of --reward.remote_url, so that every server after the first gets empty
    lists; aiohttp, 180 s per attempt, 5 attempts 1 s apart, 4xx retried too. Two URLs to this service."""
    import aiohttp

    url = server["url"] + "/get_reward"
    attempts = []

    async def fetch(queries, prompts, labels, endpoints):
        batch_size = (len(queries) + len(endpoints) - 1) // len(endpoints)
        timeout = aiohttp.ClientTimeout(total=180)

        async def post(endpoint, data, try_max_times=5):
            for _ in range(try_max_times):
                attempts.append(endpoint)
                try:
                    async with aiohttp.ClientSession(timeout=timeout) as session:
                        async with session.post(endpoint, json=data, headers={"Authorization": f"Bearer {KEY}"}) as r:
                            r.raise_for_status()
                            return await r.json()
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(1)
            raise RuntimeError(f"{endpoint}: no answer after {try_max_times} tries")

        tasks = []
        for i, endpoint in enumerate(endpoints):
            start, end = i * batch_size, min((i + 1) * batch_size, len(queries))
            payload = {"query": queries[start:end], "prompts": prompts[start:end], "labels": labels[start:end]}
            tasks.append(asyncio.create_task(post(endpoint, payload)))
        return await asyncio.gather(*tasks)

    first, second = asyncio.run(fetch([HH_PROMPT + " " + RESPONSE], [HH_PROMPT], [""], [url, url]))
    assert len(attempts) == 2  # one attempt each: nothing failed, nothing was retried
    assert first["rewards"] == pytest.approx(_library(store, [HH_PROMPT], [" " + RESPONSE]), abs=1e-5)
    assert first["scores"] == first["rewards"] and first["extra_logs"]["prompt_found"] == [1.0]
    assert (second["rewards"], second["scores"]) == ([], [])  # the second server's empty lists: 200, not an error
    assert all(isinstance(v, list) for v in second["extra_logs"].values())


def test_verl_classify_request_and_older_activation_key(store, http):
    """verl's reward loop (verl/experimental/reward_loop/reward_loop.py): {"model", "input", "use_activation":
    false} to /classify, score read as data[-1]["probs"][-1]; verl before 2026-02 sends "activation"."""
    text = HH_PROMPT + " " + RESPONSE
    expected = _library(store, [HH_PROMPT], [RESPONSE])[0]
    for key in ("use_activation", "activation"):
        output = http.post("/classify", json={"model": "Skywork/Skywork-Reward-Llama-3.1-8B-v0.2", "input": text,
                                              key: False}).json()
        assert output["data"][-1]["probs"][-1] == pytest.approx(expected, abs=1e-5), key
        assert output["object"] == "list" and output["data"][0]["num_classes"] == 1
        assert output["usage"]["prompt_tokens"] == output["usage"]["total_tokens"] > 0
    default = http.post("/classify", json={"input": [text, "plain text, no transcript"]}).json()
    assert [d["index"] for d in default["data"]] == [0, 1]
    assert default["data"][0]["probs"][0] == pytest.approx(sigmoid(expected), abs=1e-5)  # vLLM's default: activation


def test_plain_openai_style_http_models_then_classify_messages(store, server):
    """A client with no library: urllib, GET /v1/models for the model id, then /classify with messages."""
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(server["url"] + "/v1/models", headers=auth), timeout=30) as r:
        models = json.load(r)
    assert models["object"] == "list" and models["data"][0]["id"] == NAME
    assert models["data"][0]["max_model_len"] == MAX_LENGTH
    body = {"model": models["data"][0]["id"], "use_activation": False,
            "messages": [{"role": "user", "content": "How do I boil an egg?"}, {"role": "assistant", "content": RESPONSE}]}
    request = urllib.request.Request(server["url"] + "/classify", data=json.dumps(body).encode(), headers=auth)
    with urllib.request.urlopen(request, timeout=30) as r:
        output = json.load(r)
    assert output["model"] == NAME
    assert output["data"][0]["probs"][0] == pytest.approx(_library(store, [HH_PROMPT], [RESPONSE])[0], abs=1e-5)
    pooled = httpx.post(server["url"] + "/pooling", json={"input": HH_PROMPT + " " + RESPONSE}, headers=auth).json()
    assert pooled["data"][0]["object"] == "pooling"
    assert pooled["data"][0]["data"] == [pytest.approx(output["data"][0]["probs"][0], abs=1e-5)]  # raw by default
    refused = httpx.get(server["url"] + "/v1/models")
    assert refused.status_code == 401  # the API key guards the GET route too


def test_slime_sample_and_rerank_in_cohere_and_tei_shapes(store, http):
    slime = http.post("/reward", json={"prompt": HH_PROMPT, "response": RESPONSE, "label": "8"}).json()
    assert slime["reward"] == slime["score"] == pytest.approx(_library(store, [HH_PROMPT], [RESPONSE])[0], abs=1e-5)
    documents = ["Microwave it in its shell.", RESPONSE, "I do not know."]
    rewards = _library(store, [HH_PROMPT] * 3, documents)
    order = sorted(range(3), key=lambda i: -rewards[i])
    litellm = {"model": "anchor-rm", "query": HH_PROMPT, "documents": documents, "top_n": 2, "return_documents": True}
    for path in ("/v1/rerank", "/v2/rerank"):
        answer = http.post(path, json=litellm).json()
        assert [r["index"] for r in answer["results"]] == order[:2], path
        assert answer["results"][0]["relevance_score"] == pytest.approx(sigmoid(rewards[order[0]]), abs=1e-5)
        assert answer["results"][0]["document"] == {"text": documents[order[0]]}
    tei = http.post("/rerank", json={"query": HH_PROMPT, "texts": documents, "raw_scores": True}).json()
    assert isinstance(tei, list) and [r["index"] for r in tei] == order
    assert tei[0]["score"] == pytest.approx(rewards[order[0]], abs=1e-5) and "text" not in tei[0]
    bad = http.post("/v1/rerank", json={"query": HH_PROMPT, "documents": []})
    assert bad.status_code == 400 and bad.json()["field"] == "documents"


def test_the_package_client_and_a_trl_grpo_run_score_through_the_service(store, server, http):
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from anchor_rm.model.loading import load_tokenizer, resolve_model

    with RewardClient(server["url"], api_key=KEY, timeout=60) as client:
        assert client.score([(HH_PROMPT, RESPONSE)]) == pytest.approx(_library(store, [HH_PROMPT], [RESPONSE]), abs=1e-5)
        best = client.best_of_n(HH_PROMPT, ["No idea.", RESPONSE])
        assert best.ranking[0] == best.best_index and best.model["name"] == NAME
        assert 0.0 < client.compare(HH_PROMPT, RESPONSE, "No idea.") < 1.0

        tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        torch.manual_seed(0)
        policy = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                              eos_token_id=tokenizer.eos_token_id))
        args = GRPOConfig(output_dir=str(store["workdir"] / "grpo"), max_steps=2, per_device_train_batch_size=2,
                          num_generations=2, max_completion_length=8, logging_steps=1, report_to="none", use_cpu=True,
                          bf16=False, save_strategy="no")
        prompts = Dataset.from_dict({"prompt": [HH_PROMPT, "\n\nHuman: Tell me a joke.\n\nAssistant:"] * 2})
        before = _scored(http)
        trainer = GRPOTrainer(model=policy, reward_funcs=TRLRewardFunction(client), args=args, train_dataset=prompts,
                              processing_class=tokenizer)
        trainer.train()
    logged = [h for h in trainer.state.log_history if "rewards/anchor_rm_reward/mean" in h]
    assert trainer.state.global_step == 2 and len(logged) == 2, trainer.state.log_history
    assert _scored(http) - before == 4  # 2 steps x 2 completions, every one scored by the service


def _scored(http) -> float:
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith("anchor_rm_scored_pairs_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_while_the_model_is_not_there_every_endpoint_answers_503_then_serves(tmp_path, minilm_tokenizer):
    """A service started before its model exists: 503 with Retry-After and a JSON reason on every model
    endpoint, /readyz says why, /livez is fine; once the version is registered it loads and serves."""
    with sqlite_store(tmp_path, "late-model") as uri:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ANCHOR_RM_", "BENTOML_", "MLFLOW_"))}
        env.update({"MLFLOW_TRACKING_URI": uri, "BENTOML_HOME": str(tmp_path / "bentoml"), "BENTOML_DO_NOT_TRACK": "true",
                    "ANCHOR_RM_POLL_SECONDS": "1", "ANCHOR_RM_MODEL_URI": "models:/late-model@champion",
                    "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
        with open(tmp_path / "serve.log", "w") as log:
            proc = subprocess.Popen(serve_command(port, "127.0.0.1"), cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 180
            while time.time() < deadline:
                try:
                    if httpx.get(url + "/livez", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.5)
            ready = httpx.get(url + "/readyz", timeout=10)
            assert ready.status_code == 503 and "late-model" in ready.json()["reason"], ready.text
            for path, body in (("/score", {"items": [{"prompt": "p", "response": "r"}]}), ("/classify", {"input": "x"}),
                               ("/get_reward", {"query": ["q"]}), ("/model", {})):
                answer = httpx.post(url + path, json=body, timeout=10)
                assert answer.status_code == 503 and answer.headers["retry-after"] == "5", (path, answer.text)
                assert "not loaded yet" in answer.json()["error"], path
            assert httpx.get(url + "/v1/models", timeout=10).status_code == 503

            folder = tiny_model_folder(tmp_path / "model", minilm_tokenizer, max_length=MAX_LENGTH)
            version = register_version(folder, served_report(54.0), "late-model")
            from anchor_rm.mlflow_edge.registry import set_alias
            set_alias("late-model", "champion", version)
            deadline = time.time() + 120
            while httpx.get(url + "/readyz", timeout=10).status_code != 200 and time.time() < deadline:
                time.sleep(0.5)
            scored = httpx.post(url + "/score", json={"items": [{"prompt": "p", "response": "r"}]}, timeout=60)
            assert scored.status_code == 200 and scored.json()["model"] == {"name": "late-model", "version": version}
        finally:
            stop_process_group(proc)
