"""Placement groups that a killed driver's trials leave holding CPUs, found and released on resume.

Ray removes a job's placement groups when the job ends, and those of an actor when the actor dies. A race
escapes both: when a tune driver is SIGKILLed mid-trial, Ray marks its job finished and its actors dead, but a
Ray Train controller still alive for a fraction of a second sees its workers die and starts a new worker group,
creating a placement group after Ray cleaned the job up (seen in CI: the PG was registered 0.18 s after its job
was marked finished, 0.16 s after its creator actor was marked dead). Nothing removes that group; on a
`ray start` cluster, which outlives the driver, it holds the trial's CPUs and the resumed search waits for
them forever.

So each driver records its Ray job in the experiment's folder (drivers.jsonl), and a driver that runs later,
before Tune starts, waits until no attached actor of the earlier drivers' ended jobs is alive (none can then
create a group: an event, not a time), and releases every placement group still held by one of those jobs.
Only those: our drivers create no detached actor that makes placement groups (Ray Train's detached
PlacementGroupCleaner makes none), so a live, non-detached group of an ended driver job of ours has no owner
left. A group of any other job, or a detached one, is never touched. A job is named by its id and start time,
so a job id that a restarted cluster hands out again is not mistaken for an earlier driver.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("anchor_rm")

DRIVERS_FILE = "drivers.jsonl"
LIVE_STATES = ("CREATED", "PENDING", "RESCHEDULING")
ACTORS_WAIT_S = 120  # a hang guard: Ray kills an ended job's actors within seconds


@dataclass(frozen=True)
class PlacementGroupRecord:
    placement_group_id: str
    creator_job_id: str
    state: str
    is_detached: bool
    resources: dict  # summed over its bundles


def orphans(groups: list[PlacementGroupRecord], earlier_drivers: set[tuple[str, int]],
            ended_jobs: set[tuple[str, int]]) -> list[PlacementGroupRecord]:
    """The groups to release: live, not detached, created by an earlier driver of this experiment (job id and
    start time) whose job has ended."""
    ended_ids = {job for job, start in earlier_drivers & ended_jobs}
    return [g for g in groups
            if g.state in LIVE_STATES and not g.is_detached and g.creator_job_id in ended_ids]


def _state_api():
    """Ray's State API for the cluster this process is connected to, named by its address: left to find one,
    it picks the newest Ray instance on the machine, which may be another."""
    import functools

    import ray
    from ray.util.state import list_actors, list_jobs, list_placement_groups

    address = ray.get_runtime_context().gcs_address
    return tuple(functools.partial(f, address=address) for f in (list_jobs, list_placement_groups, list_actors))


def _this_job() -> tuple[str, int]:
    import ray

    list_jobs, _, _ = _state_api()
    job_id = ray.get_runtime_context().get_job_id()
    for job in list_jobs(detail=True, raise_on_missing_output=False):
        if job.job_id == job_id:
            return job_id, int(job.start_time or 0)
    return job_id, 0


def record_driver(experiment_dir: Path) -> None:
    """Appends this driver's Ray job (id and start time) to <experiment_dir>/drivers.jsonl. Without Ray's state
    API (a cluster started without its dashboard) nothing is recorded and a warning says what that costs."""
    try:
        job_id, started = _this_job()
    except Exception as exc:  # the State API is served by the dashboard; a cluster may run without one
        log.warning("cannot record this driver's Ray job (%s): if it is killed, a placement group its trials "
                    "leave behind will not be released by --resume", _one_line(exc))
        return
    experiment_dir.mkdir(parents=True, exist_ok=True)
    append_record(experiment_dir / DRIVERS_FILE, {"job_id": job_id, "start_time": started, "recorded": time.time()})


def append_record(path: Path, record: dict) -> None:
    """One JSON line appended. A line that an earlier append left cut short (a kill, a full disk) is ended first,
    so that this record stays a line of its own (earlier_drivers skips the broken one)."""
    with open(path, "a+b") as f:  # appends at the end whatever the position read from
        ends_a_line = True
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            ends_a_line = f.read(1) == b"\n"
        f.write((("" if ends_a_line else "\n") + json.dumps(record) + "\n").encode())


def earlier_drivers(experiment_dir: Path) -> set[tuple[str, int]]:
    """The jobs recorded in drivers.jsonl; a line that is not a record (a driver killed while writing it) is
    skipped."""
    path = experiment_dir / DRIVERS_FILE
    found = set()
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            found.add((str(record["job_id"]), int(record["start_time"])))
        except (ValueError, KeyError, TypeError):
            continue
    return found


def release_orphaned_placement_groups(experiment_dir: Path, actors_wait_s: float = ACTORS_WAIT_S) -> list[str]:
    """Once no attached actor of an ended earlier driver lives (waiting up to `actors_wait_s`), removes the
    placement groups `orphans` picks; returns their ids and logs one line for each. Any failure to ask Ray is
    logged, never raised: the search goes on either way."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    drivers = earlier_drivers(experiment_dir)
    if len(drivers) < 2:  # this driver alone (or nothing recorded): no earlier driver to have left a group
        return []
    try:
        list_jobs, list_placement_groups, list_actors = _state_api()
        ended = {(j.job_id, int(j.start_time or 0)) for j in list_jobs(detail=True, raise_on_missing_output=False)
                 if str(getattr(j.status, "value", j.status)) in ("SUCCEEDED", "FAILED", "STOPPED")}
        ended_ids = {job for job, _ in drivers & ended}
        if not ended_ids:
            return []
        alive = _wait_for_actors(list_actors, ended_ids, actors_wait_s)
        if alive:
            log.warning("%d actor(s) of an earlier driver that has ended still alive after %.0f s (%s): releasing "
                        "its placement groups anyway", len(alive), actors_wait_s, ", ".join(sorted(set(alive))))
        groups = [PlacementGroupRecord(p.placement_group_id, p.creator_job_id, str(getattr(p.state, "value", p.state)),
                                       bool(p.is_detached), _resources(p.bundles))
                  for p in list_placement_groups(detail=True, limit=10_000, raise_on_missing_output=False)]
    except Exception as exc:
        log.warning("cannot list Ray's placement groups (%s): a group left by a killed driver is not released",
                    _one_line(exc))
        return []
    released = []
    for group in orphans(groups, drivers, ended):
        try:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group.placement_group_id)))
        except Exception as exc:
            log.warning("could not release placement group %s: %s", group.placement_group_id, _one_line(exc))
            continue
        log.info("released placement group %s (%s), left %s by job %s, an earlier driver of this experiment "
                 "that has ended", group.placement_group_id, group.resources, group.state, group.creator_job_id)
        released.append(group.placement_group_id)
    return released


def _wait_for_actors(list_actors, job_ids: set[str], timeout_s: float) -> list[str]:
    """Polls Ray until no attached (non-detached) actor of these jobs is alive; returns the class names of
    those still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [a.class_name for a in list_actors(filters=[("state", "!=", "DEAD")], detail=True, limit=10_000,
                                                   raise_on_missing_output=False)
                 if a.job_id in job_ids and not a.is_detached]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.5)


def _resources(bundles) -> dict:
    total: dict = {}
    for bundle in bundles or []:
        for key, value in (bundle.get("unit_resources") or {}).items():
            total[key] = total.get(key, 0) + value
    return total


def _one_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
