"""The main job end to end on real components, through the faults it must survive: `ray start --head`,
`mlflow server`, tune.py, promote.py, and the champion loaded back through `models:/NAME@champion`.

One tune run (smoke preset: 48 pairs, 2 epochs, 2 baselines + 2 ANCHOR samples) carries every case, so the
suite pays for the shared stages and the trials once:
- a Ray Train worker SIGKILLed mid-epoch: the trial restarts from its last checkpoint;
- the tune driver SIGKILLed after its first trial: `tune.py --resume` finishes the rest, nothing is redone or
  duplicated, the registry gets exactly one version;
- the tracking server down while a resumed trial trains its next epoch: training goes on (under 5 s of it spent
  waiting for the server, measured by the worker) and every metric value still arrives, once;
- the ANCHOR trials reading the frozen reference's states from the disk cache (`--reference-cache disk`);
- a trial that raises inside its worker on every attempt: FAILED in MLflow through Tune itself, counted on
  the tune run, and the search selects among the others;
- the resumed driver SIGKILLed right after the registry created the version: the next `--resume` trains
  nothing and completes that version (one version, one final-evaluation run);
- promotion and loading of the champion; a further `--resume` of the finished experiment redoes nothing (no
  trial trains again: every trial's metric history and checkpoints are as they were).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from helpers import (PYTHON, ROOT, assert_history_explained, cluster_state, free_port, metric_steps, ray_head,
                     run_pipeline, start_mlflow_server, stop_process_group)
from tuning.trainable import STEP_HOOK_ENV

NAME = "anchor-rm-helpful"
KILL_STEP = 8  # smoke: 48 pairs, batch 8 -> 6 steps per epoch; step 8 is mid-way through epoch 1
FAILING_RUN = 4  # the 4th Train run to take a step: the second ANCHOR sample (concurrency 1)


def _wait_for_line(path: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.time() + timeout
    while time.time() < deadline:
        match = re.search(pattern, path.read_text(errors="replace"))
        if match:
            return match
        if proc.poll() is not None:
            raise AssertionError(f"tune.py exited with {proc.returncode} first:\n{path.read_text()[-4000:]}")
        time.sleep(1)
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{path.read_text()[-4000:]}")


def _wait_for_saved_state(experiment: Path, trial_id: str, status: str, proc: subprocess.Popen,
                          timeout: float = 600) -> None:
    """Until Tune's saved experiment state (experiment_state-*.json under `experiment`) gives the trial `status`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for path in experiment.glob("*/experiment_state-*.json"):
            try:
                trials = [json.loads(row[0]) for row in json.loads(path.read_text())["trial_data"]]
            except (OSError, ValueError, KeyError, IndexError):  # being written
                continue
            if any(t.get("trial_id") == trial_id and t.get("status") == status for t in trials):
                return
        if proc.poll() is not None:
            raise AssertionError(f"tune.py exited with {proc.returncode} before Tune saved trial {trial_id} {status}")
        time.sleep(0.2)
    raise AssertionError(f"Tune did not save trial {trial_id} as {status} under {experiment} within {timeout} s")


def _start_tune(args: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:  # stdout and stderr in one file, read while it runs
        return subprocess.Popen([PYTHON, str(ROOT / "pipelines" / "tune.py"), *args], cwd=log_path.parent, env=env,
                                stdout=log, stderr=subprocess.STDOUT)


def _histories(client: MlflowClient, trials) -> dict[str, list]:
    return {t.info.run_id: sorted((m.step, m.timestamp) for m in client.get_metric_history(t.info.run_id, "train/loss"))
            for t in trials}


def _checkpoints(storage: Path) -> dict[str, float]:
    return {str(p.relative_to(storage)): p.stat().st_mtime for p in storage.rglob("checkpoint_*") if p.is_dir()}


@pytest.mark.slow
# A hang guard, not a speed target: on 2 AVX2-only cores beside the rest of the suite this test took 1,141 to
# 1,520 s (1,156 s with the 64-token smoke preset, 868 s once the suite's servers ran without MLflow's job
# processes; docs/benchmarks.md, Test suite), and 1,500 s once cut it off while it still made progress.
@pytest.mark.timeout(2400)
def test_tune_through_a_killed_worker_a_killed_driver_an_outage_and_a_failing_trial_then_promote_and_load(tmp_path):
    import mlflow

    marker, seen = tmp_path / "worker-killed", tmp_path / "train-runs.txt"
    env = {STEP_HOOK_ENV: f"{Path(__file__).parent / 'fault_hooks.py'}:kill_once_at_then_fail_nth_run:"
                          f"{KILL_STEP}:{marker}:{FAILING_RUN}:{seen}"}
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(tmp_path, port)
    try:
        with ray_head(tmp_path) as address:
            # --max-failures 1: the killed worker is restarted once; the failing trial tries 2 x 2 times, not 3 x 2.
            # --reference-cache disk: the ANCHOR trials read the frozen reference's states from memory-mapped files.
            args = ["--preset", "smoke", "--max-failures", "1", "--reference-cache", "disk", "--ray-address", address,
                    "--tracking-uri", uri, "--storage-path", str(tmp_path / "ray"), "--name", "faults"]
            full_env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
            full_env.update({"HF_HUB_OFFLINE": "1", **env})

            # 1. A worker dies mid-epoch (the hook), then the driver after its first trial finished.
            log_path = tmp_path / "tune-first.log"
            started = time.time()
            driver = _start_tune(args, full_env, log_path)
            try:
                finished = _wait_for_line(log_path, r"trial (\w+) finished", driver, timeout=900)
                # Tune saves which trials finished every second (tuning/search.py); once it has, the driver dies.
                _wait_for_saved_state(tmp_path / "ray" / "faults", finished.group(1), "TERMINATED", driver)
                driver.send_signal(signal.SIGKILL)
                driver.wait(timeout=60)
            finally:
                if driver.poll() is None:
                    driver.kill()
            first_trial = finished.group(1)
            first_log = log_path.read_text()
            print(f"first driver: trial {first_trial} finished, driver SIGKILLed {time.time() - started:.0f} s after start")
            assert marker.exists(), "the fault hook never fired:\n" + first_log[-3000:]
            assert "registered:" not in first_log

            # 2. --resume, and while its next trial trains, the tracking server goes away until that trial has
            # trained its next epoch (an event: an epoch takes seconds on one CPU and minutes on another);
            # at the end this driver is SIGKILLed right after the registry created the version, before its
            # description, tags and alias (tests/kill_points/sitecustomize.py).
            resumed_at = time.time()
            resumed_path = tmp_path / "tune-resumed.log"
            killed_marker = tmp_path / "killed-at-registration"
            kill_env = {**full_env, "ANCHOR_RM_TEST_KILL_AT": f"registration:{killed_marker}",
                        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent / "kill_points"),
                                                                     os.environ.get("PYTHONPATH")]))}
            driver = _start_tune([*args, "--resume"], kill_env, resumed_path)
            try:
                running = _wait_for_line(resumed_path, r"trial (\w+) epoch 0:", driver, timeout=900).group(1)
                stop_process_group(server)
                down_at = time.time()
                _wait_for_line(resumed_path, rf"trial {running} epoch 1:", driver, timeout=900)
                outage_s = time.time() - down_at
                before_restart = resumed_path.read_text()
                server = start_mlflow_server(tmp_path, port)  # back, same port, same store
                try:
                    returncode = driver.wait(timeout=1200)
                except subprocess.TimeoutExpired:  # what the run waits for; Ray's logs stay in tmp_path/ray-head-logs
                    pytest.fail("tune.py --resume did not finish:\n" + cluster_state(address) + "\n"
                                + resumed_path.read_text()[-4000:])
            finally:
                if driver.poll() is None:
                    driver.kill()
            resumed = resumed_path.read_text()
            print(f"tune.py --resume SIGKILLed at registration {time.time() - resumed_at:.0f} s after start; tracking "
                  f"server down {outage_s:.0f} s from trial {running}'s epoch 0 on")
            assert returncode == -signal.SIGKILL and killed_marker.exists(), (returncode, resumed[-5000:])
            # the trial trained its next epoch while its metrics could not be delivered
            assert f"trial {running} epoch 1:" in before_restart, before_restart[-3000:]
            # the trial that finished before the driver died is not run again
            assert f"trial {first_trial} epoch" not in resumed, resumed[-3000:]
            assert f"trial {first_trial} epoch 1" in first_log
            assert "1 of 4 trials failed; selecting among the others" in resumed, resumed[-5000:]
            assert re.search(r"reference cache: layers \[3, 5, 6\] on \d+ sequences, .*: disk", first_log), first_log[-3000:]
            assert (tmp_path / "ray" / "faults" / "reference_cache" / "index.json").exists()
            assert "registered:" not in resumed
            client = MlflowClient(uri, registry_uri=uri)
            (half,) = client.search_model_versions(f"name = '{NAME}'")  # created, then the driver died
            assert str(half.version) == "1" and not half.description and "run_id" not in half.tags, half

            # 2b. --resume again: nothing trains, the final evaluation is done again in its run, and the version
            # the killed driver created is completed, not registered a second time.
            completing = run_pipeline("tune.py", *args, "--resume", cwd=tmp_path, env=env, timeout=900)
            assert completing.returncode == 0, completing.stderr[-5000:]
            completed = completing.stdout + completing.stderr
            assert not re.search(r"trial \w+ epoch", completed), completed[-3000:]
            assert "the final evaluation of an earlier driver of this experiment" in completed, completed[-3000:]
            assert f"registered: models:/{NAME}/1 (alias challenger)" in completed, completed[-3000:]
            assert re.search(r"\| naive W2S( \(selected\))? \|", completed) and "| confidence W2S |" in completed
            assert [str(v.version) for v in client.search_model_versions(f"name = '{NAME}'")] == ["1"]
            exp = client.get_experiment_by_name(NAME)
            parents = client.search_runs([exp.experiment_id], "tags.`anchor_rm.stage` = 'tune'")
            assert len(parents) == 1
            parent = parents[0]
            assert parent.data.tags["anchor_rm.trials"] == "4" and parent.data.tags["anchor_rm.trials_failed"] == "1"
            children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
            trials = [c for c in children if c.data.tags.get("anchor_rm.stage") == "trial"]
            trial_ids = [t.data.tags["anchor_rm.trial_id"] for t in trials]
            assert len(trials) == 4 and len(set(trial_ids)) == 4, trial_ids  # 2 baselines + 2 samples, no duplicate

            # 3. The failing trial: FAILED, with its error; the other three FINISHED, their every step explained.
            failed = [t for t in trials if t.info.status == "FAILED"]
            assert len(failed) == 1, [(t.data.tags["anchor_rm.trial_id"], t.info.status) for t in trials]
            assert "injected failure in train-" in failed[0].data.tags["anchor_rm.trial_outcome"], failed[0].data.tags
            assert failed[0].data.tags["anchor_rm.method"] == "anchor"
            assert f"trial {failed[0].data.tags['anchor_rm.trial_id']} failed: " in resumed, resumed[-5000:]
            done = [t for t in trials if t is not failed[0]]
            assert all(t.info.status == "FINISHED" for t in done), [(t.info.run_id, t.info.status) for t in done]
            restarted = [t for t in done if "anchor_rm.resumed_from_epoch" in t.data.tags]
            assert [t.data.tags["anchor_rm.trial_id"] for t in restarted] == [first_trial]
            assert restarted[0].data.tags["anchor_rm.resumed_from_epoch"] == "0"
            for trial in done:
                assert trial.data.tags["anchor_rm.teacher_run"] and "train.method" in trial.data.params
                markers = assert_history_explained(client, trial.info.run_id, steps_per_epoch=6, epochs=2)
                loss_steps = metric_steps(client, trial.info.run_id, "train/loss")
                print(f"trial {trial.data.tags['anchor_rm.trial_id']}: train/loss steps {min(loss_steps)}..{max(loss_steps)}, "
                      f"logged twice: {sorted(k for k, v in loss_steps.items() if v > 1)}, resume markers at {markers}, "
                      f"outcome {trial.data.tags.get('anchor_rm.trial_outcome')}")
                if trial.data.tags["anchor_rm.trial_id"] == running:  # trained through the outage
                    blocked = [m.value for m in client.get_metric_history(trial.info.run_id, "worker/tracking_blocked_s")]
                    print(f"trial {running}: training waited {max(blocked):.2f} s for the tracking server "
                          f"during its {outage_s:.0f} s outage (worker/tracking_blocked_s {blocked})")
                    assert len(blocked) == 2 and max(blocked) < 5, blocked
                if trial in restarted:
                    assert markers == [6]
                    assert max(loss_steps) == 11  # it finished epoch 1

            anchor_done = [t for t in done if t.data.tags["anchor_rm.method"] == "anchor"]
            # the one ANCHOR trial that finished, or naive W2S: the winner on validation (tuning/search.py)
            selected = re.search(r"selected \{'method': '(\w+)', 'anchor_lambda': ([^,]+),", completed)
            assert len(anchor_done) == 1 and selected and selected.group(1) in ("anchor", "naive"), completed[-5000:]
            if selected.group(1) == "anchor":
                assert float(selected.group(2)) == float(anchor_done[0].data.params["train.anchor_lambda"])

            # 4. The registered version: selected among the finished trials, on validation, with its report.
            version = client.get_model_version_by_alias(NAME, "challenger")
            for tag in ("mean_nts", "wrg", "id_accuracy", "test_splits_digest", "selection_splits", "val_mean_nts",
                        "validation_splits_digest"):
                assert tag in version.tags, tag
            assert version.tags["selection_splits"] == "val" and version.tags["figure_splits"] == "test"
            assert "Selected on val splits" in version.description
            final = [c for c in children if c.data.tags.get("anchor_rm.stage") == "final"]
            assert len(final) == 1 and final[0].info.run_id == version.run_id
            names = {a.path.split("/")[-1] for a in client.list_artifacts(version.run_id, "report")}
            assert {"report.json", "report.md", "report.png", "comparison.md", "nts_vs_lambda.png", "trials.json"} <= names
            # Its OOD flag: fitted on student-train, measured on every test split against ID test.
            report = json.loads(Path(client.download_artifacts(version.run_id, "report/report.json", str(tmp_path))).read_text())
            flag = report["ood_flag"]
            assert flag["fit_split"] == "student_train" and flag["threshold_split"].endswith("/val")
            assert [r["dataset"] for r in flag["sets"]] == [row["dataset"] for row in report["splits"]]
            assert flag["sets"][0]["auroc"] is None and all(0 <= r["auroc"] <= 1 for r in flag["sets"][1:])
            # Lambda in drift terms: the range calibrated for the student (the tune run's tag, read back on --resume),
            # every finished trial's last-layer drift on the probe, naive W2S's the yardstick.
            lam = report["selection"]["lambda_range"]
            assert lam["method"] == "calibrated" and set(lam["ranges"]) == {"last", "middle"}, lam
            assert json.loads(parent.data.tags["anchor_rm.lambda_range"]) == lam
            rows = report["selection"]["drift"]["trials"]
            assert len(rows) == 3 and all(r["drift_last"] > 0 for r in rows), rows
            assert [r["drift_reduction"] for r in rows if r["method"] == "naive"] == [0.0]
            (anchored,) = [r for r in rows if r["method"] == "anchor"]
            low, high = lam["ranges"][anchored["anchor_layers"]]
            assert low <= anchored["anchor_lambda"] <= high and anchored["anchor_loss_end"] > 0, anchored
            report_md = Path(client.download_artifacts(version.run_id, "report/report.md", str(tmp_path))).read_text()
            assert "naive W2S's drift removed" in report_md and "calibrated for the student" in report_md

            # 5. Promote (smoke models learn from 48 pairs: the ID gate is the promotion tests' business) and load.
            promoted = run_pipeline("promote.py", "--name", NAME, "--max-id-drop", "100", "--tracking-uri", uri,
                                    cwd=tmp_path, timeout=300)
            assert promoted.returncode == 0, promoted.stdout + promoted.stderr
            assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"
            mlflow.set_tracking_uri(uri)
            mlflow.set_registry_uri(uri)  # an earlier test may have set another registry in this process
            model = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")
            frame = pd.DataFrame({"prompt": ["How do I bake bread?"] * 2,
                                  "response": ["Mix flour, water, yeast and salt, let it rise, then bake.", "No."]})
            scored = model.predict(frame)
            assert list(scored.columns) == ["reward", "truncated", "ood_score", "in_domain"] and len(scored) == 2
            assert scored["reward"].notna().all()

            # 6. --resume of the finished experiment redoes nothing: no trial trains (metric histories and
            # checkpoints untouched, the failed one not retried), no run or version is added.
            histories, checkpoints = _histories(client, trials), _checkpoints(tmp_path / "ray")
            assert checkpoints
            again = run_pipeline("tune.py", *args, "--resume", cwd=tmp_path, env=env, timeout=600)
            assert again.returncode == 0, again.stderr[-4000:]
            assert f"registered model version: {NAME}/1" in again.stdout, again.stdout[-2000:]
            assert not re.search(r"trial \w+ epoch", again.stderr) and seen.read_text().count("\n") == 4, again.stderr[-3000:]
            assert _histories(client, trials) == histories
            assert _checkpoints(tmp_path / "ray") == checkpoints
            assert len(client.search_model_versions(f"name = '{NAME}'")) == 1
            assert len(client.search_runs([exp.experiment_id], "tags.`anchor_rm.stage` = 'trial'")) == 4
    finally:
        stop_process_group(server)  # the restarted one
