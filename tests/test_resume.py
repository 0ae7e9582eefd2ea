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
