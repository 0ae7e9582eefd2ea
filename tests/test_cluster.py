"""The main job on a two-node Ray cluster on this machine: `ray start --head` (1 CPU) and a second node joined
with `ray start --address` (1 CPU, its own temporary folder), a real `mlflow server`, `tune.py --ray-address`
with two trials at a time and storage both nodes share. Mid-way through a trial on the second node, that
whole node is killed (its raylet, agents and workers); the trial goes on from its last checkpoint on the
head node, and the search registers one version. Then the same run on one node (a local cluster of the same
two CPUs): its registered version holds the same weights, byte for byte, and the same report.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers import (PYTHON, cluster_state, free_port, kill_ray_node, metric_steps, ray_head, ray_list,
                     ray_worker_node, run_pipeline, start_mlflow_server, stop_process_group)
from tuning.trainable import STEP_HOOK_ENV

NAME = "anchor-rm-helpful"
ONE_NODE_NAME = "anchor-rm-helpful-one-node"
HOLD_STEP = 8  # smoke: 6 steps per epoch; step 8 is mid-way through epoch 1, after epoch 0's checkpoint


TIMEOUT_S = 2400  # a hang guard: 456 s alone, up to 1,360 s beside the rest of the suite (M3)


def registered_content(uri: str, name: str, into: Path) -> tuple[dict[str, str], dict]:
    """Version 1 of `name`: each file of its reward model (path -> sha256) and its report, less what names the
    run (the run id, the time it was written, Tune's trial ids in the selection block and its drift rows)."""
    import mlflow

    from anchor_rm.mlflow_edge.model_package import find_report, reward_model_folder

    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/1", dst_path=str(into)))
    folder = reward_model_folder(local)
    files = {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(folder.rglob("*")) if p.is_file()}
    report = json.loads(find_report(folder).read_text())
    report.pop("created_at")
    report["model"].pop("run_id")
    for candidate in [report["selection"]["selected"], *report["selection"]["tied_with"],
                      *report["selection"]["drift"]["trials"]]:
        candidate.pop("trial_id")
    return files, report


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_two_nodes_run_trials_on_both_and_a_killed_node_hands_its_trial_to_the_other(tmp_path):
    started = time.time()
    marker = tmp_path / "held-on-worker-node"
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(tmp_path, port)
    try:
        with ray_head(tmp_path, num_cpus=1) as address, \
                ray_worker_node(address, num_cpus=1, env={"ANCHOR_RM_TEST_NODE": "worker"}) as worker_node:
            env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
            env.update({"HF_HUB_OFFLINE": "1",
                        STEP_HOOK_ENV: f"{Path(__file__).parent / 'fault_hooks.py'}:hold_on_the_worker_node_at:"
                                       f"{HOLD_STEP}:{marker}"})
            log_path = tmp_path / "tune.log"
            args = ["--preset", "smoke", "--num-samples", "1", "--concurrency", "2", "--max-failures", "1",
                    "--ray-address", address, "--tracking-uri", uri, "--storage-path", str(tmp_path / "shared"),
                    "--name", "two-nodes"]
            with open(log_path, "w") as log:
                driver = subprocess.Popen([PYTHON, str(Path(__file__).parents[1] / "pipelines" / "tune.py"), *args],
                                          cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.time() + 900
                while not marker.exists():
                    assert driver.poll() is None, log_path.read_text()[-4000:]
                    assert time.time() < deadline, "no trial reached the hold on the worker node:\n" + log_path.read_text()[-4000:]
                    time.sleep(1)
                held = marker.read_text().strip()  # "train-<trial id>"
                kill_ray_node(worker_node)
                print(f"{held} held at step {HOLD_STEP} on the worker node; the node's processes killed")
                try:  # what is left of the test's time but two minutes, to report what the run waits for
                    returncode = driver.wait(timeout=max(60, started + TIMEOUT_S - 120 - time.time()))
                except subprocess.TimeoutExpired:
                    pytest.fail("tune.py did not finish after the node was killed:\n" + cluster_state(address)
                                + "\n" + log_path.read_text()[-4000:])
            finally:
                if driver.poll() is None:
                    driver.kill()
            out = log_path.read_text()
            assert returncode == 0, out[-5000:]
            assert f"registered: models:/{NAME}/1 (alias challenger)" in out, out[-3000:]
            nodes = {n["node_id"]: n for n in ray_list(address, "nodes")}
            actors = ray_list(address, "actors")

        head = [i for i, n in nodes.items() if n["is_head_node"]]
        worker = [i for i, n in nodes.items() if not n["is_head_node"]]
        assert len(head) == 1 and len(worker) == 1, nodes
        assert nodes[worker[0]]["state"] == "DEAD" and nodes[head[0]]["state"] == "ALIVE", nodes
        # Every trial's Train controller ran on the head: Ray Train pins it to the node of the trial's driver,
        # which DRIVER_RESOURCES puts on the head; the node's death took only a Train worker.
        controllers = [a["node_id"] for a in actors if a["class_name"] == "TrainController"]
        assert len(controllers) >= 3 and set(controllers) == {head[0]}, actors

        client = MlflowClient(uri, registry_uri=uri)
        exp = client.get_experiment_by_name(NAME)
        trials = client.search_runs([exp.experiment_id], "tags.`anchor_rm.stage` = 'trial'")
        assert len(trials) == 3 and all(t.info.status == "FINISHED" for t in trials), [t.info.status for t in trials]
        placed = {t.data.tags["anchor_rm.trial_id"]: {k.rsplit("_", 1)[1]: v for k, v in t.data.tags.items()
                                                       if k.startswith("anchor_rm.ray_node.from_epoch_")} for t in trials}
        print("trial -> first epoch -> node:", {t: {e: "head" if n == head[0] else "worker" for e, n in p.items()}
                                                 for t, p in placed.items()})
        # Trials ran on both nodes.
        assert {placed[t]["0"] for t in placed} == {head[0], worker[0]}, placed
        # The held trial began on the worker node and, once that node died, went on from its epoch-0 checkpoint
        # on the head node: its epoch 1 was trained there, and no step was lost.
        held_id = held.removeprefix("train-")
        assert placed[held_id] == {"0": worker[0], "1": head[0]}, placed
        (held_run,) = [t for t in trials if t.data.tags["anchor_rm.trial_id"] == held_id]
        assert held_run.data.tags["anchor_rm.resumed_from_epoch"] == "0"
        steps = metric_steps(client, held_run.info.run_id, "train/loss")
        assert sorted(steps) == list(range(12)), steps
        assert [str(v.version) for v in client.search_model_versions(f"name = '{NAME}'")] == ["1"]
        assert re.search(r"trial \w+ epoch 1:", out)

        # The same run of the same seed on one node, the two nodes gone: a local cluster of their two CPUs, so
        # that every trial's worker again has one CPU and one torch thread (a matrix product's rounding can
        # change with the thread count). The data, teacher and ceiling stages are reused from the server.
        one_node_started = time.time()
        one_node = run_pipeline("tune.py", "--preset", "smoke", "--num-samples", "1", "--concurrency", "2",
                                "--max-failures", "1", "--num-cpus", "2", "--tracking-uri", uri,
                                "--storage-path", str(tmp_path / "one-node"), "--name", "one-node",
                                "--registered-name", ONE_NODE_NAME, cwd=tmp_path,
                                timeout=max(60, int(started + TIMEOUT_S - 60 - time.time())))
        assert one_node.returncode == 0, one_node.stdout[-3000:] + one_node.stderr[-3000:]
        two_files, two_report = registered_content(uri, NAME, tmp_path / "two-node-version")
        one_files, one_report = registered_content(uri, ONE_NODE_NAME, tmp_path / "one-node-version")
        print(f"one-node run {time.time() - one_node_started:.0f} s; files of the reward model compared: "
              f"{sorted(one_files)}")
        assert "model.safetensors" in one_files
        assert one_files == two_files
        assert one_report == two_report
    finally:
        stop_process_group(server)


# What a task of a local cluster runs: Ray's State API with no address, as Ray Train's placement-group cleaner
# calls it (ray.util.state.get_actor -> the API server found from the environment).
STATE_PROBE = """
import ray
from tuning.search import init_ray
init_ray(None, num_cpus=1)

@ray.remote(num_cpus=0)
def nodes():
    from ray.util.state import list_nodes
    return len(list_nodes())

print("nodes:", ray.get(nodes.remote()))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_local_cluster_beside_another_ray_instance_finds_its_own_state_api(tmp_path):
    """tune.py's own local cluster (tuning.search.init_ray without an address) while another Ray instance runs
    on the machine (a `ray start` head here; a second local tune.py for a user): its processes reach their own
    State API. Without being told it (RAY_API_SERVER_ADDRESS), a task there fails on "Found multiple active Ray
    instances", which is how Ray Train's placement-group cleaner died and left a finished trial's CPUs held."""
    with ray_head(tmp_path, num_cpus=1):
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
        probe = subprocess.run([PYTHON, "-c", STATE_PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=300)
    assert probe.returncode == 0 and "nodes: 1" in probe.stdout, (probe.stdout + probe.stderr)[-4000:]
