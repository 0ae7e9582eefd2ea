"""Real processes for integration tests: an `mlflow server` on 127.0.0.1 and the pipelines as scripts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
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
    """SIGTERM to the process and its children (started with start_new_session), then SIGKILL if needed."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
    except ProcessLookupError:
        pass


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


@contextmanager
def ray_head(workdir: Path, num_cpus: int = 2):
    """A real `ray start --head` on 127.0.0.1; yields its address and stops it afterwards."""
    ray_bin = str(Path(PYTHON).parent / "ray")
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    started = subprocess.run(
        [ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", str(num_cpus),
         "--disable-usage-stats"],  # keep the dashboard: Ray Train's cleanup uses its State API
        cwd=workdir, env=env, capture_output=True, text=True, timeout=180,
    )
    if started.returncode != 0:
        raise RuntimeError(f"ray start failed: {started.stderr[-2000:]}")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)
