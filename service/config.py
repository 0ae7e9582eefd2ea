"""The service's settings: defaults, overridden by a TOML or JSON file named by ANCHOR_RM_CONFIG, overridden
by ANCHOR_RM_* environment variables. The tracking and registry stores come from MLflow's own
MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI (unset: SQLite mlflow.db in the working directory).

    variable                        default                              what
    ANCHOR_RM_MODEL_URI             models:/anchor-rm-harmless@champion   registry URI (alias or version), runs:/ URI or folder
    ANCHOR_RM_POLL_SECONDS          60                                   how often to check whether the alias moved; 0: never
    ANCHOR_RM_API_KEY               (unset)                              when set, every endpoint but /livez /healthz /readyz needs it
    ANCHOR_RM_HOST, ANCHOR_RM_PORT  127.0.0.1, 3000                      where `bentoml serve` binds unless --host/--port say otherwise
    ANCHOR_RM_MAX_ITEMS             256                                  pairs per /score, queries per /get_reward
    ANCHOR_RM_MAX_CANDIDATES        64                                   candidates per /best_of_n
    ANCHOR_RM_MAX_TEXT_BYTES        32768                                UTF-8 bytes per prompt, response, candidate or query
    ANCHOR_RM_MAX_BODY_BYTES        67108864                             bytes per request body
    ANCHOR_RM_BATCHING              1                                    score requests that queue together in one batch;
                                                                         0: one request per forward pass
    ANCHOR_RM_MAX_BATCH_SIZE        32                                   pairs per batch (at least 2; a larger request goes alone)
    ANCHOR_RM_FORWARD_BATCH_SIZE    8                                    sequences per forward pass: a batch is sorted by
                                                                         length and cut into passes of this size
    ANCHOR_RM_FORWARD_MAX_TOKENS    16384                                also at most this many tokens per pass, padded
                                                                         (0: none): a large model's activation bound
    ANCHOR_RM_MAX_LATENCY_MS        60000                                longest a request may queue for the model before a 503
    ANCHOR_RM_TIMEOUT_SECONDS       300                                  per-request timeout
    ANCHOR_RM_DOWNLOAD_DIR          (a new temporary folder)             where model versions are downloaded
    ANCHOR_RM_PRECISION             auto                                 scoring precision: auto (bf16 autocast only on
                                                                         hardware with native bf16), fp32 or bf16
    ANCHOR_RM_DEVICE                auto                                 where the model scores: auto (the first CUDA GPU
                                                                         when torch sees one, else the CPU), cpu, cuda, cuda:N
    ANCHOR_RM_GPUS                  auto                                 GPUs the service declares to BentoML (resources gpu),
                                                                         which gives the worker its own: CUDA_VISIBLE_DEVICES
                                                                         names them, so cuda (cuda:0) is the worker's GPU;
                                                                         auto: 1 where the device is auto, cuda or cuda:0 and
                                                                         torch sees a GPU, else none; 0: none (the GPUs the
                                                                         process sees, as CUDA_VISIBLE_DEVICES set them)
    ANCHOR_RM_OOD_FLAG              1                                    each scored pair's ood_score and in_domain, from the
                                                                         version's fitted density (anchor_rm/model/ood_flag.py);
                                                                         0: rewards alone (the fields are null)

The file uses the same names in lower case without the prefix (model_uri = "...", poll_seconds = 30). The
API key is read from the environment only: keep secrets out of files that get committed.

Start the service with `serve_command()`'s flags (README, "Serving"): BentoML starts uvicorn with a 5 s
keep-alive, the same as the idle expiry of httpx's connection pool, and a pooled client that reuses a
connection just as the server closes it gets `Connection reset by peer` (docs/reliability.md). The service
keeps idle connections KEEP_ALIVE_SECONDS instead, longer than common clients' pools keep them.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Mapping

from service.schemas import DEFAULT_MODEL_URI, ServingLimits

PREFIX = "ANCHOR_RM_"
CONFIG_VARIABLE = "ANCHOR_RM_CONFIG"
KEEP_ALIVE_SECONDS = 75  # above httpx's 5 s and aiohttp's 15 s pool expiry; the common nginx/gunicorn value


def serve_command(port: int | None = None, host: str | None = None) -> list[str]:
    """`bentoml serve` for this service, from the repository root; without host/port the settings decide."""
    command = [str(Path(sys.executable).parent / "bentoml"), "serve", "service.service:RewardService",
               "--timeout-keep-alive", str(KEEP_ALIVE_SECONDS)]
    if host is not None:
        command += ["--host", host]
    if port is not None:
        command += ["--port", str(port)]
    return command


class SettingsError(ValueError):
    """A setting that cannot be used; the message names the variable (or file key) and what it expects."""


@dataclass(frozen=True)
class Settings:
    model_uri: str = DEFAULT_MODEL_URI
    poll_seconds: float = 60.0
    api_key: str | None = field(default=None, repr=False)
    host: str = "127.0.0.1"
    port: int = 3000
    # The request limits' defaults live in one place, schemas.ServingLimits.
    max_items: int = ServingLimits.max_items
    max_candidates: int = ServingLimits.max_candidates
    max_text_bytes: int = ServingLimits.max_text_bytes
    max_body_bytes: int = 64 * 1024 * 1024
    batching: bool = True
    max_batch_size: int = 32
    # Requests of one batch have mixed lengths; short length-sorted passes pad less. MiniLM-L6, 32 mixed HH
    # pairs per batch, bf16 on 2 cores: 8 per pass scored about 1.4x the pairs/s of 32 per pass
    # (bench/service_scoring.py, docs/benchmarks.md).
    forward_batch_size: int = 8
    # Tokens per forward pass, padded (0: no budget, forward_batch_size alone): a 7-8B model's activations grow
    # with tokens, not pairs. 16384 lets a pass hold 4 sequences of 4,096 tokens or 8 of up to 2,048 (with 8 per
    # pass); it never binds a small model at its usual length (8 x 192 = 1,536 for MiniLM-L6).
    forward_max_tokens: int = 16384
    max_latency_ms: int = 60000
    timeout_seconds: float = 300.0
    download_dir: str | None = None
    precision: str = "auto"
    device: str = "auto"
    gpus: int | None = None  # None: auto (declared_gpus)
    ood_flag: bool = True

    def limits(self) -> ServingLimits:
        return ServingLimits(self.max_items, self.max_candidates, self.max_text_bytes)


_POSITIVE_INTS = {"port", "max_items", "max_candidates", "max_text_bytes", "max_body_bytes", "max_batch_size", "forward_batch_size",
                  "max_latency_ms"}
_NON_NEGATIVE_INTS = {"forward_max_tokens": "a whole number of tokens (0: no budget)"}
_FILE_ONLY_FORBIDDEN = {"api_key"}


def _parse(name: str, source: str, raw: object) -> object:
    if raw is None or isinstance(raw, (dict, list)):  # JSON null, a table or a list: never a setting's value
        raise SettingsError(f"{source}={raw!r}: expected a single value")
    if name in _POSITIVE_INTS or name in _NON_NEGATIVE_INTS:
        least, expected = (0, _NON_NEGATIVE_INTS[name]) if name in _NON_NEGATIVE_INTS else (1, "a positive whole number")
        try:
            value = int(str(raw).strip())
        except ValueError:
            value = least - 1
        if value < least:
            raise SettingsError(f"{source}={raw!r}: expected {expected}")
        if name == "port" and value > 65535:
            raise SettingsError(f"{source}={raw!r}: expected a TCP port, 1 to 65535")
        return value
    if name in ("poll_seconds", "timeout_seconds"):
        try:
            value = float(str(raw).strip())
        except ValueError:
            raise SettingsError(f"{source}={raw!r}: expected a (finite) number of seconds") from None
        if not math.isfinite(value) or value < 0 or (name == "timeout_seconds" and value == 0):
            raise SettingsError(f"{source}={raw!r}: expected a {'positive' if name == 'timeout_seconds' else 'non-negative'} "
                                "finite number of seconds")
        return value
    if name in ("batching", "ood_flag"):
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{source}={raw!r}: expected 1 or 0 (true/false, on/off)")
    text = str(raw).strip()
    if name == "gpus":
        if text == "auto":
            return None
        if not text.isdigit():
            raise SettingsError(f"{source}={raw!r}: expected auto or a whole number of GPUs (0: declare none)")
        return int(text)
    if name == "precision" and text not in ("auto", "fp32", "bf16"):
        raise SettingsError(f"{source}={raw!r}: expected auto, fp32 or bf16")
    if name == "device" and not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise SettingsError(f"{source}={raw!r}: expected auto, cpu, cuda or cuda:N")
    if name == "model_uri" and not text:
        raise SettingsError(f"{source} is empty: name a model, e.g. {DEFAULT_MODEL_URI}")
    return text or None


def declared_gpus(settings: Settings, gpu_visible: bool) -> int:
    """The GPUs the service declares to BentoML (`resources={"gpu": n}`); `gpu_visible`: whether torch sees one.

    `bentoml serve` then gives its worker GPUs of its own: it sets CUDA_VISIBLE_DEVICES to the first ones no
    other service of the same `bentoml serve` holds, so cuda (cuda:0) is the worker's first GPU (unless
    CUDA_VISIBLE_DEVICES is set already: BentoML then assigns nothing, _bentoml_impl/server/allocator.py).
    Declared on a machine without a GPU, BentoML would still set CUDA_VISIBLE_DEVICES=0 for a GPU that is not
    there (after a ResourceWarning, hidden by default): so by default it is declared only where the device
    setting resolves to CUDA and a GPU is visible. A device cuda:N with N > 0 names a GPU itself: nothing is
    declared for it, which would renumber the GPUs the worker sees."""
    if settings.gpus is not None:
        return settings.gpus
    if not gpu_visible or settings.device not in ("auto", "cuda", "cuda:0"):
        return 0
    return 1


def gpu_resources(settings: Settings, gpu_visible: bool) -> dict[str, int]:
    """`resources` for `@bentoml.service`: {"gpu": n}, or {} where none is declared (BentoML accepts no 0)."""
    gpus = declared_gpus(settings, gpu_visible)
    return {"gpu": gpus} if gpus else {}


def _read_file(path: str) -> dict:
    file = Path(path).expanduser()
    if not file.is_file():
        raise SettingsError(f"{CONFIG_VARIABLE}={path!r}: no such file")
    try:
        data = tomllib.loads(file.read_text()) if file.suffix == ".toml" else json.loads(file.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise SettingsError(f"{CONFIG_VARIABLE}={path!r}: cannot parse ({exc}); use TOML (.toml) or JSON") from None
    if not isinstance(data, dict):
        raise SettingsError(f"{CONFIG_VARIABLE}={path!r}: expected a table of settings")
    return data


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    environ = os.environ if environ is None else environ
    known = {f.name for f in fields(Settings)}
    values: dict[str, object] = {}
    if environ.get(CONFIG_VARIABLE):
        path = environ[CONFIG_VARIABLE]
        for key, raw in _read_file(path).items():
            if key not in known:
                raise SettingsError(f"{path}: unknown setting {key!r}; known: {', '.join(sorted(known - _FILE_ONLY_FORBIDDEN))}")
            if key in _FILE_ONLY_FORBIDDEN:
                raise SettingsError(f"{path}: {key} is read from {PREFIX}{key.upper()} only, never from a file")
            values[key] = _parse(key, f"{path}: {key}", raw)
    for name in known:
        variable = PREFIX + name.upper()
        if environ.get(variable) is not None and environ[variable] != "":
            # The key is taken as given: its value never enters a message.
            values[name] = environ[variable] if name == "api_key" else _parse(name, variable, environ[variable])
    settings = Settings(**values)
    if settings.batching and settings.max_batch_size < 2:
        raise SettingsError(f"{PREFIX}MAX_BATCH_SIZE={settings.max_batch_size}: batching needs at least 2; "
                            f"set {PREFIX}BATCHING=0 to turn it off")
    return settings
