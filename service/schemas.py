"""What the service accepts and answers, without the HTTP framework: request and response shapes (pydantic,
so that the OpenAPI page documents them), their limits, and the checks that name the field and the limit a
request breaks. OpenRLHF's query/prompt split lives here too. service/service.py wires these into BentoML.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MODEL_URI = "models:/anchor-rm-harmless@champion"
TRUNCATION_POLICY = ("a pair over the model's max length loses prompt tokens from the left (oldest turns) "
                     "first; only a response that alone exceeds the budget is cut, at its end")
# The settings behind each limit, named in error messages so that an operator knows what to raise.
LIMIT_SETTINGS = {"max_items": "ANCHOR_RM_MAX_ITEMS", "max_candidates": "ANCHOR_RM_MAX_CANDIDATES",
                  "max_text_bytes": "ANCHOR_RM_MAX_TEXT_BYTES", "max_body_bytes": "ANCHOR_RM_MAX_BODY_BYTES"}


# ---------------------------------------------------------------------------------------------------
# Requests: shapes (pydantic, so the OpenAPI page documents them) and limits (checked here).

class RequestError(ValueError):
    """A request the service refuses (HTTP 400); the message names the field and, where one applies, the
    limit."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")

    def to_dict(self) -> dict[str, str]:
        return {"error": str(self), "field": self.field}


@dataclass(frozen=True)
class ServingLimits:
    max_items: int = 256  # pairs per /score request, queries per /get_reward request
    max_candidates: int = 64  # candidates per /best_of_n request
    max_text_bytes: int = 32768  # UTF-8 bytes per prompt, response, candidate or query

    def __post_init__(self):
        for name in ("max_items", "max_candidates", "max_text_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


# Inputs never appear in validation messages: those messages reach the server log.
_STRICT = ConfigDict(hide_input_in_errors=True, extra="forbid")


class ScoreItem(BaseModel):
    model_config = _STRICT
    prompt: str = Field(description="The prompt (for HH data, the whole transcript up to the response).")
    response: str = Field(description="The response to judge.")


class ScoreRequest(BaseModel):
    model_config = _STRICT
    items: list[ScoreItem] = Field(description="Prompt-response pairs, at most ANCHOR_RM_MAX_ITEMS.")


class BestOfNRequest(BaseModel):
    model_config = _STRICT
    prompt: str = Field(description="The prompt every candidate answers.")
    candidates: list[str] = Field(description="Candidate responses, 1 to ANCHOR_RM_MAX_CANDIDATES.")


class CompareRequest(BaseModel):
    model_config = _STRICT
    prompt: str
    response_a: str
    response_b: str


class GetRewardRequest(BaseModel):
    """OpenRLHF's remote reward-model request (openrlhf/utils/remote_rm_utils.py)."""

    model_config = ConfigDict(hide_input_in_errors=True, extra="ignore")  # newer clients may send more
    query: list[str] = Field(description="Each prompt followed by its generated response, as the trainer "
                                         "formatted them.")
    prompts: list[str] | None = Field(None, description="The prompt of each query; where a query starts with "
                                                        "its prompt, the rest of the query is the response.")
    labels: list[Any] | None = Field(None, description="Accepted and ignored (a reward model needs no label).")


class ModelRef(BaseModel):
    """The model version that produced a response."""

    name: str = Field(description="Registered model name (or the folder or run URI the service loaded).")
    version: str | None = Field(description="Registered version; null for a folder or run URI.")


OOD_SCORE_DOC = ("How unlike the model's training data (student-train) the pair's representation is: squared "
                 "Mahalanobis distance per dimension, about 1 in domain (anchor_rm/model/ood_flag.py). null when the "
                 "version has no fitted flag or ANCHOR_RM_OOD_FLAG=0.")
IN_DOMAIN_DOC = ("ood_score at most the version's threshold (GET /model: ood_flag.threshold, the 95th percentile "
                 "on ID validation). false says the pair is unlike the training data, not that its reward is "
                 "wrong; null as for ood_score.")


class ScoreResponse(BaseModel):
    rewards: list[float] = Field(description="One reward per item, in request order.")
    truncated: list[bool] = Field(description="Whether the pair was cut to the model's max length.")
    ood_score: list[float | None] = Field(description="Per item: " + OOD_SCORE_DOC)
    in_domain: list[bool | None] = Field(description="Per item: " + IN_DOMAIN_DOC)
    model: ModelRef


class BestOfNResponse(BaseModel):
    rewards: list[float] = Field(description="One reward per candidate, in request order.")
    ranking: list[int] = Field(description="Candidate indices, best first (ties: lower index first).")
    best_index: int
    truncated: list[bool]
    ood_score: list[float | None] = Field(description="Per candidate: " + OOD_SCORE_DOC)
    in_domain: list[bool | None] = Field(description="Per candidate: " + IN_DOMAIN_DOC)
    model: ModelRef


class CompareResponse(BaseModel):
    p_a_preferred: float = Field(description="sigmoid(reward_a - reward_b) (Bradley-Terry).")
    reward_a: float
    reward_b: float
    truncated_a: bool
    truncated_b: bool
    ood_score_a: float | None = Field(description=OOD_SCORE_DOC)
    ood_score_b: float | None
    in_domain_a: bool | None = Field(description=IN_DOMAIN_DOC)
    in_domain_b: bool | None
    model: ModelRef


class GetRewardResponse(BaseModel):
    rewards: list[float] = Field(description="One reward per query (OpenRLHF reads this).")
    scores: list[float] = Field(description="The same rewards (OpenRLHF's dynamic filtering reads this).")
    extra_logs: dict[str, list[float]] = Field(description="Per-query numbers OpenRLHF logs: truncated (1/0), "
                                                           "prompt_found (1/0) and, with the OOD flag on, "
                                                           "ood_score and in_domain (1/0).")
    ood_score: list[float | None] = Field(description="Per query: " + OOD_SCORE_DOC)
    in_domain: list[bool | None] = Field(description="Per query: " + IN_DOMAIN_DOC)
    model: ModelRef


class ModelInfo(BaseModel):
    name: str = Field(description="Registered model name (or the folder or run URI).")
    version: str | None = Field(description="Registered version being served.")
    alias: str | None = Field(description="The alias the service follows (champion by default), if any.")
    uri: str = Field(description="The configured model URI (ANCHOR_RM_MODEL_URI).")
    resolved_uri: str = Field(description="What it resolved to: models:/NAME/VERSION, runs:/... or a folder.")
    run_id: str | None = Field(description="The MLflow run that logged the model.")
    headline_metrics: dict[str, float | str] = Field(description="The version's tags: mean_nts, wrg, "
                                                                  "id_accuracy, aog.<target>, ...")
    has_report: bool
    report_error: str | None
    base_model: str
    max_length: int = Field(description="Tokens per (prompt, response); longer pairs are truncated.")
    precision: str = Field(description="Forward-pass precision of scoring: fp32, or bf16 autocast with the reward "
                                       "head in fp32 (ANCHOR_RM_PRECISION, default auto: bf16 only on hardware with "
                                       "native bf16).")
    device: str = Field(description="Where the model scores: cpu or cuda:N (ANCHOR_RM_DEVICE, default auto: the "
                                    "first CUDA GPU when there is one).")
    truncation_policy: str
    loaded_at: str
    batch_invariance: dict[str, Any] = Field(description="width_bucket (tokens), bound (the largest difference between "
                                                         "a reward scored alone and in any batch, in either precision) "
                                                         "and how: each sequence padded to its own width bucket.")
    ood_flag: dict[str, Any] = Field(description="enabled (whether responses carry ood_score and in_domain); when "
                                                 "on, the fit: representation, fit_split, n_fit, dimensions, "
                                                 "components, shrinkage, threshold, threshold_quantile, "
                                                 "threshold_split, n_threshold; when off, the reason.")
    poll_seconds: float = Field(description="How often the alias is checked; 0: never.")
    last_reload_check: str | None
    last_reload_error: str | None


class ReloadResponse(BaseModel):
    changed: bool
    previous_version: str | None
    current_version: str | None
    error: str | None = Field(description="Why the version named now could not be loaded (the old one serves on).")


def check_text(field_name: str, value: Any, limits: ServingLimits, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise RequestError(field_name, f"must be a string, got {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise RequestError(field_name, "is not valid Unicode text (it holds a lone surrogate)") from None
    if size > limits.max_text_bytes:
        raise RequestError(field_name, f"{size} bytes, over the limit of {limits.max_text_bytes} bytes "
                                       f"(max_text_bytes, {LIMIT_SETTINGS['max_text_bytes']})")
    if not allow_empty and not value.strip():
        raise RequestError(field_name, "is empty")
    return value


def check_count(field_name: str, values: Any, limit: int, setting: str) -> None:
    if not isinstance(values, (list, tuple)):
        raise RequestError(field_name, f"must be a list, got {type(values).__name__}")
    if not values:
        raise RequestError(field_name, "is empty; send at least one")
    if len(values) > limit:
        raise RequestError(field_name, f"{len(values)} entries, over the limit of {limit} ({setting}, "
                                       f"{LIMIT_SETTINGS[setting]})")


def check_pairs(prompts: Sequence[str], responses: Sequence[str], limits: ServingLimits) -> None:
    """/score: 1 to max_items pairs, no empty prompt, no oversized text. An empty response is scored (a policy
    may stop at once: an RL trainer's reward function must not fail on it), as /get_reward and /reward do."""
    check_count("items", list(prompts), limits.max_items, "max_items")
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        check_text(f"items[{i}].prompt", prompt, limits)
        check_text(f"items[{i}].response", response, limits, allow_empty=True)


def check_best_of_n(prompt: str, candidates: Sequence[str], limits: ServingLimits) -> None:
    check_text("prompt", prompt, limits)
    check_count("candidates", candidates, limits.max_candidates, "max_candidates")
    for i, candidate in enumerate(candidates):
        check_text(f"candidates[{i}]", candidate, limits, allow_empty=True)  # an empty sample is a sample


def check_compare(prompt: str, response_a: str, response_b: str, limits: ServingLimits) -> None:
    check_text("prompt", prompt, limits)
    check_text("response_a", response_a, limits)
    check_text("response_b", response_b, limits)


@dataclass(frozen=True)
class SplitQueries:
    prompts: list[str]
    responses: list[str]
    prompt_found: list[bool]


def split_queries(queries: Sequence[str], prompts: Sequence[str] | None, limits: ServingLimits,
                  labels: Sequence[Any] | None = None) -> SplitQueries:
    """OpenRLHF's {"query", "prompts"} -> (prompt, response) pairs.

    Where a query starts with its prompt, the rest is the response (possibly empty: a policy may stop at
    once). Where there is no prompt, or the query does not start with it, the whole query is scored as the
    response to an empty prompt, and prompt_found says so. No queries is a valid request with no answer
    rows: OpenRLHF, given several reward servers, sends every server after the first empty lists.
    """
    if isinstance(queries, (list, tuple)) and not queries and not prompts:
        return SplitQueries([], [], [])
    check_count("query", queries, limits.max_items, "max_items")
    for i, query in enumerate(queries):
        check_text(f"query[{i}]", query, limits)
    if prompts is not None:
        if not isinstance(prompts, (list, tuple)):
            raise RequestError("prompts", f"must be a list, got {type(prompts).__name__}")
        if len(prompts) != len(queries):
            raise RequestError("prompts", f"{len(prompts)} entries, but query has {len(queries)}; send one "
                                          "prompt per query, or none")
        for i, prompt in enumerate(prompts):
            check_text(f"prompts[{i}]", prompt, limits, allow_empty=True)
    if labels is not None and not isinstance(labels, (list, tuple)):
        raise RequestError("labels", f"must be a list, got {type(labels).__name__}")
    out_prompts, responses, found = [], [], []
    for i, query in enumerate(queries):
        prompt = prompts[i] if prompts is not None else ""
        if prompt and query.startswith(prompt):
            out_prompts.append(prompt)
            responses.append(query[len(prompt):])
            found.append(True)
        else:
            out_prompts.append("")
            responses.append(query)
            found.append(False)
    return SplitQueries(out_prompts, responses, found)
