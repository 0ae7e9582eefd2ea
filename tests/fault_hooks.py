"""Faults the reliability tests inject into Ray Train workers, through the trainer's step hook
(tuning/trainable.py, ANCHOR_RM_TRAIN_STEP_HOOK="<this file>:<function>:<argument>"). Loaded by file path in
each worker; never imported by the library."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path


def wait_until_checkpoint_collected(timeout_s: float = 600) -> None:
    """Returns once Ray Train's controller has collected this run's newest checkpoint, or at once when the run
    has none yet. The controller collects a worker's reports (and so its checkpoints) when it polls the
    worker; a checkpoint reported but not yet collected dies with the worker, and the restart begins from the
    one before. Its checkpoint_manager_snapshot.json names the newest checkpoint it knows: an event, on a CPU
    of any speed (a fixed wait of two polls once held on one CPU and not on a faster one)."""
    import ray.train

    folder = Path(ray.train.get_context().get_storage().experiment_fs_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        newest = max((p.name for p in folder.glob("checkpoint_*") if p.is_dir()), default=None)  # names are times
        if newest is None:
            return
        try:
            known = json.loads((folder / "checkpoint_manager_snapshot.json").read_text())["latest_checkpoint_result"]
        except (OSError, ValueError, KeyError, TypeError):  # not written yet, or being written
            known = None
        if known and known.get("checkpoint_dir_name") == newest:
            return
        time.sleep(0.2)
    raise TimeoutError(f"Ray Train's controller did not collect {folder}'s newest checkpoint in {timeout_s} s")


def first_time(marker: str) -> bool:
    """True for the first caller only, in any process and across restarts: it creates `marker` atomically."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def kill_once_at(step: int, rank: int, argument: str) -> None:
    """argument "<step>:<marker file>": the rank-0 worker SIGKILLs itself when it finishes that training step,
    once (the marker file, created atomically, remembers it across the restart), after its epoch's checkpoint
    is collected."""
    at, marker = argument.split(":", 1)
    if rank != 0 or step != int(at) or not first_time(marker):  # only the first one dies
        return
    wait_until_checkpoint_collected()
    os.kill(os.getpid(), signal.SIGKILL)


def fail_nth_run(step: int, rank: int, argument: str) -> None:
    """argument "<n>:<file>": every worker of the n-th Train run (in the order their workers first took a step,
    recorded in the file) raises at its first step, on every attempt: the trial really fails, through Ray
    Train's restarts and Tune's retry alike."""
    import ray.train

    n, path = argument.split(":", 1)
    name = ray.train.get_context().get_experiment_name()  # "train-<trial id>" (tuning/trainable.py)
    seen = open(path).read().split() if os.path.exists(path) else []
    if name not in seen:
        seen.append(name)
        with open(path, "a") as f:
            f.write(name + "\n")
    if seen.index(name) + 1 == int(n):
        raise RuntimeError(f"injected failure in {name} at step {step} (tests/fault_hooks.py)")


def kill_once_at_then_fail_nth_run(step: int, rank: int, argument: str) -> None:
    """argument "<kill step>:<marker file>:<n>:<file>": kill_once_at and fail_nth_run, both."""
    kill_step, marker, n, path = argument.split(":", 3)
    fail_nth_run(step, rank, f"{n}:{path}")
    kill_once_at(step, rank, f"{kill_step}:{marker}")


def hold_on_the_worker_node_at(step: int, rank: int, argument: str) -> None:
    """argument "<step>:<marker file>": on the node whose processes have ANCHOR_RM_TEST_NODE=worker
    (tests/helpers.py: ray_worker_node), the first rank-0 worker to finish that training step waits until its
    epoch's checkpoint is collected, writes its Train run's name ("train-<trial id>") into the marker file and
    then holds still, so that the test can kill the whole node under a trial that is mid-epoch."""
    import ray.train

    at, marker = argument.split(":", 1)
    if os.environ.get("ANCHOR_RM_TEST_NODE") != "worker" or rank != 0 or step != int(at):
        return
    if not first_time(marker + ".claimed"):  # once, for one trial
        return
    wait_until_checkpoint_collected()
    with open(marker + ".tmp", "w") as f:
        f.write(ray.train.get_context().get_experiment_name())
    os.replace(marker + ".tmp", marker)
    time.sleep(900)  # the node is killed under this worker


def hold_for_outage_at(step: int, rank: int, argument: str) -> None:
    """argument "<step>:<marker file>": the rank-0 worker, when it finishes that training step the first time,
    creates the marker file and waits (up to 5 minutes) for "<marker>.down", which the test creates once it
    has stopped the tracking server; training then goes on with the server gone."""
    at, marker = argument.split(":", 1)
    if rank != 0 or step != int(at) or not first_time(marker):  # once: not again after a restart
        return
    deadline = time.monotonic() + 300
    while not os.path.exists(marker + ".down") and time.monotonic() < deadline:
        time.sleep(0.2)


def hold_at(step: int, rank: int, argument: str) -> None:
    """argument "<step>:<marker file>": the first rank-0 worker to finish that training step, in any trial and
    any driver, waits until its epoch's checkpoint is collected, creates the marker file and then holds still,
    so that the test can SIGKILL the tune driver while a trial is mid-epoch (the worker dies with it)."""
    at, marker = argument.split(":", 1)
    if rank != 0 or step != int(at) or not first_time(marker + ".claimed"):
        return
    wait_until_checkpoint_collected()
    with open(marker, "w") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(900)  # the driver is killed, and this worker with it
