"""The model the service serves, without the HTTP framework: a reward model resolved from the MLflow registry
(an alias or a version), a run or a folder, with its registry details and report; and a holder that swaps in
a new version when the alias moves. Scoring goes through `RewardScorer.score` (anchor_rm/model/scoring.py), the
path evaluation uses: same tokenisation, same truncation, same reward.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from service.schemas import TRUNCATION_POLICY, ModelRef

logger = logging.getLogger("anchor_rm.service")


HEADLINE_TAGS = ("premise", "mean_nts", "wrg", "id_accuracy", "teacher_id_accuracy", "pgr", "method", "anchor_lambda",
                 "anchor_layers", "selection_splits", "figure_splits")


def configure_mlflow() -> str:
    """MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI as everywhere in MLflow; when unset, the pipelines' default
    store (SQLite mlflow.db in the working directory). Returns the tracking URI."""
    from anchor_rm.mlflow_edge import store

    return store.connect(None)


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


def _load_report(folder: Path, registered_name: str | None, version: str | None) -> tuple[dict | None, str | None]:
    """(report.json as a dict, None) or (None, why there is none). The report is validated on the way."""
    from anchor_rm.evaluation.report_files import read_report
    from anchor_rm.mlflow_edge import model_package, registry

    path = model_package.find_report(folder)
    try:
        if path is None and registered_name and version:
            path = registry.download_version_report(registered_name, version, folder.parent / "run-report")
        if path is None:
            return None, "this model carries no evaluation report"
        read_report(path)  # validates against the schema
        return json.loads(path.read_text()), None
    except Exception as exc:  # a missing or malformed report must not stop the model from serving
        return None, f"the model's report could not be read: {exc}"


@dataclass
class ServedModel:
    """A loaded reward model and what the registry knows of it; immutable once loaded."""

    scorer: Any  # anchor_rm.model.scoring.RewardScorer
    uri: str  # as configured, e.g. models:/anchor-rm-harmless@champion
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
    ood_flag_fitted: bool = False  # the version carries an OOD flag's density (used or not: scorer.density)

    @property
    def ref(self) -> ModelRef:
        return ModelRef(name=self.registered_name or self.resolved, version=self.version)

    def score(self, prompts: Sequence[str], responses: Sequence[str]):
        """The library's one scoring path: rewards and truncated flags, one per pair."""
        return self.scorer.score(list(prompts), list(responses))

    def token_counts(self, prompts: Sequence[str], responses: Sequence[str]) -> list[int]:
        """The tokens each pair is scored on, after truncation (the usage figures of the vLLM protocol)."""
        encoder = self.scorer.encoder
        return [len(encoder.encode(p, r).input_ids) for p, r in zip(prompts, responses)]

    def describe(self) -> dict[str, Any]:
        from anchor_rm.model.scoring import batch_invariance

        return {
            "name": self.registered_name or self.resolved, "version": self.version, "alias": self.alias,
            "uri": self.uri, "resolved_uri": self.resolved, "run_id": self.run_id,
            "headline_metrics": self.headline, "has_report": self.report is not None,
            "report_error": self.report_error, "base_model": self.base_model, "max_length": self.max_length,
            "precision": self.scorer.precision, "device": str(next(self.scorer.model.parameters()).device),
            "truncation_policy": TRUNCATION_POLICY, "loaded_at": self.loaded_at, "ood_flag": self.ood_flag_info(),
            "batch_invariance": batch_invariance(),
        }

    def ood_flag_info(self) -> dict[str, Any]:
        """Whether responses carry the OOD flag, and if so its fit and threshold (ood_flag.DensityFit.describe)."""
        if self.scorer.density is not None:
            return {"enabled": True, **self.scorer.density.describe()}
        reason = ("turned off (ANCHOR_RM_OOD_FLAG=0)" if self.ood_flag_fitted else
                  "this version carries no fitted density (registered before the flag existed)")
        return {"enabled": False, "reason": reason}


def place_for_scoring(model, precision: str = "auto", device: str = "auto") -> str:
    """Puts a loaded fp32 model on `device` (auto: the first CUDA GPU torch sees, else the CPU) for scoring at
    `precision` (auto | fp32 | bf16), resolved here for that device; returns the resolved precision ("fp32" or
    "bf16"), what the scorer runs.

    In bf16 the model is scored under bf16 autocast (RewardScorer), which casts every fp32 matmul weight on
    every forward pass; the served model never trains, so they are cast once, on the CPU before the move, and
    nothing else is (scoring.cast_matmul_weights_once): the rotary inv_freq buffer, the norms, the embeddings
    and the reward head stay fp32, as in evaluation, so served rewards are evaluation's (fp32 weights under
    autocast) bit for bit where the same kernels run. Casting before the move keeps the fp32 copy off the GPU:
    an 8B model takes about 16 GB there (bf16 matmul weights, fp32 embeddings), and loads on a 24 GB card.
    One path for the CPU and a GPU."""
    import torch

    from anchor_rm.model.precision import resolve_precision
    from anchor_rm.model.scoring import cast_matmul_weights_once

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = resolve_precision(precision, torch.device(device).type)
    if precision == "bf16":
        cast_matmul_weights_once(model, torch.bfloat16)
    try:
        model.to(device)
    except (RuntimeError, AssertionError) as exc:  # no such device, or a torch built without CUDA
        raise RuntimeError(f"ANCHOR_RM_DEVICE={device}: cannot place the model there ({exc})") from None
    return precision


def load_served_model(uri: str, download_dir: str | Path, batch_size: int = 32, precision: str = "auto",
                      device: str = "auto", max_tokens: int | None = None, ood_flag: bool = True) -> ServedModel:
    """Resolve `uri` (anchor_rm.evaluation.resolve_model_uri: registry, run or folder), load the reward model and
    its tokenizer (reward_model.load_saved) onto `device` (auto: the first CUDA GPU torch sees, else the CPU), read
    its report and headline figures. `precision` (auto | fp32 | bf16) is resolved here for that device, once
    per process, so that /model says what scores. `ood_flag`: score with the version's OOD flag, where it has
    one (anchor_rm/model/ood_flag.py)."""
    from anchor_rm.mlflow_edge import registry
    from anchor_rm.mlflow_edge.model_package import parse_registry_uri, resolve_model_uri
    from anchor_rm.model.reward_model import load_saved

    resolved = resolve_model_uri(uri, download_dir)
    reward_model = load_saved(resolved.folder)
    precision = place_for_scoring(reward_model.model, precision, device)
    parsed = parse_registry_uri(uri)
    tags: dict[str, str] = {}
    if resolved.registered_name and resolved.version:
        tags = registry.version_tags(resolved.registered_name, resolved.version)
    report, report_error = _load_report(resolved.folder, resolved.registered_name, resolved.version)
    return ServedModel(
        scorer=reward_model.scorer(batch_size, precision, max_tokens, ood_flag=ood_flag), uri=uri, resolved=resolved.name,
        registered_name=resolved.registered_name, version=resolved.version,
        alias=parsed[1] if parsed else None, run_id=resolved.run_id, headline=headline_metrics(tags),
        report=report, report_error=report_error, max_length=reward_model.encoder.max_length,
        base_model=reward_model.name, loaded_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        folder=Path(download_dir), ood_flag_fitted=reward_model.density is not None,
    )


def target_version(uri: str) -> str | None:
    """The version `uri` names in the registry now (an alias is looked up); None when the URI is fixed (a
    version number, a run, a folder) and so never moves."""
    from anchor_rm.mlflow_edge import registry

    return registry.current_version(uri)


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
        self.load_error: str | None = None  # why the first load failed (it is retried)
        self.loading_since: str | None = None
        self.retry_seconds = 10.0

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
        """The first load (nothing when a model is loaded already); errors propagate."""
        with self._reload_lock:
            if self._current is None:
                self._current = self._load_new()
                logger.info("serving %s (from %s)", self._current.resolved, self.uri)
            return self._current

    def load_in_background(self, retry_seconds: float = 10.0) -> threading.Thread:
        """The first load off the serving thread, so that the service answers while it runs (503 with
        `not_ready_reason`, never a refused connection); a failed load is retried every `retry_seconds`
        until it succeeds or the holder closes."""
        self.loading_since = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.retry_seconds = retry_seconds

        def run():
            while not self._stop.is_set():
                try:
                    self.load()
                    self.load_error = None
                    return
                except Exception as exc:
                    self.load_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
                    logger.error("cannot load %s (retrying in %.0f s): %s", self.uri, retry_seconds, self.load_error)
                if self._stop.wait(retry_seconds):
                    return

        thread = threading.Thread(target=run, name="anchor-rm-first-load", daemon=True)
        thread.start()
        return thread

    def not_ready_reason(self) -> str | None:
        """None once a model serves; else what the service is waiting for."""
        if self._current is not None:
            return None
        if self.load_error:
            return (f"loading {self.uri} failed: {self.load_error}; retrying every {self.retry_seconds:g} s "
                    f"(since {self.loading_since})")
        return f"loading {self.uri} (since {self.loading_since})"

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
