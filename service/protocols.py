"""The reward protocols RLHF trainers already speak, without the HTTP framework: request shapes (pydantic,
so the OpenAPI page documents them), their checks (field and limit named, as in schemas.py) and the
answers, built from rewards. service/service.py wires them into BentoML; every one scores through the same
batcher and `RewardScorer` as /score.

    vLLM (verl's reward loop, any vLLM client)  POST /classify, POST /pooling, GET /v1/models
    slime / miles (--rm-url)                    POST /reward      {"prompt", "response", "label"}
    rerank clients (Cohere, LiteLLM; TEI)       POST /v1/rerank, /v2/rerank, /rerank

A reward model has one output, so vLLM's "probs" holds one number: with activation (vLLM's default) the
sigmoid of the reward, without it the reward itself (what verl asks for, with use_activation false).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from anchor_rm.model.scoring import conversation_to_pair, rank, sigmoid, split_transcript
from service.schemas import RequestError, ServingLimits, check_count, check_text

# Clients send fields we do not use (vLLM's truncate_prompt_tokens, priority, ...): accepted and ignored,
# as vLLM does. Inputs never appear in validation messages (they reach the server log).
_LENIENT = ConfigDict(hide_input_in_errors=True, extra="ignore")


@dataclass(frozen=True)
class Pairs:
    """What a request asks to score: (prompt, response) pairs, and whether each prompt was found."""

    prompts: list[str]
    responses: list[str]
    prompt_found: list[bool]


# ---------------------------------------------------------------------------------------------------
# vLLM: /classify, /pooling, /v1/models.

class ClassifyRequest(BaseModel):
    """vLLM's classification request: `input` (text or texts, each a whole rendered exchange) or `messages`
    (a conversation ending in the assistant's reply)."""

    model_config = _LENIENT
    model: str | None = Field(None, description="Any name: the service serves one model (see GET /v1/models).")
    input: str | list[Any] | None = Field(None, description="A rendered exchange, or a list of them. An HH "
                                          "transcript is split after its last 'Assistant:'; other text is scored "
                                          "whole as the response to an empty prompt.")
    messages: list[dict[str, Any]] | None = Field(None, description="A conversation whose last message is the "
                                                  "assistant reply to judge (rendered as an HH transcript).")
    use_activation: bool | None = Field(None, description="true (default, as vLLM): probs = [sigmoid(reward)]; "
                                        "false: probs = [reward] (verl sends false).")
    activation: bool | None = Field(None, description="Older clients' name for use_activation (honoured when "
                                    "use_activation is absent).")


def classify_pairs(request: ClassifyRequest, limits: ServingLimits) -> Pairs:
    """The pairs a /classify or /pooling request asks to score."""
    if (request.input is None) == (request.messages is None):
        raise RequestError("input", "send exactly one of input (text or list of texts) and messages")
    if request.messages is not None:
        if len(request.messages) == 0:
            raise RequestError("messages", "is empty; send the conversation ending in the assistant's reply")
        try:
            prompt, response = conversation_to_pair(request.messages)
        except (ValueError, AttributeError) as exc:
            raise RequestError("messages", str(exc)) from None
        check_text("messages (rendered prompt)", prompt, limits, allow_empty=True)
        check_text("messages[-1].content", response, limits)
        return Pairs([prompt], [response], [True])
    texts = [request.input] if isinstance(request.input, str) else request.input
    check_count("input", texts, limits.max_items, "max_items")
    pairs = Pairs([], [], [])
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise RequestError(f"input[{i}]", "must be text; token ids are not accepted (send the decoded text)")
        check_text(f"input[{i}]", text, limits)
        prompt, response, found = split_transcript(text)
        pairs.prompts.append(prompt)
        pairs.responses.append(response)
        pairs.prompt_found.append(found)
    return pairs


def use_activation(request: ClassifyRequest, default: bool = True) -> bool:
    if request.use_activation is not None:
        return request.use_activation
    if request.activation is not None:
        return request.activation
    return default


def _usage(tokens: Sequence[int]) -> dict[str, Any]:
    total = int(sum(tokens))
    return {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0, "prompt_tokens_details": None}


def _flag(ood_score: Sequence[float | None] | None, in_domain: Sequence[bool | None] | None, i: int) -> dict:
    """The OOD flag's two fields for item i, added to each item of a protocol's answer (clients of these
    protocols read the fields they know and ignore the rest)."""
    if ood_score is None or in_domain is None:
        return {}
    return {"ood_score": ood_score[i], "in_domain": in_domain[i]}


def classify_response(model_id: str, rewards: Sequence[float], tokens: Sequence[int], activation: bool,
                      ood_score: Sequence[float | None] | None = None,
                      in_domain: Sequence[bool | None] | None = None) -> dict:
    """vLLM's ClassificationResponse: verl reads data[-1]["probs"][-1]; each item also carries the OOD flag."""
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model_id,
            "data": [{"index": i, "label": "reward", "probs": [sigmoid(r) if activation else float(r)], "num_classes": 1,
                      **_flag(ood_score, in_domain, i)} for i, r in enumerate(rewards)],
            "usage": _usage(tokens)}


def pooling_response(model_id: str, rewards: Sequence[float], tokens: Sequence[int], activation: bool,
                     ood_score: Sequence[float | None] | None = None,
                     in_domain: Sequence[bool | None] | None = None) -> dict:
    """vLLM's PoolingResponse: one pooled value per input, the reward (sigmoid of it with activation); each item
    also carries the OOD flag."""
    return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model_id,
            "data": [{"index": i, "object": "pooling", "data": [sigmoid(r) if activation else float(r)],
                      **_flag(ood_score, in_domain, i)} for i, r in enumerate(rewards)],
            "usage": _usage(tokens)}


def models_response(model_id: str, root: str, max_length: int, created: int) -> dict:
    """vLLM's (and OpenAI's) model list: the one model served."""
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "anchor-rm",
                                        "root": root, "parent": None, "max_model_len": max_length, "permission": []}]}


# ---------------------------------------------------------------------------------------------------
# slime / miles: one sample per request.

class SampleRequest(BaseModel):
    """slime's remote reward request (--rm-url): one sample."""

    model_config = _LENIENT
    prompt: str | list[dict[str, Any]] = Field(description="The prompt: text (chat-templated or raw), or the "
                                               "prompt's messages.")
    response: str = Field(description="The generated response alone.")
    label: Any = Field(None, description="Accepted and ignored (a reward model needs no label).")


def sample_pair(request: SampleRequest, limits: ServingLimits) -> tuple[str, str]:
    prompt = request.prompt
    if isinstance(prompt, list):
        try:
            prompt, _ = conversation_to_pair([*prompt, {"role": "assistant", "content": ""}])
        except (ValueError, AttributeError) as exc:
            raise RequestError("prompt", str(exc)) from None
    return check_text("prompt", prompt, limits, allow_empty=True), check_text("response", request.response, limits,
                                                                              allow_empty=True)


# ---------------------------------------------------------------------------------------------------
# Rerank: Cohere's shape (LiteLLM's rerank), and TEI's when `texts` is sent.

class RerankRequest(BaseModel):
    """Cohere-style rerank (`documents`, answered with `results`) or TEI's (`texts`, answered with a bare
    list): best-of-n for rerank clients. Scores are sigmoid(reward) unless raw_scores is true."""

    model_config = _LENIENT
    model: str | None = Field(None, description="Any name: the service serves one model.")
    query: str = Field(description="The prompt every document answers.")
    documents: list[Any] | None = Field(None, description="Candidate responses: strings or {\"text\": ...}.")
    texts: list[Any] | None = Field(None, description="TEI's name for the candidates (then the answer is a bare list).")
    top_n: int | None = Field(None, description="Return only the best n (default: all).")
    return_documents: bool | None = Field(None, description="Include each document's text (default: true).")
    return_text: bool | None = Field(None, description="TEI: include each text (default: false).")
    raw_scores: bool | None = Field(None, description="true: the reward itself rather than its sigmoid.")


@dataclass(frozen=True)
class Rerank:
    query: str
    documents: list[str]
    tei: bool  # texts were sent: answer in TEI's shape


def rerank_candidates(request: RerankRequest, limits: ServingLimits) -> Rerank:
    check_text("query", request.query, limits)
    if (request.documents is None) == (request.texts is None):
        raise RequestError("documents", "send exactly one of documents (Cohere) and texts (TEI)")
    field_name = "texts" if request.texts is not None else "documents"
    items = request.texts if request.texts is not None else request.documents
    check_count(field_name, items, limits.max_candidates, "max_candidates")
    documents = []
    for i, item in enumerate(items):
        text = item.get("text") if isinstance(item, dict) else item
        documents.append(check_text(f"{field_name}[{i}]" + (".text" if isinstance(item, dict) else ""), text, limits))
    if request.top_n is not None and request.top_n < 1:
        raise RequestError("top_n", f"must be at least 1, got {request.top_n}")
    return Rerank(request.query, documents, request.texts is not None)


def rerank_response(request: RerankRequest, rerank: Rerank, rewards: Sequence[float], model_id: str,
                    tokens: Sequence[int], ood_score: Sequence[float | None] | None = None,
                    in_domain: Sequence[bool | None] | None = None) -> dict | list:
    """Best first (ties: request order), at most top_n; each result carries the OOD flag."""
    order = rank(rewards)[: request.top_n or len(rewards)]
    score = (lambda r: float(r)) if request.raw_scores else sigmoid
    if rerank.tei:
        return [{"index": i, "score": score(rewards[i]), **({"text": rerank.documents[i]} if request.return_text else {}),
                 **_flag(ood_score, in_domain, i)} for i in order]
    with_text = request.return_documents is not False
    return {"id": uuid.uuid4().hex, "model": model_id,
            "results": [{"index": i, "relevance_score": score(rewards[i]),
                         **({"document": {"text": rerank.documents[i]}} if with_text else {}),
                         **_flag(ood_score, in_domain, i)} for i in order],
            "meta": {"billed_units": {"search_units": 1}},
            "usage": {"prompt_tokens": int(sum(tokens)), "total_tokens": int(sum(tokens))}}
