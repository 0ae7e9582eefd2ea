"""Faults the reliability tests inject into Ray Train workers, through the trainer's step hook
(tuning/trainable.py, ANCHOR_RM_TRAIN_STEP_HOOK="<this file>:<function>:<argument>"). Loaded by file path in
each worker; never imported by the library."""

from __future__ import annotations

import os
import signal
import time

# Ray Train's controller collects a worker's reports (and so its checkpoints) when it polls the worker, every
# RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default). A checkpoint reported but not yet collected dies with
# the worker, and the restart begins from the one before. The kill waits two polls, so that it always lands
# after the epoch's checkpoint is known (on a fast CPU three steps take under 2 s).
HEALTH_CHECK_INTERVAL_S = float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0"))


def first_time(marker: str) -> bool:
    """True for the first caller only, in any process and across restarts: it creates `marker` atomically."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def kill_once_at(step: int, rank: int, argument: str) -> None:
    """argument "<step>:<marker file>": the rank-0 worker SIGKILLs itself when it finishes that training step,
    once (the marker file, created atomically, remembers it across the restart)."""
    at, marker = argument.split(":", 1)
    if rank != 0 or step != int(at) or not first_time(marker):  # only the first one dies
        return
    time.sleep(2 * HEALTH_CHECK_INTERVAL_S + 1)
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
    time.sleep(2 * HEALTH_CHECK_INTERVAL_S + 1)
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
