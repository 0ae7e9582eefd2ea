"""What the reward-scoring HTTP service does, without the HTTP framework: request shapes and their limits,
best-of-n ranking, pairwise comparison, OpenRLHF's query/prompt split, the served model with its registry
details and report, a holder that swaps in a new version when an alias moves, and an ASGI guard (API key,
body size, readable validation errors). service/service.py wraps these in BentoML; nothing here imports it.

Scoring goes through `RewardScorer.score` (anchor_rm/scoring.py), the path evaluation uses: same
tokenisation, same truncation (prompt tokens dropped from the left first, the response kept), same reward.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger("anchor_rm.serving")

DEFAULT_MODEL_URI = "models:/anchor-rm-helpful@champion"
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
    items: list[ScoreItem] = Field(description="Prompt-response pairs, at most ANCHOR_RM_MAX_ITEMS (256).")


class BestOfNRequest(BaseModel):
    model_config = _STRICT
    prompt: str = Field(description="The prompt every candidate answers.")
    candidates: list[str] = Field(description="Candidate responses, 1 to ANCHOR_RM_MAX_CANDIDATES (64).")


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


class ScoreResponse(BaseModel):
    rewards: list[float] = Field(description="One reward per item, in request order.")
    truncated: list[bool] = Field(description="Whether the pair was cut to the model's max length.")
    model: ModelRef


class BestOfNResponse(BaseModel):
    rewards: list[float] = Field(description="One reward per candidate, in request order.")
    ranking: list[int] = Field(description="Candidate indices, best first (ties: lower index first).")
    best_index: int
    truncated: list[bool]
    model: ModelRef


class CompareResponse(BaseModel):
    p_a_preferred: float = Field(description="sigmoid(reward_a - reward_b) (Bradley-Terry).")
    reward_a: float
    reward_b: float
    truncated_a: bool
    truncated_b: bool
    model: ModelRef


class GetRewardResponse(BaseModel):
    rewards: list[float] = Field(description="One reward per query (OpenRLHF reads this).")
    scores: list[float] = Field(description="The same rewards (OpenRLHF's dynamic filtering reads this).")
    extra_logs: dict[str, list[float]] = Field(description="Per-query numbers OpenRLHF logs: truncated (1/0) "
                                                           "and prompt_found (1/0).")
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
    truncation_policy: str
    loaded_at: str
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


def _check_count(field_name: str, values: Any, limit: int, setting: str) -> None:
    if not isinstance(values, (list, tuple)):
        raise RequestError(field_name, f"must be a list, got {type(values).__name__}")
    if not values:
        raise RequestError(field_name, "is empty; send at least one")
    if len(values) > limit:
        raise RequestError(field_name, f"{len(values)} entries, over the limit of {limit} ({setting}, "
                                       f"{LIMIT_SETTINGS[setting]})")


def check_pairs(prompts: Sequence[str], responses: Sequence[str], limits: ServingLimits) -> None:
    """/score: 1 to max_items pairs, no empty or oversized text."""
    _check_count("items", list(prompts), limits.max_items, "max_items")
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        check_text(f"items[{i}].prompt", prompt, limits)
        check_text(f"items[{i}].response", response, limits)


def check_best_of_n(prompt: str, candidates: Sequence[str], limits: ServingLimits) -> None:
    check_text("prompt", prompt, limits)
    _check_count("candidates", candidates, limits.max_candidates, "max_candidates")
    for i, candidate in enumerate(candidates):
        check_text(f"candidates[{i}]", candidate, limits)


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
    response to an empty prompt, and prompt_found says so.
    """
    _check_count("query", queries, limits.max_items, "max_items")
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


# ---------------------------------------------------------------------------------------------------
# Best-of-n and pairwise preference.

def rank(rewards: Sequence[float]) -> list[int]:
    """Indices, best reward first; equal rewards keep request order."""
    return sorted(range(len(rewards)), key=lambda i: (-float(rewards[i]), i))


def preference_probability(reward_a: float, reward_b: float) -> float:
    """P(a preferred over b) = sigmoid(r_a - r_b), without overflow for large differences."""
    d = float(reward_a) - float(reward_b)
    if d >= 0:
        return 1.0 / (1.0 + math.exp(-d))
    e = math.exp(d)
    return e / (1.0 + e)


# ---------------------------------------------------------------------------------------------------
# The served model: a reward model resolved from the registry (or a run, or a folder), with what the
# registry says about it.

_REGISTERED = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>[^/@]+))/?$")
HEADLINE_TAGS = ("mean_nts", "wrg", "id_accuracy", "teacher_id_accuracy", "pgr", "method", "anchor_lambda",
                 "anchor_layers", "selection_splits", "figure_splits")


def configure_mlflow() -> str:
    """MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI as everywhere in MLflow; when unset, the pipelines' default
    store (SQLite mlflow.db in the working directory). Returns the tracking URI."""
    import mlflow

    from anchor_rm.tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(None)
    mlflow.set_tracking_uri(uri)
    if uri.startswith("sqlite:") and not os.environ.get("MLFLOW_REGISTRY_URI"):
        mlflow.set_registry_uri(uri)
    return uri


def _number_or_text(value: str) -> float | str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return value
    return number if math.isfinite(number) else value


def headline_metrics(tags: dict[str, str]) -> dict[str, float | str]:
    """The figures registry.headline_tags put on the version, numbers as numbers."""
    keys = [k for k in HEADLINE_TAGS if k in tags] + sorted(k for k in tags if k.startswith("aog."))
    return {k: _number_or_text(tags[k]) for k in keys}


def _find_report(folder: Path) -> Path | None:
    """report/report.json inside the pyfunc model that holds `folder` (registry.log_and_register's layout),
    or beside a plain model folder."""
    for candidate in (folder, *list(folder.parents)[:3]):
        if (candidate / "MLmodel").is_file():
            from mlflow.models import Model

            artifacts = Model.load(str(candidate)).flavors.get("python_function", {}).get("artifacts") or {}
            if "report" in artifacts:
                path = candidate / artifacts["report"]["path"] / "report.json"
                return path if path.is_file() else None
            return None
    path = folder / "report" / "report.json"
    return path if path.is_file() else None


def _load_report(folder: Path, registered_name: str | None, version: str | None) -> tuple[dict | None, str | None]:
    """(report.json as a dict, None) or (None, why there is none). The report is validated on the way."""
    from anchor_rm.report import read_report

    path = _find_report(folder)
    try:
        if path is None and registered_name and version:
            from anchor_rm.registry import REPORT_JSON

            import mlflow
            from mlflow.tracking import MlflowClient

            run_id = MlflowClient().get_model_version(registered_name, version).run_id
            if run_id:
                path = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=REPORT_JSON,
                                                                dst_path=str(folder.parent / "run-report")))
        if path is None:
            return None, "this model carries no evaluation report"
        read_report(path)  # validates against the schema
        return json.loads(path.read_text()), None
    except Exception as exc:  # a missing or malformed report must not stop the model from serving
        return None, f"the model's report could not be read: {exc}"


@dataclass
class ServedModel:
    """A loaded reward model and what the registry knows of it; immutable once loaded."""

    scorer: Any  # anchor_rm.scoring.RewardScorer
    uri: str  # as configured, e.g. models:/anchor-rm-helpful@champion
    resolved: str  # models:/NAME/VERSION, runs:/..., or the folder
    registered_name: str | None
    version: str | None
    alias: str | None
    run_id: str | None
    headline: dict[str, float | str]
    report: dict | None
    report_error: str | None
    max_length: int
    base_model: str
    loaded_at: str
    folder: Path | None = None  # where the files were downloaded; removed when the model is retired

    @property
    def ref(self) -> ModelRef:
        return ModelRef(name=self.registered_name or self.resolved, version=self.version)

    def score(self, prompts: Sequence[str], responses: Sequence[str]):
        """The library's one scoring path: rewards and truncated flags, one per pair."""
        return self.scorer.score(list(prompts), list(responses))

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.registered_name or self.resolved, "version": self.version, "alias": self.alias,
            "uri": self.uri, "resolved_uri": self.resolved, "run_id": self.run_id,
            "headline_metrics": self.headline, "has_report": self.report is not None,
            "report_error": self.report_error, "base_model": self.base_model, "max_length": self.max_length,
            "precision": self.scorer.precision, "truncation_policy": TRUNCATION_POLICY, "loaded_at": self.loaded_at,
        }


def parse_registry_uri(uri: str) -> tuple[str, str | None, str | None] | None:
    """models:/NAME@ALIAS or models:/NAME/VERSION -> (name, alias, version); None for other URIs."""
    match = _REGISTERED.match(uri)
    if match is None:
        return None
    return match["name"], match["alias"], match["version"]


def load_served_model(uri: str, download_dir: str | Path, batch_size: int = 32, precision: str = "auto") -> ServedModel:
    """Resolve `uri` (anchor_rm.evaluation.resolve_model_uri: registry, run or folder), load the reward model and
    its tokenizer (workflow.load_saved), read its report and headline figures. `precision` (auto | fp32 |
    bf16) is resolved here, once per process, so that /model says what scores."""
    from anchor_rm.evaluation import resolve_model_uri
    from anchor_rm.precision import resolve_precision
    from anchor_rm.workflow import load_saved

    resolved = resolve_model_uri(uri, download_dir)
    reward_model = load_saved(resolved.folder)
    parsed = parse_registry_uri(uri)
    tags: dict[str, str] = {}
    if resolved.registered_name and resolved.version:
        from mlflow.tracking import MlflowClient

        tags = dict(MlflowClient().get_model_version(resolved.registered_name, resolved.version).tags or {})
    report, report_error = _load_report(resolved.folder, resolved.registered_name, resolved.version)
    return ServedModel(
        scorer=reward_model.scorer(batch_size, resolve_precision(precision)), uri=uri, resolved=resolved.name,
        registered_name=resolved.registered_name, version=resolved.version,
        alias=parsed[1] if parsed else None, run_id=resolved.run_id, headline=headline_metrics(tags),
        report=report, report_error=report_error, max_length=reward_model.encoder.max_length,
        base_model=reward_model.name, loaded_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        folder=Path(download_dir),
    )


def target_version(uri: str) -> str | None:
    """The version `uri` names in the registry now (an alias is looked up); None when the URI is fixed (a
    version number, a run, a folder) and so never moves."""
    parsed = parse_registry_uri(uri)
    if parsed is None:
        return None
    name, alias, version = parsed
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    if alias is not None:
        return str(client.get_model_version_by_alias(name, alias).version)
    if version == "latest":
        return str(max(int(v.version) for v in client.search_model_versions(f"name='{name}'")))
    return None


@dataclass
class ReloadResult:
    changed: bool
    previous: str | None
    current: str | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"changed": self.changed, "previous_version": self.previous, "current_version": self.current,
                "error": self.error}


def in_fresh_thread(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a new thread that ends with it; its result or its exception.

    Loading a model runs torch operations, and torch's OpenMP worker pool belongs to the thread that runs
    them. A long-lived thread that loads a model (the event loop's, the poller's, a framework's thread pool)
    keeps its pool, and on a small machine that pool slows every later forward pass in the scoring thread
    about 2x (2 cores: 4.6 -> 10.6 ms for a short pair). A thread that has ended leaves nothing behind.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="anchor-rm-load")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class ModelHolder:
    """Holds the model being served. A reload loads the new version fully, then swaps one reference: a
    request that already took `current` finishes on the old model object, new requests get the new one.
    A version that fails to load is reported and the old one keeps serving."""

    def __init__(self, uri: str, download_root: str | Path, *,
                 loader: Callable[[str, Path], ServedModel] = load_served_model,
                 target: Callable[[str], str | None] = target_version):
        self.uri = uri
        self.download_root = Path(download_root)
        self._loader = loader
        self._target = target
        self._current: ServedModel | None = None
        self._reload_lock = threading.Lock()  # one load at a time; readers never take it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None
        self.last_check: str | None = None

    @property
    def loaded(self) -> bool:
        return self._current is not None

    @property
    def current(self) -> ServedModel:
        model = self._current
        if model is None:
            raise RuntimeError("no model loaded yet")
        return model

    def _load_new(self) -> ServedModel:
        folder = self.download_root / f"load-{uuid.uuid4().hex[:12]}"
        try:
            return in_fresh_thread(self._loader, self.uri, folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def load(self) -> ServedModel:
        """The first load; errors propagate (a service that cannot load its model should not start)."""
        with self._reload_lock:
            self._current = self._load_new()
            logger.info("serving %s (from %s)", self._current.resolved, self.uri)
            return self._current

    def refresh(self) -> ReloadResult:
        """Load the version the URI names now, if it differs from the one being served."""
        with self._reload_lock:
            old = self._current
            previous = old.version if old else None
            self.last_check = datetime.now(timezone.utc).isoformat(timespec="seconds")
            try:
                wanted = self._target(self.uri)
            except Exception as exc:
                self.last_error = f"cannot look up {self.uri}: {exc}"
                logger.warning("reload check failed: %s", self.last_error)
                return ReloadResult(False, previous, previous, self.last_error)
            if wanted is None or (old is not None and wanted == old.version):
                return ReloadResult(False, previous, previous)
            try:
                new = self._load_new()
            except Exception as exc:
                self.last_error = f"cannot load version {wanted} of {self.uri}: {exc}"
                logger.warning("reload failed, still serving version %s: %s", previous, self.last_error)
                return ReloadResult(False, previous, previous, self.last_error)
            self._current = new  # the swap: one reference assignment
            self.last_error = None
            logger.info("reloaded %s: version %s -> %s", self.uri, previous, new.version)
            if old is not None and old.folder is not None:
                # Weights and tokenizer are in memory; requests still on the old object do not need its files.
                shutil.rmtree(old.folder, ignore_errors=True)
            return ReloadResult(True, previous, new.version)

    def start_polling(self, interval_seconds: float) -> None:
        if interval_seconds <= 0 or self._thread is not None:
            return

        def poll():
            while not self._stop.wait(interval_seconds):
                try:
                    self.refresh()
                except Exception:  # keep polling whatever happens
                    logger.exception("model reload check failed")

        self._thread = threading.Thread(target=poll, name="anchor-rm-model-poll", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._current is not None and self._current.folder is not None:
            shutil.rmtree(self._current.folder, ignore_errors=True)


def default_download_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="anchor-rm-serve-"))


# ---------------------------------------------------------------------------------------------------
# The ASGI guard in front of the service.

HEALTH_PATHS = ("/livez", "/healthz", "/readyz")


def _format_loc(loc: Sequence[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "body"


def validation_message(detail: Sequence[dict]) -> str:
    """pydantic error entries -> 'items[0].prompt: Field required; ...' (field first, as in RequestError)."""
    return "; ".join(f"{_format_loc(d.get('loc') or ())}: {d.get('msg', 'invalid')}" for d in detail)


class ApiGuard:
    """Plain ASGI middleware.

    - With an API key configured, every path but the health checks needs `Authorization: Bearer <key>` or
      `X-API-Key: <key>` (compared in constant time); 401 otherwise.
    - Request bodies over max_body_bytes: 413, before the application reads them.
    - A 400 in the framework's pydantic shape gets an "error" naming each failing field.
    Nothing here logs headers or bodies.
    """

    def __init__(self, app, *, api_key: str | None = None, open_paths: Sequence[str] = HEALTH_PATHS,
                 max_body_bytes: int = 64 * 1024 * 1024):
        self.app = app
        self._key = api_key.encode() if api_key else None
        self.open_paths = frozenset(open_paths)
        self.max_body_bytes = max_body_bytes

    def _matches(self, given: bytes | None, expected: bytes | None) -> bool:
        return bool(given) and expected is not None and hmac.compare_digest(given, expected)

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        bearer = token.strip() if scheme.lower() == b"bearer" else None
        return self._matches(bearer, self._key) or self._matches(headers.get(b"x-api-key"), self._key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self._key is not None and path not in self.open_paths and not self._authorised(headers):
            return await _send_json(send, 401, {"error": "missing or invalid API key: send 'Authorization: Bearer "
                                                         "<key>' or 'X-API-Key: <key>'"},
                                    [(b"www-authenticate", b"Bearer")])
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            body = await self._read_body(receive, headers)
            if body is None:
                return await _send_json(send, 413, {"error": f"request body over the limit of {self.max_body_bytes} "
                                                             f"bytes (max_body_bytes, "
                                                             f"{LIMIT_SETTINGS['max_body_bytes']})"})
            receive = _replay(body, receive)
        await self.app(scope, receive, _readable_400(send))

    async def _read_body(self, receive, headers) -> bytes | None:
        try:
            if int(headers.get(b"content-length", b"0") or 0) > self.max_body_bytes:
                return None
        except ValueError:
            pass
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_json(send, status: int, payload: dict, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra_headers]})
    await send({"type": "http.response.body", "body": body})


def _readable_400(send):
    """Rewrite the framework's pydantic 400 ({"error": "1 validation error for X", "detail": [...]}) so that
    "error" names the fields; every other response passes through untouched."""
    held: dict | None = None
    chunks: list[bytes] = []

    async def wrapped(message):
        nonlocal held
        if message["type"] == "http.response.start" and message.get("status") == 400:
            held = message
            return
        if held is None:
            return await send(message)
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(chunks)
        try:
            payload = json.loads(body)
            if isinstance(payload, dict) and isinstance(payload.get("detail"), list) and payload["detail"]:
                payload["error"] = validation_message(payload["detail"])
                body = json.dumps(payload).encode()
        except (ValueError, TypeError, AttributeError):
            pass
        headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**held, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return wrapped
