"""Fast tests (no server, no Ray, no training) of pieces the slow tests exercise only end to end: the
choice of the best trial, the CPU arithmetic per worker, stage reuse in MLflow (SQLite), the metric
writer's buffering, and removal of a version left half-written."""

from __future__ import annotations

import math
import tempfile

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from tuning.search import TrialOutcome, best_trial
from tuning.trainable import DRIVER_RESOURCES, worker_resources


def _outcome(trial: str, nts: float, epochs: int = 2, lam: float | None = 1e-4, checkpoint: str | None = "ckpt",
             error: str | None = None) -> TrialOutcome:
    return TrialOutcome(trial, {"method": "anchor", "anchor_lambda": lam, "anchor_layers": "last"}, nts, 60.0, epochs,
                        checkpoint, error)


def test_best_trial_takes_full_runs_with_checkpoints_and_breaks_ties_by_smaller_lambda():
    trials = [_outcome("a", 3.0, epochs=1),  # stopped early by ASHA: its last epoch is not comparable
              _outcome("b", 2.0, lam=1e-3), _outcome("c", 2.0, lam=1e-5),  # a tie: the smaller lambda
              _outcome("d", 9.0, error="RuntimeError: boom"), _outcome("e", 8.0, checkpoint=None),
              _outcome("f", math.nan)]
    assert best_trial(trials).trial_id == "c"
    assert best_trial([_outcome("a", 1.0, epochs=1)]).trial_id == "a"  # only early-stopped ones: the best of them
    with pytest.raises(RuntimeError, match="no trial finished with a checkpoint"):
        best_trial([_outcome("d", 9.0, error="x"), _outcome("e", 8.0, checkpoint=None)])


@pytest.mark.parametrize("nodes, concurrency, workers, expected", [
    ([2], 1, 1, (2.0, 2)), ([2], 2, 1, (1.0, 1)), ([8], 2, 2, (2.0, 2)), ([16], 1, 4, (4.0, 4)),
    # several nodes: a worker never asks more than one node has
    ([1, 1], 1, 1, (1.0, 1)), ([1, 1], 2, 1, (1.0, 1)), ([8, 8], 1, 1, (8.0, 8)), ([8, 8, 8, 8], 1, 4, (8.0, 8)),
    ([8, 2], 2, 1, (4.0, 4)), ([8, 2], 3, 1, (2.66, 2)), ([0, 8], 2, 1, (4.0, 4)),  # a head node with no CPU
])
def test_worker_resources_fit_the_trials_on_the_nodes(nodes, concurrency, workers, expected):
    per_worker, threads = worker_resources(nodes, concurrency, workers)
    assert (per_worker, threads) == expected
    # every worker finds a node with room for it (the drivers hold no CPU: DRIVER_RESOURCES)
    assert sum(int(cpus / per_worker + 1e-9) for cpus in nodes) >= concurrency * workers
    assert DRIVER_RESOURCES["CPU"] == 0


def test_worker_resources_refuse_what_cannot_fit():
    with pytest.raises(ValueError, match=r"nodes with \[0.03\] CPUs cannot hold 4 concurrent trials"):
        worker_resources([0.03], 4, 1)


@pytest.fixture
def sqlite_experiment(tmp_path):
    from anchor_rm.mlflow_edge.store import configure

    before = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    experiment_id = configure(f"sqlite:///{tmp_path / 'mlflow.db'}", "fast")
    yield experiment_id
    mlflow.set_tracking_uri(before[0])
    mlflow.set_registry_uri(before[1])


def test_connecting_to_another_store_moves_the_registry_with_it(tmp_path, monkeypatch):
    """The registry follows the tracking store from one connect to the next in a process (MLflow exports the
    first store's registry as $MLFLOW_REGISTRY_URI, which once kept registrations on it); a registry the user
    exported before is kept."""
    from anchor_rm.mlflow_edge.store import connect

    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)  # no registry of the user's, to begin with
    first, second = f"sqlite:///{tmp_path / 'a.db'}", "http://127.0.0.1:9"
    connect(first)
    assert mlflow.get_registry_uri() == first
    connect(second)
    assert (mlflow.get_tracking_uri(), mlflow.get_registry_uri()) == (second, second)
    mlflow.set_registry_uri(first)  # what a caller restoring its URIs does: exported again
    connect(second)
    assert mlflow.get_registry_uri() == second
    users = f"sqlite:///{tmp_path / 'registry.db'}"
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", users)
    connect(first)
    assert (mlflow.get_tracking_uri(), mlflow.get_registry_uri()) == (first, users)


def test_a_stage_runs_once_per_input_digest_and_is_read_back_after(sqlite_experiment, tmp_path, monkeypatch):
    from anchor_rm.mlflow_edge.keys import cache_key
    from anchor_rm.mlflow_edge.runs import stage_run

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # reading a stage back leaves nothing there
    calls = []

    def compute():
        calls.append(1)
        mlflow.log_metric("x", 1.0)
        return {"scores": [1, 2, 3]}

    key = cache_key("v1", {"lr": 1e-4})
    first = stage_run(sqlite_experiment, "teacher", key, compute, params={"train": {"lr": 1e-4}})
    again = stage_run(sqlite_experiment, "teacher", key, compute)
    other = stage_run(sqlite_experiment, "teacher", cache_key("v1", {"lr": 1e-3}), compute)
    forced = stage_run(sqlite_experiment, "teacher", key, compute, force=True)
    assert len(calls) == 3 and not first.reused and again.reused and not other.reused and not forced.reused
    assert again.run_id == first.run_id and again.outputs == {"scores": [1, 2, 3]}
    assert MlflowClient().get_run(first.run_id).data.params["train.lr"] == "0.0001"
    assert cache_key("v1", {"a": 1, "b": 2}) == cache_key("v1", {"b": 2, "a": 1})  # order does not matter
    assert list(scratch.iterdir()) == []


def test_a_stage_that_failed_is_not_reused(sqlite_experiment):
    from anchor_rm.mlflow_edge.runs import stage_run

    def broken():
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        stage_run(sqlite_experiment, "data", "k", broken)
    assert not stage_run(sqlite_experiment, "data", "k", lambda: {"ok": True}).reused


def test_the_writer_batches_and_keeps_what_the_server_did_not_take(sqlite_experiment):
    from anchor_rm.mlflow_edge.store import TrackingError
    from anchor_rm.mlflow_edge.writer import BufferedRunWriter

    run_id = MlflowClient().create_run(sqlite_experiment).info.run_id
    writer = BufferedRunWriter(mlflow.get_tracking_uri(), run_id, active=True, outage_seconds=1)
    for step in range(150):  # 300 values: one flush at 200
        writer.add({"train/loss": 1.0 / (step + 1), "train/lr": 1e-4}, step)
    assert len(writer.pending) == 100
    writer.deliver()
    history = MlflowClient().get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(150))

    class Refusing:
        def log_batch(self, run_id, metrics):
            raise TrackingError("API request failed: connection refused")

    writer.client = Refusing()
    writer.add({"train/loss": 0.5}, 150)
    assert not writer.flush() and len(writer.pending) == 1 and writer.failures == 1 and writer.next_attempt > 0
    assert "connection refused" in writer.last_error
    inactive = BufferedRunWriter(mlflow.get_tracking_uri(), run_id, active=False)
    inactive.add({"x": 1.0}, 0)
    assert inactive.pending == [] and inactive.flush()


def test_a_checkpoint_during_an_outage_keeps_training_going_and_its_values_arrive_once_after_a_restart(
        sqlite_experiment, tmp_path):
    """The server unreachable at a checkpoint: one quick attempt, the undelivered values written into the
    checkpoint folder; a worker restarted from it sends them again, and a value sent twice (the first send
    reached the server, the answer did not) is kept once. Past the outage limit a checkpoint raises."""
    import time

    from anchor_rm.mlflow_edge.store import TrackingError, client
    from anchor_rm.mlflow_edge.writer import PENDING_FILE, BufferedRunWriter, TrackingUnavailable

    uri = mlflow.get_tracking_uri()
    run_id = MlflowClient().create_run(sqlite_experiment).info.run_id
    writer = BufferedRunWriter(uri, run_id, active=True, outage_seconds=30)
    writer.add({"train/loss": 1.0}, 0)
    writer.checkpoint(tmp_path)  # the server takes it: nothing is left to carry
    assert writer.pending == [] and not (tmp_path / PENDING_FILE).exists()

    class Unreachable:
        def log_batch(self, run_id, metrics):
            raise TrackingError("API request failed: connection refused")

    writer.client = Unreachable()
    for step in range(1, 6):
        writer.add({"train/loss": 1.0 / (step + 1), "train/lr": 1e-4}, step)
    started = time.monotonic()
    writer.checkpoint(tmp_path)
    assert time.monotonic() - started < 1 and writer.failures == 1 and len(writer.pending) == 10
    carried = BufferedRunWriter.read_pending(tmp_path)
    assert carried == writer.pending

    client(uri).log_batch(run_id, metrics=carried[:4])  # some had reached the server before the worker died
    restarted = BufferedRunWriter(uri, run_id, active=True, outage_seconds=30)
    restarted.restore(carried)
    restarted.add({"train/loss": 0.1}, 6)
    restarted.deliver()
    for key, steps in (("train/loss", list(range(7))), ("train/lr", list(range(1, 6)))):
        history = MlflowClient().get_metric_history(run_id, key)
        assert sorted(m.step for m in history) == steps, key  # every value once

    writer.outage_seconds = 0.2
    time.sleep(0.3)
    with pytest.raises(TrackingUnavailable, match=f"10 metric values of run {run_id} not delivered"):
        writer.checkpoint(tmp_path)
    assert writer.blocked_s < 1


def test_a_version_that_fails_after_it_exists_is_removed(sqlite_experiment, tmp_path, minilm_tokenizer, monkeypatch):
    from anchor_rm.mlflow_edge import registry
    from anchor_rm.report import SplitResult, build_report
    from helpers import tiny_model_folder

    folder = tiny_model_folder(tmp_path / "model", minilm_tokenizer)
    rows = [SplitResult("hh-helpful-base", "id", "test", 470, 60.0, 61.0, None, 0.0),
            SplitResult("pandalm", "ood", "test", 300, 50.0, 55.0, None, 0.0)]
    report = build_report({"name": "m", "student": "tiny", "teacher": "t", "method": "anchor", "hyperparameters": {}},
                          rows, selection_splits="val", figure_splits="test",
                          data_digests={"hh-helpful-base/id_test": "a" * 64, "pandalm/test": "b" * 64})

    def refuse(self, name, alias, version):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", refuse)
    with pytest.raises(OSError), mlflow.start_run():
        registry.log_and_register(folder, report, "fast-model")
    assert MlflowClient().search_model_versions("name = 'fast-model'") == []


@pytest.mark.parametrize("field, value, flag", [("num_samples", 0, "--num-samples"), ("concurrency", 0, "--concurrency"),
                                               ("workers_per_trial", -1, "--workers-per-trial"),
                                               ("max_failures", -1, "--max-failures"), ("num_cpus", 0, "--num-cpus")])
def test_main_job_settings_refuse_counts_that_cannot_run_naming_the_flag(field, value, flag):
    from tuning.main_job import MainJobSettings

    with pytest.raises(ValueError, match=f"{flag} must be at least"):
        MainJobSettings(**{field: value})
    assert MainJobSettings(max_failures=0, num_samples=None).max_failures == 0


def test_main_job_settings_refuse_num_cpus_for_an_existing_cluster():
    from tuning.main_job import MainJobSettings

    with pytest.raises(ValueError, match="--num-cpus sizes the local Ray cluster; with --ray-address"):
        MainJobSettings(num_cpus=2, ray_address="127.0.0.1:6379")
    assert MainJobSettings(num_cpus=2).num_cpus == 2
