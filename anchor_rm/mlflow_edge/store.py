"""Connecting to the tracking store and registry, once for every entry point (pipelines, Ray trials, the
service), and MLflow's errors as one type with a one-line message."""

from __future__ import annotations

import os
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


def configure(tracking_uri: str | None, experiment: str) -> str:
    """Connects and selects (or creates) the experiment; returns its id. A new experiment on a SQLite store
    keeps its artifacts in mlartifacts/ beside the database, not in whatever folder the command ran from."""
    uri = connect(tracking_uri)
    existing = mlflow.get_experiment_by_name(experiment)
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
