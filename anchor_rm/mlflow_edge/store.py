"""Connecting to the tracking store and registry, once for every entry point (pipelines, Ray trials, the
service), and MLflow's errors as one type with a one-line message."""

from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

DEFAULT_DB = "mlflow.db"

# What the edge raises: callers catch this one type (a store error, an unreachable server, a missing
# resource) without importing mlflow.
TrackingError = MlflowException


def resolve_tracking_uri(cli_value: str | None = None) -> str:
    """--tracking-uri, else $MLFLOW_TRACKING_URI, else SQLite in the working directory."""
    if cli_value:
        return cli_value
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path.cwd() / DEFAULT_DB}"


# The stores connect() made their own registry. mlflow.set_registry_uri exports the URI as
# $MLFLOW_REGISTRY_URI (for subprocesses), so that variable alone cannot tell a registry the user chose from
# one set here before, for another store.
_defaulted_registries: set[str] = set()


def connect(tracking_uri: str | None = None, *, must_exist: bool = False) -> str:
    """Points MLflow's tracking and registry at the store (the store is its own registry unless the user's
    $MLFLOW_REGISTRY_URI names another); returns the URI. `must_exist`: refuse to create an empty SQLite
    file (a command that only reads the registry). Called again in the same process with another store,
    both move: the registry never stays on the store connected before."""
    uri = resolve_tracking_uri(tracking_uri)
    if must_exist and uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.exists():
            raise FileNotFoundError(f"no MLflow database at {path} (pass --tracking-uri or set MLFLOW_TRACKING_URI)")
    mlflow.set_tracking_uri(uri)
    users = os.environ.get("MLFLOW_REGISTRY_URI")
    if users and users not in _defaulted_registries:
        mlflow.set_registry_uri(users)
    else:
        _defaulted_registries.add(uri)
        mlflow.set_registry_uri(uri)
    return uri


@contextmanager
def bounded_requests(max_retries: int, timeout_s: float, backoff_factor: float | None = None):
    """MLflow's REST client reads its retry count, per-request timeout and backoff from the environment on every
    request: within this block, these (by default 7 retries with backoff factor 2, minutes against a dead server)."""
    names = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(max_retries), "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout_s)}
    if backoff_factor is not None:
        names["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] = str(backoff_factor)
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(names)
    pool_log = logging.getLogger("urllib3.connectionpool")  # a "Retrying (...)" warning per retry: the caller says it once
    pool_level = pool_log.level
    pool_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pool_log.setLevel(pool_level)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# The first request of a command to a tracking server: 3 retries 0, 2 and 4 s apart (plus MLflow's jitter), so
# that a wrong URI or a server that is not running is one line within seconds, not MLflow's minutes of retries
# and a traceback; a server still starting has those seconds to answer.
FIRST_CONTACT_RETRIES, FIRST_CONTACT_TIMEOUT_S, FIRST_CONTACT_BACKOFF = 3, 10, 1
_CAUSES = ("Connection refused", "Name or service not known", "Temporary failure in name resolution",
           "No route to host", "timed out", "Failed to resolve")


def unreachable_reason(exc: Exception) -> str:
    """The cause of a failed request in a few words (MLflow's own message spans urllib3's whole chain)."""
    text = message(exc)
    for cause in _CAUSES:
        if cause.lower() in text.lower():
            return cause.lower()
    status = re.search(r"(status code|HTTP) (\d{3})", text)
    return f"HTTP {status.group(2)}" if status else text.strip().splitlines()[-1][:200]


def configure(tracking_uri: str | None, experiment: str) -> str:
    """Connects and selects (or creates) the experiment; returns its id. A new experiment on a SQLite store
    keeps its artifacts in mlartifacts/ beside the database, not in whatever folder the command ran from.
    A store that cannot be reached or read is a ValueError naming its URI, before any stage runs."""
    uri = connect(tracking_uri)
    try:
        with bounded_requests(FIRST_CONTACT_RETRIES, FIRST_CONTACT_TIMEOUT_S, FIRST_CONTACT_BACKOFF):
            existing = mlflow.get_experiment_by_name(experiment)
    except TrackingError as exc:
        where = "server" if uri.startswith(("http://", "https://")) else "store"
        raise ValueError(f"MLflow tracking {where} {uri} cannot be reached ({unreachable_reason(exc)}): start it, or "
                         f"pass another --tracking-uri (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db "
                         f"here)") from None
    if existing is None and uri.startswith("sqlite:///"):
        artifacts = Path(uri[len("sqlite:///"):]).resolve().parent / "mlartifacts"
        mlflow.create_experiment(experiment, artifact_location=artifacts.as_uri())
    return mlflow.set_experiment(experiment).experiment_id


def client(tracking_uri: str | None = None) -> MlflowClient:
    """A client of the connected store, or of `tracking_uri` (a Ray worker, which has not connected)."""
    return MlflowClient(tracking_uri) if tracking_uri else MlflowClient()


def tracking_uri() -> str:
    return mlflow.get_tracking_uri()


def registry_uri() -> str:
    return mlflow.get_registry_uri()


def message(exc: Exception) -> str:
    """MLflow's own message for an error, without the status line decoration."""
    return getattr(exc, "message", None) or str(exc)


def not_found(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"
