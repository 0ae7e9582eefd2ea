"""Faults during training, tuning and registration, on real components (docs/reliability.md):

- the MLflow tracking server stopped and started again (same port, same store) while a trial logs metrics:
  every value arrives, once; an outage longer than allowed fails loudly with the run and the count;
- an unwritable or full artifact location: one line naming the path, exit code 2, no model version;
- a failure after the version was created: the half-written version is removed;

The killed Ray Train worker, the killed tune driver, the trial that really fails and the tracking outage
inside a real tune run are in tests/test_tune.py (one tune run carries them all).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from anchor_rm.evaluation.report import SplitResult, build_report
from anchor_rm.mlflow_edge import registry
from anchor_rm.mlflow_edge.store import configure
from anchor_rm.mlflow_edge.writer import OUTAGE_ENV, BufferedRunWriter, TrackingUnavailable, outage_seconds_from_env
from helpers import (PYTHON, ROOT, free_port, ray_head, run_pipeline, start_mlflow_server, stop_process_group,
                     tiny_model_folder)
from tuning.trainable import STEP_HOOK_ENV

NAME = "anchor-rm-harmless"  # what the service serves and promote.py names by default
SMOKE_NAME = "anchor-rm-helpful"  # the experiment and model of tune.py --preset smoke (helpful)


@pytest.fixture
def restore_mlflow_uris():
    before = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    saved_env = {k: os.environ.pop(k, None) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    yield
    mlflow.set_tracking_uri(before[0])
    mlflow.set_registry_uri(before[1])
    for k, v in saved_env.items():  # what the test set (mlflow.set_registry_uri exports it) goes, what was there returns
        os.environ.pop(k, None)
        if v is not None:
            os.environ[k] = v


# --- the tracking server unreachable for a while ------------------------------------------------------


def _steps(client: MlflowClient, run_id: str, key: str) -> Counter:
    return Counter(m.step for m in client.get_metric_history(run_id, key))


def _server_with_a_run(workdir: Path, monkeypatch) -> tuple[int, subprocess.Popen, MlflowClient, str]:
    """A real `mlflow server` on a free port and one run in it. MLflow's client keeps its default retries
    (minutes): the writer must bound its own attempts."""
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    port = free_port()
    server = start_mlflow_server(workdir, port)
    client = MlflowClient(f"http://127.0.0.1:{port}")
    return port, server, client, client.create_run(client.create_experiment("outage")).info.run_id


@pytest.mark.slow
def test_metrics_logged_during_a_tracking_server_outage_all_arrive_once(tmp_path, monkeypatch):
    port, server, client, run_id = _server_with_a_run(tmp_path, monkeypatch)
    uri = client.tracking_uri
    try:
        logger = BufferedRunWriter(uri, run_id, active=True, outage_seconds=180)
        for step in range(5):
            logger.add({"train/loss": 1.0 / (step + 1), "train/lr": 1e-4}, step)
        logger.deliver()

        stop_process_group(server)  # the outage
        for step in range(5, 130):  # 250 values: add() tries to flush at 200 and fails
            logger.add({"train/loss": 1.0 / (step + 1), "train/lr": 1e-4}, step)
        assert logger.failures >= 1 and len(logger.pending) == 250  # kept, not dropped
        assert not logger.flush() and len(logger.pending) == 250

        delivered = threading.Event()
        errors: list[BaseException] = []

        def deliver() -> None:  # what a worker does at the end of training: wait for the server
            try:
                logger.deliver()
                delivered.set()
            except BaseException as exc:
                errors.append(exc)

        waiting = threading.Thread(target=deliver)
        waiting.start()
        time.sleep(3)
        assert not delivered.is_set()
        server = start_mlflow_server(tmp_path, port)  # back, same port, same store
        waiting.join(timeout=150)
        assert delivered.is_set() and not errors, errors
        assert logger.pending == []
        for key in ("train/loss", "train/lr"):
            steps = _steps(client, run_id, key)
            assert sorted(steps) == list(range(130)) and set(steps.values()) == {1}, key
    finally:
        stop_process_group(server)


@pytest.mark.slow
def test_tracking_outage_longer_than_allowed_fails_loudly_and_keeps_the_values(tmp_path, monkeypatch):
    _, server, client, run_id = _server_with_a_run(tmp_path, monkeypatch)
    uri = client.tracking_uri
    stop_process_group(server)
    logger = BufferedRunWriter(uri, run_id, active=True, outage_seconds=4)
    logger.add({"val/mean_nts": 1.5}, 0)
    started = time.monotonic()
    with pytest.raises(TrackingUnavailable) as err:
        logger.deliver()
    assert 4 <= time.monotonic() - started < 60
    message = str(err.value)
    assert uri in message and run_id in message and "1 metric values" in message and "not delivered" in message
    assert len(logger.pending) == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_trial_whose_tracking_server_stays_down_past_the_limit_fails_naming_it_then_delivers_every_value_once(
        tmp_path, monkeypatch, minilm_tokenizer):
    """The give-up path end to end, in a real Ray Train run of one trial (tests/one_train_run.py: the trainer a
    Tune trial fits, its worker a Ray process): the tracking server stops during epoch 0 and stays down past
    the limit (OUTAGE_ENV = 3 s). Training goes on to its end; then the run fails with TrackingUnavailable
    naming the server, the limit, the run and how many values were not delivered, and its checkpoint holds
    them. Fitted again once the server is back (as Ray Train or `tune.py --resume` restarts a trial), the run
    delivers the value of every step, once."""
    port, server, client, run_id = _server_with_a_run(tmp_path, monkeypatch)
    uri = client.tracking_uri
    marker, spec = tmp_path / "hold", tmp_path / "spec.json"
    spec.write_text(json.dumps({"student": str(tiny_model_folder(tmp_path / "student", minilm_tokenizer)),
                                "tracking_uri": uri, "run_id": run_id, "storage_path": str(tmp_path / "ray")}))
    hook = {"HF_HUB_OFFLINE": "1", OUTAGE_ENV: "3",
            STEP_HOOK_ENV: f"{Path(__file__).parent / 'fault_hooks.py'}:hold_for_outage_at:1:{marker}"}
    script = [PYTHON, str(Path(__file__).parent / "one_train_run.py")]
    try:
        with ray_head(tmp_path) as address:
            env = {**os.environ, **hook}  # inside the block: with the head's token
            log_path = tmp_path / "first.log"
            with open(log_path, "w") as log:
                first = subprocess.Popen([*script, address, str(spec)], cwd=tmp_path, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 300
                while not marker.exists():  # the worker holds after step 1 until the server is gone
                    assert first.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
                    time.sleep(0.5)
                stop_process_group(server)
                (tmp_path / "hold.down").touch()
                assert first.wait(timeout=300) == 3, log_path.read_text()[-4000:]
            finally:
                if first.poll() is None:
                    first.kill()
            failed = log_path.read_text()
            given_up = re.search(rf"MLflow tracking server {re.escape(uri)} unreachable for over \d+ s \(limit 3 s, "
                                 rf"{OUTAGE_ENV}\): (\d+) metric values of run {run_id} not delivered", failed)
            assert given_up and int(given_up.group(1)) > 0, failed[-4000:]
            kept = [json.loads(p.read_text()) for p in (tmp_path / "ray").rglob("pending_metrics.json")]
            assert kept and all(k["run_id"] == run_id and k["metrics"] for k in kept), kept

            server = start_mlflow_server(tmp_path, port)  # back: same port, same store
            again = subprocess.run([*script, address, str(spec)], cwd=tmp_path, env=env, capture_output=True,
                                   text=True, timeout=600)
            assert again.returncode == 0, again.stderr[-4000:]
        steps = 4 * 2  # tests/one_train_run.py: 4 steps per epoch, 2 epochs
        assert _steps(client, run_id, "train/loss") == Counter(range(steps)), _steps(client, run_id, "train/loss")
        assert _steps(client, run_id, "val/mean_nts") == Counter(range(2))
        print(f"gave up after the outage with {given_up.group(1)} values undelivered; the checkpoint kept "
              f"{max(len(k['metrics']) for k in kept)}; after the restart every step's train/loss arrived once")
    finally:
        stop_process_group(server)


def test_a_flush_during_an_outage_holds_training_for_seconds_not_minutes(monkeypatch):
    """Against a port nobody listens on and a server that accepts connections but never answers, with MLflow's
    default client retries (7, with backoff: minutes): each flush is one bounded attempt, and deliver gives up
    after its outage limit."""
    import socket

    from anchor_rm.mlflow_edge.writer import ATTEMPT_TIMEOUT_S

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts (the kernel does), never reads or answers
    try:
        for uri in (f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{silent.getsockname()[1]}"):
            writer = BufferedRunWriter(uri, "0" * 32, active=True, outage_seconds=3)
            writer.add({"train/loss": 1.0}, 0)
            started = time.monotonic()
            assert not writer.flush() and len(writer.pending) == 1
            assert time.monotonic() - started < ATTEMPT_TIMEOUT_S + 3, uri
            assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # restored after the attempt
            started = time.monotonic()
            with pytest.raises(TrackingUnavailable, match="1 metric values"):
                writer.deliver()
            assert time.monotonic() - started < 3 + ATTEMPT_TIMEOUT_S + 3, uri
    finally:
        silent.close()


@pytest.mark.parametrize("raw", ["ten", "0", "-5", "nan", "inf", ""])
def test_a_bad_outage_limit_is_refused_naming_the_variable(raw):
    with pytest.raises(ValueError, match=f"{OUTAGE_ENV} must be a number of seconds above 0, not {raw!r}"):
        outage_seconds_from_env({OUTAGE_ENV: raw})
    assert outage_seconds_from_env({}) == 600 and outage_seconds_from_env({OUTAGE_ENV: "2.5"}) == 2.5


# --- unwritable or full artifact location --------------------------------------------------------------


def _report():
    rows = [SplitResult("hh-helpful-base", "id", "test", 470, 60.0, 61.0, None, 0.0),
            SplitResult("pandalm", "ood", "test", 300, 50.0, 55.0, None, 0.0)]
    return build_report({"name": NAME, "student": "tiny-bert", "teacher": "tiny", "method": "anchor",
                         "hyperparameters": {}}, rows, selection_splits="val", figure_splits="test",
                        data_digests={"hh-helpful-base/id_test": "a" * 64, "pandalm/test": "b" * 64})


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _fill(path: Path) -> None:
    """Write until the file system says it is full."""
    with open(path / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == 28, exc  # ENOSPC


@pytest.fixture
def full_disk(tmp_path):
    """A 2 MB tmpfs, filled: the real 'No space left on device'. Needs root (mount); skipped otherwise."""
    mount = tmp_path / "small-disk"
    if not _mount_tmpfs(mount, "2m"):
        pytest.skip("mounting a small tmpfs needs root; the not-a-directory case covers the rest")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["not-a-directory", "disk-full"])
def test_unwritable_artifact_location_is_one_line_and_exit_2(tmp_path, case, request):
    """tune.py against a store whose artifact location cannot be written: it stops at the first artifact
    (the data stage), with one line naming the path and what the system said, and registers nothing."""
    if case == "not-a-directory":
        (tmp_path / "mlartifacts").write_text("a file where the artifact folder should be\n")
        artifacts = tmp_path / "mlartifacts"
    else:
        artifacts = request.getfixturevalue("full_disk") / "mlartifacts"
        artifacts.mkdir()
        _fill(artifacts.parent)
    db = tmp_path / "mlflow.db"
    store = f"sqlite:///{db}"
    client = MlflowClient(store, registry_uri=store)  # explicit: another test may have set a global registry
    client.create_experiment(SMOKE_NAME, artifact_location=artifacts.as_uri())
    result = run_pipeline("tune.py", "--preset", "smoke", "--tracking-uri", store, "--storage-path",
                          str(tmp_path / "ray"), cwd=tmp_path, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert str(artifacts) in lines[0], lines[0]
    assert ("Not a directory" if case == "not-a-directory" else "No space left on device") in lines[0], lines[0]
    assert client.search_model_versions(f"name = '{SMOKE_NAME}'") == []
    failed = client.search_runs([client.get_experiment_by_name(SMOKE_NAME).experiment_id])
    assert failed and all(r.info.status == "FAILED" for r in failed)  # the stage run says it failed


@pytest.mark.slow
def test_disk_full_while_logging_the_model_creates_no_version(tmp_path, full_disk, minilm_tokenizer,
                                                              restore_mlflow_uris):
    folder = tiny_model_folder(tmp_path / "model", minilm_tokenizer, max_length=48)  # ~4 MB of weights: more than the disk
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    mlflow.set_registry_uri(store)
    experiment = MlflowClient().create_experiment("disk-full", artifact_location=(full_disk / "art").as_uri())
    with pytest.raises(OSError) as err:
        with mlflow.start_run(experiment_id=experiment):
            registry.log_and_register(folder, _report(), NAME)
    assert "No space left on device" in str(err.value) or err.value.errno == 28
    assert MlflowClient().search_model_versions(f"name = '{NAME}'") == []


@pytest.mark.slow
def test_failure_after_the_version_exists_removes_it(tmp_path, minilm_tokenizer, restore_mlflow_uris, monkeypatch):
    folder = tiny_model_folder(tmp_path / "model", minilm_tokenizer, max_length=48)
    configure(f"sqlite:///{tmp_path / 'mlflow.db'}", "half-written")
    with mlflow.start_run():
        first = registry.log_and_register(folder, _report(), NAME)

    def refuse(self, name, alias, version):
        raise OSError(28, "No space left on device")  # the store fails between version and alias

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", refuse)
    with pytest.raises(OSError, match="No space left"):
        with mlflow.start_run():
            registry.log_and_register(folder, _report(), NAME)
    monkeypatch.undo()
    versions = MlflowClient().search_model_versions(f"name = '{NAME}'")
    assert [str(v.version) for v in versions] == [first.version]
    assert str(MlflowClient().get_model_version_by_alias(NAME, "challenger").version) == first.version


@pytest.mark.slow
def test_a_cleanup_that_cannot_reach_the_stopped_store_leaves_a_version_check_repair_removes(
        tmp_path, minilm_tokenizer, restore_mlflow_uris, monkeypatch, capsys):
    """The store goes away right after the version is created, before its description (a real `mlflow
    server`, stopped there), so the cleanup cannot delete the version: the error propagates, the log names the orphan and the
    repair; once the server is back, `promote.py --check` lists it and `--repair` removes it."""
    folder = tiny_model_folder(tmp_path / "model", minilm_tokenizer, max_length=48)
    port = free_port()
    server = start_mlflow_server(tmp_path, port)
    uri = f"http://127.0.0.1:{port}"
    try:
        configure(uri, "cleanup-outage")
        with mlflow.start_run():
            first = registry.log_and_register(folder, _report(), NAME)
        real_update = MlflowClient.update_model_version

        def store_goes_away(self, *args, **kwargs):  # the version exists; its description is next
            stop_process_group(server)
            return real_update(self, *args, **kwargs)

        monkeypatch.setattr(MlflowClient, "update_model_version", store_goes_away)
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the cleanup's one attempt, not minutes of retries
        # The project's logger, read directly. (This test once failed after other modules on the same worker:
        # the registry had stayed on an earlier test's SQLite store, so nothing failed to clean up; fixed in
        # store.connect.)
        records: list[logging.LogRecord] = []
        handler = logging.Handler(logging.ERROR)
        handler.emit = records.append
        logging.getLogger("anchor_rm").addHandler(handler)
        try:
            with pytest.raises(Exception) as raised:
                with mlflow.start_run():
                    registry.log_and_register(folder, _report(), NAME)
        finally:
            logging.getLogger("anchor_rm").removeHandler(handler)
        monkeypatch.undo()
        orphan = str(int(first.version) + 1)
        logged = "\n".join(r.getMessage() for r in records)
        assert f"could not remove the half-written version {NAME}/{orphan}" in logged, \
            logged[-2000:] + "".join(traceback.format_exception(raised.value))[-6000:]
        assert "promote.py --check --repair" in logged

        server = start_mlflow_server(tmp_path, port)  # back, same store
        code, out = _promote_check(uri, capsys)
        assert code == 1 and f"v{orphan}: missing" in out, out
        code, out = _promote_check(uri, capsys, "--repair")
        assert code == 0 and f"v{orphan}: missing" in out and "deleted" in out, out  # nothing half-made is left
        assert [str(v.version) for v in MlflowClient(uri).search_model_versions(f"name = '{NAME}'")] == [first.version]
        assert str(MlflowClient(uri).get_model_version_by_alias(NAME, "challenger").version) == first.version
        code, out = _promote_check(uri, capsys)
        assert code == 0, out
    finally:
        stop_process_group(server)


def test_a_trial_that_fails_is_marked_failed_with_its_error(tmp_path, restore_mlflow_uris):
    """What Tune's callback writes when a trial gives up, e.g. after the tracking server stayed away."""
    from ray.tune.error import TuneError

    from anchor_rm.evaluation.keys import PARENT_TAG, TRIAL_TAG
    from tuning.callbacks import MlflowTrialStatus

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store, registry_uri=store)
    experiment = client.create_experiment("failed-trial")
    parent = client.create_run(experiment).info.run_id
    run = client.create_run(experiment, tags={PARENT_TAG: parent, TRIAL_TAG: "abc_00001"}).info.run_id
    cause = (f"TrackingUnavailable: MLflow tracking server http://127.0.0.1:1 unreachable for over 600 s: "
             f"12 metric values of run {run} not delivered (connection refused)")

    class FailedTrial:  # the three attributes of ray.tune's Trial that the callback reads
        trial_id = "abc_00001"
        error_file = str(tmp_path / "error.txt")

        def get_error(self):
            return TuneError(f"Traceback (most recent call last):\n  File ...\n{cause}")

    MlflowTrialStatus(store, experiment, parent).on_trial_error(0, [], FailedTrial())
    closed = client.get_run(run)
    assert closed.info.status == "FAILED"
    assert closed.data.tags["anchor_rm.trial_outcome"] == f"failed: {cause} (full trace: {tmp_path / 'error.txt'})"


@pytest.mark.slow
def test_a_file_with_no_pair_left_after_filtering_is_one_line_naming_it(tmp_path, minilm_tokenizer):
    folder = tiny_model_folder(tmp_path / "model", minilm_tokenizer, max_length=48)
    data = tmp_path / "all-ties.jsonl"
    data.write_bytes(b'{"prompt": "p", "chosen": "same", "rejected": "same"}\n'
                     b'{"prompt": "q", "chosen": "  ", "rejected": "b"}\n'
                     b'{"prompt": "r", "chosen": "caf\xe9", "rejected": "b"}\n')  # not UTF-8: skipped
    result = run_pipeline("evaluate.py", "--model", str(folder), "--data", str(data), "--skip-invalid", "--no-log",
                          "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert str(data) in errors[0] and "no pair left after cleaning" in errors[0], errors[0]


def test_the_step_hook_is_loaded_from_its_file_and_bad_specs_are_named(tmp_path):
    from tuning.trainable import load_step_hook

    assert load_step_hook(None) is None and load_step_hook("") is None
    hook_file = tmp_path / "hooks.py"
    hook_file.write_text("calls = []\n\ndef record(step, rank, argument):\n    calls.append((step, rank, argument))\n"
                         "    raise RuntimeError(f'{step} {rank} {argument}')\n")
    hook = load_step_hook(f"{hook_file}:record:8:/tmp/x")
    with pytest.raises(RuntimeError, match="3 0 8:/tmp/x"):
        hook(3, 0)
    with pytest.raises(ValueError, match="no Python file"):
        load_step_hook(f"{tmp_path / 'missing.py'}:record")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_step_hook(f"{hook_file}:nope")


# A registration SIGKILLed right after MLflow created the version: before its description, run tag and alias.
KILLED_REGISTRATION = r'''
import os, signal, sys
import mlflow
from anchor_rm.mlflow_edge import registry
from anchor_rm.mlflow_edge.store import configure
from anchor_rm.evaluation.report import SplitResult, build_report

store, folder, key = sys.argv[1:4]
configure(store, "killed-registration")
register = mlflow.register_model

def register_then_die(*args, **kwargs):
    version = register(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)

mlflow.register_model = register_then_die
rows = [SplitResult("hh-helpful-base", "id", "test", 470, 60.0, 61.0, None, 0.0),
        SplitResult("pandalm", "ood", "test", 300, 50.0, 55.0, None, 0.0)]
report = build_report({"name": "x", "student": "tiny-bert", "teacher": "tiny", "method": "anchor", "hyperparameters": {}},
                      rows, selection_splits="val", figure_splits="test",
                      data_digests={"hh-helpful-base/id_test": "a" * 64, "pandalm/test": "b" * 64})
with mlflow.start_run():
    registry.log_and_register(folder, report, "anchor-rm-harmless", registration_key=key)
'''


@pytest.mark.slow
def _promote_check(store: str, capsys, *flags: str) -> tuple[int, str]:
    """pipelines/promote.py --check [flags] in this process (its main, as the command line runs it)."""
    from anchor_rm.cli import promote as promote_cli
    capsys.readouterr()
    code = promote_cli.main(["--check", *flags, "--tracking-uri", store])
    return code, capsys.readouterr().out


def test_a_registration_killed_after_the_version_exists_is_completed_not_repeated(tmp_path, minilm_tokenizer,
                                                                                     restore_mlflow_uris, capsys):
    """tune.py --resume after a SIGKILL between register_model and the version's description, tags and alias:
    the same registration key finds the version and completes it; promote.py --check sees the gap before."""
    folder = tiny_model_folder(tmp_path / "model", minilm_tokenizer, max_length=48)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    killed = subprocess.run([PYTHON, "-c", KILLED_REGISTRATION, store, str(folder), "tune-run:abc"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    client = MlflowClient(store, registry_uri=store)
    (half,) = client.search_model_versions(f"name = '{NAME}'")
    assert not half.description and "run_id" not in half.tags and half.tags["anchor_rm.registration_key"] == "tune-run:abc"

    code, out = _promote_check(store, capsys)
    assert code == 1 and "v1: missing the run_id tag, the description" in out, out

    configure(store, "killed-registration")
    with mlflow.start_run():
        again = registry.log_and_register(folder, _report(), NAME, registration_key="tune-run:abc")
    versions = client.search_model_versions(f"name = '{NAME}'")
    assert again.version == "1" and [str(v.version) for v in versions] == ["1"]  # completed, not registered twice
    assert versions[0].description and versions[0].tags["run_id"] == half.run_id
    assert str(client.get_model_version_by_alias(NAME, "challenger").version) == "1"
    code, out = _promote_check(store, capsys)
    assert code == 0 and "every version is complete" in out, out
    with mlflow.start_run():  # another key: a new version
        assert registry.log_and_register(folder, _report(), NAME, registration_key="tune-run:def").version == "2"


def test_check_repair_removes_half_made_versions_but_not_one_an_alias_names(tmp_path, minilm_tokenizer,
                                                                            restore_mlflow_uris, capsys):
    folder = tiny_model_folder(tmp_path / "model", minilm_tokenizer, max_length=48)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    configure(store, "repair")
    with mlflow.start_run():
        complete = registry.log_and_register(folder, _report(), NAME)
    with mlflow.start_run() as run:  # two bare versions: what a cleanup that could not reach the store leaves
        mlflow.log_artifacts(str(folder), "model")
        bare = [str(MlflowClient().create_model_version(NAME, f"{run.info.artifact_uri}/model", run_id=run.info.run_id).version)
                for _ in range(2)]
    MlflowClient().set_registered_model_alias(NAME, "champion", bare[1])
    code, out = _promote_check(store, capsys, "--repair")
    assert code == 1, out
    assert f"v{bare[0]}: missing" in out and "deleted" in out
    assert f"v{bare[1]}: missing" in out and "kept: alias champion names it" in out
    left = sorted(str(v.version) for v in MlflowClient().search_model_versions(f"name = '{NAME}'"))
    assert left == sorted([complete.version, bare[1]])
