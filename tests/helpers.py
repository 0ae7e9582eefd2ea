"""Real processes for integration tests: an `mlflow server` on 127.0.0.1 and the pipelines as scripts."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 90.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def start_mlflow_server(workdir: Path, port: int) -> subprocess.Popen:
    """`mlflow server` on 127.0.0.1:port with workdir's SQLite store and artifacts; returns once it answers.
    Started again with the same workdir and port, it is the same server after an outage."""
    log = open(workdir / "mlflow-server.log", "a")
    proc = subprocess.Popen(
        [str(Path(PYTHON).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{workdir / 'server.db'}",
         "--artifacts-destination", str(workdir / "server-artifacts"), "--workers", "1"],
        # Without MLflow's job execution (GenAI scoring and trace jobs, which anchor-rm does not use): its eight
        # processes took 66 s of CPU in 90 s of an idle server on M3 (docs/scaling.md), and a killed server
        # leaves their folder in /dev/shm.
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True,
    )
    log.close()  # the child keeps its own descriptor
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
    except BaseException:
        stop_process_group(proc)
        raise
    return proc


def stop_process_group(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM to the process and its children (started with start_new_session), then SIGKILL if needed.
    Returns once every process of the group is gone: `mlflow server` exits before the uvicorn it started,
    which can still answer on an open connection for a moment, so a wait on the leader alone is not an
    outage yet."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        proc.poll()
        return
    deadline = time.monotonic() + timeout
    while _group_alive(proc):
        if time.monotonic() > deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + timeout
        time.sleep(0.05)
    proc.wait()


def _group_alive(proc: subprocess.Popen) -> bool:
    """Whether a process of proc's group still runs (zombies left to an init that does not reap do not)."""
    proc.poll()  # reaps the leader once it exits
    return bool(_members(proc.pid))


def _members(group: int) -> list[int]:
    """The live processes of process group `group` (zombies excepted)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while listed
        if int(fields[2]) == group and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(int(stat.parent.name))
    return members


@contextmanager
def mlflow_server(workdir: Path):
    """A real tracking server with a SQLite store and proxied artifacts, on a free local port."""
    port = free_port()
    proc = start_mlflow_server(workdir, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_group(proc)


def run_pipeline(script: str, *args: str, cwd: Path, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    # The caller's tracking and registry URIs (mlflow.set_registry_uri exports MLFLOW_REGISTRY_URI) must not
    # leak into a pipeline: its --tracking-uri, or the default store, decides both.
    full_env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    full_env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
    return subprocess.run([PYTHON, str(ROOT / "pipelines" / script), *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def metric_steps(client, run_id: str, key: str) -> Counter:
    """How many times each step of a run's metric was logged."""
    return Counter(m.step for m in client.get_metric_history(run_id, key))


def assert_history_explained(client: MlflowClient, run_id: str, steps_per_epoch: int, epochs: int) -> list[int]:
    """Every step of every epoch run is logged; a step logged twice follows a train/resumed_from_epoch marker
    (the worker restarted from the checkpoint of that epoch and ran the next one again). Returns the marker
    steps."""
    markers = {m.step: m.value for m in client.get_metric_history(run_id, "train/resumed_from_epoch")}
    for key in ("train/loss", "train/w2s_loss", "train/lr"):
        steps = metric_steps(client, run_id, key)
        assert sorted(set(steps)) == list(range(max(steps) + 1)), (key, steps)  # no gap
        assert (max(steps) + 1) % steps_per_epoch == 0 and max(steps) < steps_per_epoch * epochs
        for step, count in steps.items():
            if count > 1:  # a repeat: explained only by a restart at or before it, in the same epoch
                assert any(m <= step < m + steps_per_epoch for m in markers), (key, step, count, markers)
                assert count <= 1 + len(markers)
    for marker, epoch in markers.items():
        assert marker == (int(epoch) + 1) * steps_per_epoch  # the first step of the epoch after the checkpoint
    val = metric_steps(client, run_id, "val/mean_nts")
    assert sorted(val) == list(range(len(val))) and set(val.values()) == {1}, val  # one value per epoch
    return sorted(markers)


RAY_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@contextmanager
def ray_head(workdir: Path, num_cpus: int = 2):
    """A real `ray start --head` on 127.0.0.1; yields its address and stops it afterwards. When the block
    raises (a failing assertion, a timeout), the node's logs are kept in workdir/ray-head-logs.

    The cluster has a token of its own (workdir/ray-auth-token, Ray's token authentication): while the block
    runs, this process's environment names it (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH), so every process a
    test starts inside it (a second node, tune.py, `ray list`) sends it. Nothing reads or writes ~/.ray: on a
    machine that never ran Ray there is none, and a joining node then failed to start."""
    port, dashboard_port = free_port(), free_port()
    token = workdir / "ray-auth-token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    saved = {name: os.environ.pop(name, None) for name in RAY_AUTH_ENV}
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
    # Ray Train's PlacementGroupCleaner (on the head) asks Ray's state API whether the trial's controller is
    # alive; with no address it looks for the machine's Ray instance, and with two clusters running (the other
    # xdist worker's) its monitor thread dies on "Found multiple active Ray instances": a finished trial's
    # placement group then stays, and the next trial waits forever for its CPUs (two CI runs, session 11). The
    # head's processes are told their own API server.
    own_api = {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard_port}"}
    try:
        with _ray_node(["--head", "--port", str(port), "--dashboard-port", str(dashboard_port),
                        "--ray-client-server-port", str(free_port())], num_cpus, own_api, "head",
                       logs_to=workdir / "ray-head-logs"):
            yield f"127.0.0.1:{port}"
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


@contextmanager
def ray_worker_node(address: str, num_cpus: int = 1, env: dict | None = None):
    """A second node joined to the cluster at `address` (`ray start --address`), on this machine with its own
    temporary folder; yields its process group (kill_ray_node takes it) and stops the node afterwards. `env`
    reaches every process of the node, the workers Ray starts there included. Inside ray_head's block: the
    node sends the head's token."""
    with _ray_node(["--address", address], num_cpus, env or {}, "worker") as group:
        yield group


@contextmanager
def _ray_node(role_args: list[str], num_cpus: int, env: dict, role: str, logs_to: Path | None = None):
    # Each node has its own short temporary folder (Ray's socket paths must stay under 108 bytes), its own
    # ports and its own session: `ray start` runs in a new process group, which every process of the node
    # (raylet, agents, workers) keeps, so that stopping one node, or one cluster, leaves the others alone
    # (`ray stop` stops every Ray process on the machine).
    temp_dir = tempfile.mkdtemp(prefix=f"ray-{role}-", dir="/tmp")
    ray_bin = str(Path(PYTHON).parent / "ray")
    full_env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **env}
    starter = subprocess.Popen(
        [ray_bin, "start", *role_args, "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus),
         "--temp-dir", temp_dir, "--dashboard-agent-listen-port", str(free_port()),
         "--disable-usage-stats"],  # keep the dashboard: Ray Train's cleanup uses its State API
        cwd=temp_dir, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        _, stderr = starter.communicate(timeout=180)
        if starter.returncode != 0:
            raise RuntimeError(f"ray start ({role}) failed: {stderr[-2000:]}")
        yield starter.pid
    except BaseException:
        if logs_to is not None:  # the node's folder goes below; what it logged is what explains a failure
            logs = Path(temp_dir) / "session_latest" / "logs"
            try:
                shutil.copytree(logs, logs_to, symlinks=True, ignore_dangling_symlinks=True, dirs_exist_ok=True)
            except OSError:  # no session yet, or a file gone while copying: the test's own error matters more
                pass
        raise
    finally:
        kill_ray_node(starter.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)


def ray_list(address: str, what: str) -> list[dict]:
    """Ray's state API (`ray list <what>`): for nodes, every node the cluster has known, alive or dead."""
    import json

    listed = subprocess.run([str(Path(PYTHON).parent / "ray"), "list", what, "--format", "json", "--detail"],
                            env={**os.environ, "RAY_ADDRESS": address},  # the API server: from GCS; the token: ray_head
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    return [] if listed.stdout.startswith("No resource") else json.loads(listed.stdout)  # "No resource in the cluster"


def cluster_state(address: str) -> str:
    """What a stuck run is waiting for: the placement groups and the live actors, one line each."""
    lines = []
    for what, keys in (("placement-groups", ("placement_group_id", "state", "bundles")),
                       ("actors", ("class_name", "state", "node_id", "required_resources"))):
        try:
            lines += [f"{what}: " + " ".join(str(item.get(k)) for k in keys) for item in ray_list(address, what)
                      if item.get("state") != "DEAD"]
        except Exception as exc:  # the report of a failure must not fail
            lines.append(f"{what}: unavailable ({exc})")
    return "\n".join(lines)


def kill_ray_node(group: int) -> None:
    """SIGKILLs every process of a Ray node started by _ray_node (its process group `group`) and returns once
    they are gone: the node dies as a machine that loses power would."""
    deadline = time.monotonic() + 60
    while _members(group):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of group {group} outlived SIGKILL: {_members(group)}")
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------
# Shared fixtures' building blocks: the tiny model, a SQLite store, a registered version.

def tiny_bert(tokenizer, seed: int = 0):
    """A 2-layer, 32-wide BERT on `tokenizer`'s vocabulary (MiniLM's): real code paths, millisecond steps."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=1, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=tokenizer.pad_token_id)
    return BertForSequenceClassification(config)


def tiny_llama(tokenizer, seed: int = 0):
    """A 2-layer, 32-wide Llama reward model on MiniLM's vocabulary: the decoder architecture of the paper's students."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    return LlamaForSequenceClassification(config)


def tiny_reward_model(tokenizer, seed: int = 0, max_length: int = 32, name: str = "tiny-bert"):
    from anchor_rm.model.encoding import RewardEncoder
    from anchor_rm.model.reward_model import RewardModel

    return RewardModel(tiny_bert(tokenizer, seed), tokenizer, RewardEncoder(tokenizer, max_length, decoder=False), name)


def tiny_model_folder(path: Path, tokenizer, seed: int = 0, max_length: int = 32, name: str = "tiny-bert",
                      extra: dict | None = None) -> Path:
    """The tiny reward model saved as a folder (reward_model.save_reward_model)."""
    from anchor_rm.model.reward_model import save_reward_model

    return save_reward_model(tiny_reward_model(tokenizer, seed, max_length, name), path, extra)


@contextmanager
def sqlite_store(folder: Path, experiment: str):
    """A fresh SQLite tracking store and registry in `folder`, made current (experiment selected); the
    caller's MLflow URIs and environment come back afterwards. Yields the URI."""
    import mlflow

    from anchor_rm.mlflow_edge.store import configure

    saved_env = {k: os.environ.pop(k, None) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    before = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    configure(uri, experiment)
    try:
        yield uri
    finally:
        mlflow.set_tracking_uri(before[0])
        mlflow.set_registry_uri(before[1])
        for k, v in saved_env.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def register_version(folder: Path, report, name: str) -> str:
    """A new version of `name` registered from `folder` with `report`, in a run of its own, as tune.py
    registers one (alias challenger); returns the version number."""
    from anchor_rm.mlflow_edge import runs
    from anchor_rm.mlflow_edge.registry import log_and_register

    with runs.start_run():
        return log_and_register(folder, report, name).version
