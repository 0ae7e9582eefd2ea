"""Fast tests (no server, no Ray, no training) of pieces the slow tests exercise only end to end: the
choice of the best trial, the CPU arithmetic per worker, stage reuse in MLflow (SQLite), the metric
writer's buffering, and removal of a version left half-written."""

from __future__ import annotations

import math
import tempfile

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from tuning.search import SearchFailed, TrialOutcome, best_trial
from tuning.trainable import DRIVER_RESOURCES, worker_resources


def _outcome(trial: str, nts: float, epochs: int = 2, lam: float | None = 1e-4, checkpoint: str | None = "ckpt",
             error: str | None = None) -> TrialOutcome:
    return TrialOutcome(trial, {"method": "anchor", "anchor_lambda": lam, "anchor_layers": "last"}, nts, 60.0, epochs,
                        checkpoint, error)


def test_the_search_space_never_proposes_naive_w2s_or_a_configuration_twice():
    """lambda = 0 is naive W2S, which the baselines train; with lambda = 0 the layer choice changes nothing. The
    space (through Ray's OptunaSearch, as Tune asks it) proposes neither, and no configuration twice."""
    import random

    from tuning.space import LAYER_CHOICES, METRIC, make_searcher

    # Each layer choice searches its own calibrated range (lambda_scale): a middle trial never gets a last one's.
    ranges = {"last": (1e-3, 1e1), "middle": (1e2, 1e6)}
    searcher, rng, seen = make_searcher(seed=0, ranges=ranges), random.Random(0), set()
    for i in range(40):
        config = searcher.suggest(f"trial-{i}")
        assert config["method"] == "anchor" and config["anchor_layers"] in LAYER_CHOICES, config
        low, high = ranges[config["anchor_layers"]]
        assert low <= config["anchor_lambda"] <= high, config  # never 0
        key = (config["anchor_lambda"], config["anchor_layers"])
        assert key not in seen, (i, key)
        seen.add(key)
        searcher.on_trial_complete(f"trial-{i}", {METRIC: rng.uniform(-3, 3), "training_iteration": 2})


def test_best_trial_takes_full_runs_with_checkpoints_and_breaks_ties_by_id_accuracy_then_smaller_lambda():
    trials = [_outcome("a", 3.0, epochs=1),  # stopped early by ASHA: its last epoch is not comparable
              _outcome("b", 2.0, lam=1e-3), _outcome("c", 2.0, lam=1e-5),  # a tie: the smaller lambda
              _outcome("d", 9.0, error="RuntimeError: boom"), _outcome("e", 8.0, checkpoint=None),
              _outcome("f", math.nan)]
    assert best_trial(trials).trial_id == "c"
    assert best_trial([_outcome("a", 1.0, epochs=1)]).trial_id == "a"  # only early-stopped ones: the best of them
    naive = TrialOutcome("n", {"method": "naive", "anchor_lambda": None, "anchor_layers": None}, 2.0, 60.0, 2, "ckpt")
    assert best_trial(trials + [naive]).trial_id == "n"  # tied on NTS and ID accuracy: the simpler model
    sharper = _outcome("s", 2.0 + 1e-9, lam=1e-2)
    sharper.val_id_acc = 61.0
    assert best_trial(trials + [naive, sharper]).trial_id == "s"  # a float-noise tie: the higher val ID accuracy
    with pytest.raises(SearchFailed, match=r"no trial finished with a checkpoint \(trial d: x; trial e: no checkpoint\)"):
        best_trial([_outcome("d", 9.0, error="x"), _outcome("e", 8.0, checkpoint=None)])


class _Result:
    """What Tune's ResultGrid yields for a trial (ray.tune.Result): config comes from its metrics."""

    def __init__(self, metrics: dict | None, path: str, error: Exception | None = None):
        self.metrics, self.path, self.error = metrics, path, error

    @property
    def config(self):  # as ray.air.result.Result.config: None when the trial reported nothing
        return (self.metrics or {}).get("config")


def test_a_trial_that_reported_nothing_is_an_error_named_by_its_folder_never_a_result():
    from tuning.search import _outcomes

    done = _Result({"trial_id": "t1", "val_mean_nts": 1.5, "val_id_acc": 60.0, "training_iteration": 2,
                    "checkpoint_path": "/ckpt", "config": {"method": "naive", "other": 1}}, "/exp/trial_driver_t1")
    killed = _Result(None, "/exp/trial_driver_t2")  # its driver died while Tune was creating it
    failed = _Result({}, "/exp/trial_driver_t3", FileNotFoundError("Could not fetch metrics for trial_driver_t3"))
    ok, nothing, error = _outcomes([done, killed, failed])
    assert ok.config == {"method": "naive", "anchor_lambda": None, "anchor_layers": None} and ok.error is None
    assert nothing.trial_id == "trial_driver_t2" and nothing.error == "the trial reported no result"
    assert nothing.config == {"method": None, "anchor_lambda": None, "anchor_layers": None} and math.isnan(nothing.val_mean_nts)
    assert error.trial_id == "trial_driver_t3" and "Could not fetch metrics" in error.error
    assert best_trial([ok, nothing, error]) is ok
    with pytest.raises(SearchFailed, match=r"trial trial_driver_t2: the trial reported no result; trial trial_driver_t3: "
                                           r"Could not fetch metrics for trial_driver_t3\)\. `tune.py --resume` runs"):
        best_trial([nothing, error])


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
    from anchor_rm.evaluation.keys import cache_key
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
    from anchor_rm.evaluation.report import SplitResult, build_report
    from anchor_rm.mlflow_edge import registry
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


@pytest.mark.timeout(60)
def test_the_selected_checkpoint_is_registered_without_what_only_training_reads(tmp_path):
    """The optimizer's state (twice the model's size), undelivered metrics and the validation scores stay in the
    trial's checkpoint; the local copy that the registry stores and the service downloads is the model alone.
    The validation scores come back to the caller."""
    import json

    from anchor_rm.mlflow_edge.writer import PENDING_FILE
    from tuning.final import checkpoint_folder
    from tuning.trainable import TRAINING_STATE, VALIDATION_SCORES

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "anchor_rm.json").write_text(json.dumps({"max_length": 64, "decoder": False, "base_model": "m"}))
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    (checkpoint / TRAINING_STATE).write_bytes(b"adam moments")
    (checkpoint / PENDING_FILE).write_text("{}")
    score = {"accuracy": 61.0, "n_pairs": 300, "tie_rate": 0.0, "identical_after_truncation": 0, "correct": "10"}
    (checkpoint / VALIDATION_SCORES).write_text(json.dumps({"hh-helpful": score}))
    outcome = TrialOutcome("t", {"method": "naive"}, 1.0, 61.0, 2, str(checkpoint))
    folder, scores = checkpoint_folder(outcome, tmp_path / "selected")
    assert sorted(p.name for p in folder.iterdir()) == ["anchor_rm.json", "model.safetensors"]
    assert scores["hh-helpful"].accuracy == 61.0 and scores["hh-helpful"].correct == "10"
    assert (checkpoint / TRAINING_STATE).exists() and (checkpoint / VALIDATION_SCORES).exists()  # resume reads it
    (checkpoint / VALIDATION_SCORES).unlink()  # a checkpoint written before the scores were kept
    assert checkpoint_folder(outcome, tmp_path / "older")[1] is None


def test_the_selection_summary_says_whether_the_winner_is_distinguishable_from_naive_w2s():
    from anchor_rm.evaluation.report_files import _selection_lines
    from tuning.final import selection_summary

    naive = TrialOutcome("n", {"method": "naive", "anchor_lambda": None, "anchor_layers": None}, 1.0, 60.0, 2, "ckpt")
    close, tie, far = _outcome("c", 2.0, lam=1e-3), _outcome("t", 2.0, lam=1e-2), _outcome("f", 12.0, lam=1.0)
    summary = selection_summary(close, [close, tie, naive], naive, [200, 200, 200])
    # three targets of 200 validation pairs: one target's difference has se 5.0 points at most, their mean 2.89
    assert summary["difference_standard_error"] == pytest.approx(math.sqrt(3 * 50.0**2 * 2 / 200) / 3)
    assert summary["difference_from_naive"] == 1.0 and summary["distinguishable_from_naive"] is False
    assert [c["trial_id"] for c in summary["tied_with"]] == ["t"] and summary["candidates"] == 3
    assert "tie (equal to 1e-6 points) goes to the higher validation ID accuracy" in summary["rule"]
    text = "\n".join(_selection_lines(summary))
    assert "**not distinguishable**" in text and "tied on validation mean NTS with ANCHOR last lambda=0.01" in text
    assert selection_summary(far, [far, naive], naive, [200, 200, 200])["distinguishable_from_naive"] is True
    own = selection_summary(naive, [naive], naive, [400])
    assert own["distinguishable_from_naive"] is False and "Naive W2S itself was selected" in "\n".join(_selection_lines(own))
    assert selection_summary(close, [close], None, [400])["distinguishable_from_naive"] is None


@pytest.mark.timeout(60)
def test_the_default_main_job_runs_harmless_and_what_follows_it_expects_that():
    """The default preset runs harmless (helpful has no reliable weak-to-strong gap with MiniLM-L6: the gate stopped
    the helpful default in fp32); smoke and paper stay helpful; promote.py and the service default to the name the
    default main job registers."""
    from anchor_rm.cli import promote, train, tune
    from anchor_rm.mlflow_edge.registry import default_model_name
    from service.schemas import DEFAULT_MODEL_URI


    assert tune.tune_config(tune.build_parser().parse_args([])).category == "harmless"
    assert tune.tune_config(tune.build_parser().parse_args(["--preset", "smoke"])).category == "helpful"
    assert tune.tune_config(tune.build_parser().parse_args(["--preset", "paper"])).category == "helpful"
    assert tune.tune_config(tune.build_parser().parse_args(["--preset", "smoke", "--category", "harmless"])).category == "harmless"
    assert train.category_of(train.build_parser().parse_args([])) == "harmless"
    name = default_model_name(promote.build_parser().parse_args([]).category)
    assert name == default_model_name("harmless") and DEFAULT_MODEL_URI == f"models:/{name}@champion"


TOKEN_PROBE = """
import json, os, sys
from anchor_rm.cli import tune
tune.use_ray_token(sys.argv[1] or None)
print(json.dumps({k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}))
"""


@pytest.mark.parametrize("address, env, home_token, expected", [
    ("", {}, False, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "<own>"}),  # local: a token of its own
    ("", {}, True, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "<own>"}),  # ~/.ray's is neither read nor touched
    ("", {"RAY_AUTH_TOKEN_PATH": "/t"}, False, {"RAY_AUTH_TOKEN_PATH": "/t"}),  # the user's choice stands
    ("", {"RAY_AUTH_MODE": "disabled"}, False, {"RAY_AUTH_MODE": "disabled"}),
    ("10.0.0.5:6379", {}, True, {"RAY_AUTH_MODE": "token"}),  # an existing cluster: the token at hand
    ("10.0.0.5:6379", {}, False, {}),  # no token at hand: as Ray decides
])
def test_the_ray_token_of_a_local_cluster_is_its_own_and_the_users_is_left_alone(tmp_path, address, env, home_token,
                                                                                 expected):
    import json
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    if home_token:
        (home / ".ray" / "auth_token").write_text("the-users-token")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    full_env.update({"HOME": str(home), **env})
    probe = subprocess.run([sys.executable, "-c", TOKEN_PROBE, address], env=full_env, capture_output=True,
                           text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    got = {k: v for k, v in json.loads(probe.stdout.splitlines()[-1]).items() if v is not None}
    if expected.get("RAY_AUTH_TOKEN") == "<own>":
        assert len(got.pop("RAY_AUTH_TOKEN")) == 64
        expected = {k: v for k, v in expected.items() if k != "RAY_AUTH_TOKEN"}
    assert got == expected
    assert sorted(p.name for p in (home / ".ray").iterdir()) == (["auth_token"] if home_token else [])
    if home_token:
        assert (home / ".ray" / "auth_token").read_text() == "the-users-token"


def test_the_nts_lambda_chart_draws_nts_and_the_drift_removed_against_lambda(tmp_path):
    """Lambda in drift terms: each trial's drift on the probe beside naive W2S's, as the share it removed (0: as
    naive, 1: none left, negative: more than naive); a trial that failed is no row; one with no drift measured has
    no reduction."""
    from dataclasses import replace

    from tuning.final import drift_rows, nts_lambda_chart, outcome_label

    naive = TrialOutcome("n", {"method": "naive", "anchor_lambda": None, "anchor_layers": None}, 1.0, 60.0, 2, "ckpt",
                         drift_last=0.04)
    anchor = [replace(_outcome("a", 2.0, lam=1e-3), drift_last=0.03, anchor_loss_start=1e-4, anchor_loss_end=0.02),
              replace(_outcome("b", math.nan, lam=1e-1), drift_last=0.01), _outcome("c", -1.0, lam=3.0, epochs=1),
              replace(_outcome("d", 0.5, lam=10.0), drift_last=0.05), _outcome("e", 9.0, error="RuntimeError: boom")]
    drift = drift_rows([naive], anchor)
    by_id = {row["trial_id"]: row for row in drift["trials"]}
    assert drift["naive_drift_last"] == 0.04 and "e" not in by_id
    assert by_id["n"]["drift_reduction"] == 0.0 and abs(by_id["a"]["drift_reduction"] - 0.25) < 1e-12
    assert abs(by_id["d"]["drift_reduction"] + 0.25) < 1e-12 and by_id["c"]["drift_reduction"] is None
    assert by_id["b"]["val_mean_nts"] is None and by_id["a"]["anchor_loss_end"] == 0.02
    assert [row["trial_id"] for row in drift["trials"]] == ["n", "a", "b", "c", "d"]  # baselines, then by lambda
    path = nts_lambda_chart(drift, tmp_path / "chart.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert outcome_label(naive) == "naive W2S" and outcome_label(anchor[0]) == "ANCHOR last lambda=0.001"
    assert drift_rows([], anchor)["trials"][0]["drift_reduction"] is None  # no naive W2S: nothing to compare with


def test_a_token_budget_bounds_each_forward_pass_and_keeps_every_sequence_once():
    from anchor_rm.model.scoring import length_sorted_batches

    lengths = [10, 500, 30, 120, 120, 2000, 64, 64, 64, 64, 7]
    plain = length_sorted_batches(lengths, 4)
    assert [len(b) for b in plain] == [4, 4, 3]
    budgeted = length_sorted_batches(lengths, 4, max_tokens=256)
    assert sorted(i for b in budgeted for i in b) == list(range(len(lengths)))
    for batch in budgeted:
        longest = max(lengths[i] for i in batch)
        assert len(batch) <= 4 and (len(batch) * longest <= 256 or len(batch) == 1)  # longer than the budget: alone
    assert [5] in budgeted and [1] in budgeted  # 2,000 and 500 tokens: over the budget, each alone
    assert any(len(b) == 4 and max(lengths[i] for i in b) == 64 for b in budgeted)  # four of 64 tokens fit 256


def test_the_service_reads_a_token_budget_and_refuses_a_negative_one():
    from service.config import SettingsError, load_settings

    assert load_settings({}).forward_max_tokens == 16384  # on by default: a large model's activations
    assert load_settings({"ANCHOR_RM_FORWARD_MAX_TOKENS": "4096"}).forward_max_tokens == 4096
    assert load_settings({"ANCHOR_RM_FORWARD_MAX_TOKENS": "0"}).forward_max_tokens == 0
    with pytest.raises(SettingsError, match="ANCHOR_RM_FORWARD_MAX_TOKENS='-1'"):
        load_settings({"ANCHOR_RM_FORWARD_MAX_TOKENS": "-1"})


@pytest.mark.timeout(120)
def test_the_console_entry_point_and_the_scripts_run_the_same_commands():
    """`anchor-rm COMMAND` (pip's console script, pyproject [project.scripts]) and `python pipelines/COMMAND.py`
    reach the same parser; an unknown command is named with the list of known ones."""
    import subprocess
    import sys
    from pathlib import Path

    from helpers import ROOT

    script = Path(sys.executable).parent / "anchor-rm"
    assert script.is_file(), f"{script}: not installed; run scripts/setup.sh (pip install -e .)"
    listing = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and all(c in listing.stdout for c in ("tune", "train", "evaluate", "promote", "study"))
    tune_help = subprocess.run([str(script), "tune", "--help"], capture_output=True, text=True, timeout=60)
    assert tune_help.returncode == 0 and tune_help.stdout.startswith("usage: anchor-rm tune"), tune_help.stdout[:200]
    script_help = subprocess.run([sys.executable, str(ROOT / "pipelines" / "tune.py"), "--help"], capture_output=True,
                                 text=True, timeout=60)
    assert script_help.returncode == 0 and "--num-samples" in script_help.stdout and "--num-samples" in tune_help.stdout
    unknown = subprocess.run([str(script), "tunе"], capture_output=True, text=True, timeout=60)  # a Cyrillic e
    assert unknown.returncode == 2 and "unknown command 'tunе'; one of tune, train" in unknown.stderr
    assert not [p.name for p in (ROOT / "pipelines").glob("*.py") if "sys.path" in p.read_text()]
