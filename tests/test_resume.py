"""An interrupted search resumes from wherever its driver died.

One tune run (smoke preset, 2 baselines + 1 ANCHOR sample) on a `ray start` head and an `mlflow server`; its
driver is SIGKILLed, then resumed with `tune.py --resume`, once at each point where a user's run can die:
1. while a trial is being created (Tune has started it; nothing trained or reported yet);
2. in a trial's first epoch (its workers train; no checkpoint, no result yet: the trial's folder has no
   result.json, which once made the resumed search fail with a traceback);
3. mid-epoch after a checkpoint (a worker holds at a step after its epoch's checkpoint; the test kills the
   driver);
4. between trials (Tune has recorded a finished trial; the next has not started);
5. during the final evaluation (one model scored on the test splits);
6. during registration (the registry created the version; no description, tags or alias yet).
The seventh driver finishes. Every driver that died said nothing past its last progress line (no traceback);
the experiment ends with one registered version; every trial ran once to the end, in one MLflow run, each step
logged once or explained by a restart from a checkpoint.

The points are reached by events, never by time: the driver kills itself there (tests/kill_points/
sitecustomize.py), or the worker's step hook says it holds (tests/fault_hooks.py: hold_at).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers import (PYTHON, ROOT, assert_history_explained, cluster_state, free_port, ray_head, run_pipeline,
                     start_mlflow_server, stop_process_group)
from tuning.trainable import STEP_HOOK_ENV

NAME = "anchor-rm-helpful"
# smoke: 48 pairs, batch 8 -> 6 steps per epoch. The worker holds at one of these steps, and the test kills the
# driver: step 2 is in epoch 0 (no checkpoint yet), step 8 mid-way through epoch 1.
HOLD_STEPS = {"first-epoch": 2, "mid-epoch": 8}
# What the driver has logged before the test kills it, where the point needs it: mid-epoch 1, the driver has
# had epoch 0's result. The worker holds once Ray Train's controller has collected epoch 0's checkpoint; the
# result reaches Tune's driver after that, and on a fast CPU (M1, 2026-12-06) the driver was once killed
# before it had logged it.
DRIVER_SAW = {"mid-epoch": r"trial \w+ epoch 0:"}
POINTS = ("trial-start", "first-epoch", "mid-epoch", "trial-complete", "final-evaluation", "registration")
TIMEOUT_S = 2400  # a hang guard


def _driver(args: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen([PYTHON, str(ROOT / "pipelines" / "tune.py"), *args], cwd=log_path.parent, env=env,
                                stdout=log, stderr=subprocess.STDOUT)


def _kill_at(point: str, args: list[str], env: dict, tmp_path: Path, address: str, deadline: float) -> str:
    """Runs one driver until it dies at `point`; returns its log."""
    marker = tmp_path / f"killed-at-{point}"
    log_path = tmp_path / f"driver-{point}.log"
    if point in HOLD_STEPS:  # the worker holds; the driver is killed from here
        held = tmp_path / f"held-{point}"
        hook = f"{Path(__file__).parent / 'fault_hooks.py'}:hold_at:{HOLD_STEPS[point]}:{held}"
        driver = _driver(args, {**env, STEP_HOOK_ENV: hook}, log_path)
        while not held.exists() and driver.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        while point in DRIVER_SAW and not re.search(DRIVER_SAW[point], log_path.read_text()) \
                and driver.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        if held.exists():
            driver.send_signal(signal.SIGKILL)
            marker.touch()
    else:
        driver = _driver(args, {**env, "ANCHOR_RM_TEST_KILL_AT": f"{point}:{marker}"}, log_path)
    try:
        returncode = driver.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        driver.kill()
        pytest.fail(f"the driver to be killed at {point} did not get there:\n{cluster_state(address)}\n"
                    + log_path.read_text()[-4000:])
    out = log_path.read_text()
    assert returncode == -signal.SIGKILL and marker.exists(), (point, returncode, out[-5000:])
    assert "Traceback" not in out and "registered:" not in out, (point, out[-5000:])
    return out


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_a_driver_killed_at_each_point_resumes_to_one_registered_version(tmp_path):
    deadline = time.time() + TIMEOUT_S - 180  # what is left but three minutes, to say what a stuck run waits for
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(tmp_path, port)
    try:
        with ray_head(tmp_path) as address:
            args = ["--preset", "smoke", "--num-samples", "1", "--ray-address", address, "--tracking-uri", uri,
                    "--storage-path", str(tmp_path / "ray"), "--name", "kills"]
            env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
            env.update({"HF_HUB_OFFLINE": "1",
                        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent / "kill_points"),
                                                                     os.environ.get("PYTHONPATH")]))})
            logs = {}
            for i, point in enumerate(POINTS):
                started = time.time()
                logs[point] = _kill_at(point, args + (["--resume"] if i else []), env, tmp_path, address, deadline)
                print(f"driver {i + 1} SIGKILLed at {point} after {time.time() - started:.0f} s")
            finished = run_pipeline("tune.py", *args, "--resume", cwd=tmp_path, env=env,
                                    timeout=max(60, int(deadline - time.time())))
        out = finished.stdout + finished.stderr
        assert finished.returncode == 0 and f"registered: models:/{NAME}/1 (alias challenger)" in out, out[-5000:]
        assert "Traceback" not in out, out[-5000:]

        # What each driver was doing when it died.
        first = re.search(r"trial (\w+) started", logs["trial-start"]).group(1)
        assert not re.search(r"trial \w+ epoch", logs["trial-start"]), logs["trial-start"][-3000:]
        assert f"trial {first} started" in logs["first-epoch"] and not re.search(r"trial \w+ epoch", logs["first-epoch"])
        assert f"trial {first} started" in logs["mid-epoch"] and f"trial {first} epoch 0:" in logs["mid-epoch"]
        assert f"trial {first} epoch 1:" not in logs["mid-epoch"], logs["mid-epoch"][-3000:]
        assert f"trial {first} finished" in logs["trial-complete"], logs["trial-complete"][-3000:]
        for point in ("final-evaluation", "registration"):
            assert "selected {" in logs[point] and f"trial {first} epoch" not in logs[point], logs[point][-3000:]
        assert not re.search(r"trial \w+ epoch", logs["registration"] + out)  # nothing trains after the search
        assert "the final evaluation of an earlier driver of this experiment" in out

        client = MlflowClient(uri, registry_uri=uri)
        assert [str(v.version) for v in client.search_model_versions(f"name = '{NAME}'")] == ["1"]
        version = client.get_model_version_by_alias(NAME, "challenger")
        assert version.description and "mean_nts" in version.tags
        # the report states how the winner was chosen, among naive W2S and the one ANCHOR trial
        report = json.loads(Path(client.download_artifacts(version.run_id, "report/report.json", str(tmp_path))).read_text())
        selection = report["selection"]
        assert selection["candidates"] == 2 and "a tie (equal to 1e-6 points) goes to" in selection["rule"], selection
        assert selection["selected"]["method"] in ("naive", "anchor") and selection["naive_val_mean_nts"] is not None
        exp = client.get_experiment_by_name(NAME)
        (parent,) = client.search_runs([exp.experiment_id], "tags.`anchor_rm.stage` = 'tune'")
        assert parent.data.tags["anchor_rm.trials"] == "3" and parent.data.tags["anchor_rm.trials_failed"] == "0"
        finals = client.search_runs([exp.experiment_id], "tags.`anchor_rm.stage` = 'final'")
        assert [f.info.run_id for f in finals] == [version.run_id]
        trials = client.search_runs([exp.experiment_id], "tags.`anchor_rm.stage` = 'trial'")
        ids = sorted(t.data.tags["anchor_rm.trial_id"] for t in trials)
        assert len(ids) == 3 and len(set(ids)) == 3 and first in ids, ids
        assert all(t.info.status == "FINISHED" for t in trials), [(t.data.tags["anchor_rm.trial_id"], t.info.status) for t in trials]
        for trial in trials:
            markers = assert_history_explained(client, trial.info.run_id, steps_per_epoch=6, epochs=2)
            if trial.data.tags["anchor_rm.trial_id"] == first:
                # Held mid-epoch 1, then resumed from epoch 0's checkpoint (the marker at step 6). When the kill
                # between trials came before Tune saved its state (every second), the finished trial is resumed
                # once more, from epoch 1's checkpoint, with nothing left to train: the tag then says 1.
                assert markers == [6] and trial.data.tags["anchor_rm.resumed_from_epoch"] in ("0", "1"), trial.data.tags
            else:
                assert markers == [], (trial.data.tags["anchor_rm.trial_id"], markers)
    finally:
        stop_process_group(server)


# ---------------------------------------------------------------------------------------------------
# A placement group left by a killed driver (tuning/orphans.py).

def _group(pg_id: str, job: str, state: str = "CREATED", detached: bool = False):
    from tuning.orphans import PlacementGroupRecord

    return PlacementGroupRecord(pg_id, job, state, detached, {"CPU": 1.0})


@pytest.mark.timeout(60)
def test_only_live_attached_groups_of_an_ended_earlier_driver_are_orphans():
    from tuning.orphans import orphans

    earlier = {("01000000", 100), ("02000000", 200), ("03000000", 300)}  # 03 is this driver, still running
    ended = {("01000000", 100), ("02000000", 200), ("04000000", 400), ("05000000", 999)}
    groups = [_group("a", "02000000"), _group("b", "02000000", "PENDING"), _group("c", "02000000", "REMOVED"),
              _group("d", "02000000", detached=True), _group("e", "03000000"), _group("f", "04000000"),
              _group("g", "01000000", "RESCHEDULING")]
    assert [g.placement_group_id for g in orphans(groups, earlier, ended)] == ["a", "b", "g"]
    # a job id handed out again by a restarted cluster (another start time) is not an earlier driver
    assert orphans([_group("h", "05000000")], {("05000000", 500)}, ended) == []


@pytest.mark.timeout(60)
def test_drivers_file_skips_a_line_cut_by_a_kill(tmp_path):
    from tuning.orphans import DRIVERS_FILE, append_record, earlier_drivers

    assert earlier_drivers(tmp_path) == set()
    (tmp_path / DRIVERS_FILE).write_text('{"job_id": "01000000", "start_time": 5}\n{"job_id": "02000')
    assert earlier_drivers(tmp_path) == {("01000000", 5)}
    append_record(tmp_path / DRIVERS_FILE, {"job_id": "03000000", "start_time": 7})  # the next driver's record
    assert earlier_drivers(tmp_path) == {("01000000", 5), ("03000000", 7)}
    append_record(tmp_path / DRIVERS_FILE, {"job_id": "04000000", "start_time": 9})  # after a whole line: one line
    assert (tmp_path / DRIVERS_FILE).read_text().splitlines()[-2:] == ['{"job_id": "03000000", "start_time": 7}',
                                                                        '{"job_id": "04000000", "start_time": 9}']


_MAKER = """
import logging, sys, ray
from pathlib import Path
ray.init(address=sys.argv[1], namespace="orphans", log_to_driver=False)
logging.basicConfig(level=logging.INFO)
if sys.argv[3] != "-":
    from tuning.orphans import record_driver
    record_driver(Path(sys.argv[3]))

@ray.remote(num_cpus=0)
class Maker:
    def make(self, cpus, detached):
        from ray.util.placement_group import placement_group
        pg = placement_group([{"CPU": cpus}], lifetime="detached" if detached else None)
        ray.get(pg.ready(), timeout=120)
        return pg.id.hex()

    def ping(self):
        return True

Maker.options(name=sys.argv[2], lifetime="detached").remote()
assert ray.get(ray.get_actor(sys.argv[2]).ping.remote())  # started, before this job ends
"""

_SWEEP = """
import json, logging, sys, time, ray
logging.basicConfig(level=logging.INFO)
from pathlib import Path
ray.init(address=sys.argv[1], namespace="orphans", log_to_driver=False)
from ray.util.placement_group import placement_group
from ray.util.state import list_placement_groups
from tuning.orphans import record_driver, release_orphaned_placement_groups

exp = Path(sys.argv[2])
ours, others = ray.get_actor("earlier-driver"), ray.get_actor("other-job")
groups = {
    # created for jobs that have ended, after they ended: what a dying Train controller leaves
    "orphan": ray.get(ours.make.remote(1.0, False)),
    "detached": ray.get(ours.make.remote(0.25, True)),
    "other_job": ray.get(others.make.remote(0.25, False)),
}
mine = placement_group([{"CPU": 0.25}])
ray.get(mine.ready(), timeout=120)
groups["this_driver"] = mine.id.hex()
free_before = ray.available_resources().get("CPU", 0.0)
record_driver(exp)
released = release_orphaned_placement_groups(exp)
states = {p.placement_group_id: str(getattr(p.state, "value", p.state)) for p in list_placement_groups(address=sys.argv[1], limit=10000)}
deadline = time.monotonic() + 120  # the nodes report freed resources on their own time
while ray.available_resources().get("CPU", 0.0) < free_before + 1.0 and time.monotonic() < deadline:
    time.sleep(0.2)
print(json.dumps({"groups": groups, "released": released, "states": {k: states[v] for k, v in groups.items()},
                  "free_before": free_before, "free_after": ray.available_resources().get("CPU", 0.0)}))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_releases_a_group_left_by_an_ended_driver_of_the_experiment_and_nothing_else(tmp_path):
    """On a real `ray start` head: an earlier driver of the experiment (recorded in drivers.jsonl) and another
    job, both ended, each leave a live non-detached placement group (made by their detached actors after the
    jobs ended: the state a killed driver's Train controller leaves). The next driver releases the first and
    its CPU comes back; the other job's group, a detached group and its own stay."""
    exp = tmp_path / "experiment"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with ray_head(tmp_path, num_cpus=2) as address:
        env.update({k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")})
        for name, record in (("earlier-driver", str(exp)), ("other-job", "-")):
            done = subprocess.run([PYTHON, "-c", _MAKER, address, name, record], env=env, capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0 and "cannot record" not in done.stderr, done.stderr[-3000:]
        assert len((exp / "drivers.jsonl").read_text().splitlines()) == 1
        done = subprocess.run([PYTHON, "-c", _SWEEP, address, str(exp)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["released"] == [out["groups"]["orphan"]], out
    assert out["states"] == {"orphan": "REMOVED", "detached": "CREATED", "other_job": "CREATED",
                             "this_driver": "CREATED"}, out
    assert out["free_after"] == pytest.approx(out["free_before"] + 1.0), out
    assert "released placement group " + out["groups"]["orphan"] in done.stderr, done.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------
# Tune's state files, written whole or not at all (tuning/storage.py).

_KILLED_WRITER = """
import os, sys
from tuning.storage import experiment_filesystem
with experiment_filesystem().open_output_stream(sys.argv[1]) as f:
    f.write(b'{"half": ')
    f.flush()
    os.kill(os.getpid(), 9)  # the driver dies in the middle of the copy
"""


@pytest.mark.timeout(120)
def test_a_writer_killed_mid_file_leaves_the_previous_file_whole(tmp_path):
    import pyarrow.fs as pafs

    from tuning.storage import experiment_filesystem

    staging, storage = tmp_path / "staging", tmp_path / "storage"
    (staging / "trial").mkdir(parents=True)
    (staging / "experiment_state-1.json").write_text('{"trials": 2}')
    (staging / "trial" / "result.json").write_text("x" * 300_000)
    pafs.copy_files(str(staging), str(storage), destination_filesystem=experiment_filesystem())  # as Tune syncs
    assert (storage / "experiment_state-1.json").read_text() == '{"trials": 2}'
    assert (storage / "trial" / "result.json").read_text() == "x" * 300_000

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    killed = subprocess.run([PYTHON, "-c", _KILLED_WRITER, str(storage / "experiment_state-1.json")], env=env,
                            capture_output=True, text=True, timeout=100)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (storage / "experiment_state-1.json").read_text() == '{"trials": 2}'  # not cut short
    leftovers = [p.name for p in storage.iterdir() if p.name.endswith(".partial")]
    assert len(leftovers) == 1 and leftovers[0].startswith("."), leftovers  # hidden: no Tune pattern matches it


def test_a_write_that_fails_leaves_the_previous_file_and_no_partial_one(tmp_path, monkeypatch):
    """A full disk refuses a write (or the close's flush): the old file stays whole, no temporary file is left."""
    import pyarrow.fs as pafs

    from tuning import storage

    fs = storage.experiment_filesystem()
    target = tmp_path / "tuner.pkl"
    target.write_bytes(b"the good one")
    (tmp_path / "src").write_bytes(b"x" * (3 << 20))

    class FullDisk:  # the temporary file, on a disk that takes no more bytes
        def __init__(self, file):
            self.file = file

        def write(self, data):
            raise OSError(28, "No space left on device")

        def close(self):
            self.file.close()

    made = storage._ReplaceOnClose.__init__

    def on_a_full_disk(self, path):
        made(self, path)
        self._file = FullDisk(self._file)

    monkeypatch.setattr(storage._ReplaceOnClose, "__init__", on_a_full_disk)
    with pytest.raises(OSError, match="No space left"):
        with fs.open_output_stream(str(target)) as out:
            out.write(b"half of the new one")
    with pytest.raises(OSError, match="No space left"):
        fs.copy_file(str(tmp_path / "src"), str(target))
    assert target.read_bytes() == b"the good one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "tuner.pkl"]
    monkeypatch.undo()
    with fs.open_output_stream(str(target)) as out:  # and a write that succeeds replaces it whole
        out.write(b"the new one")
    assert target.read_bytes() == b"the new one" and isinstance(fs, pafs.FileSystem)
