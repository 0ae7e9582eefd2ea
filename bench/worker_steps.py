"""A main-job trial's training steps in a Ray Train worker against the same steps in a plain process, with
attention in fp32 (as the project trains under bf16 autocast on a CPU, anchor_rm.model.precision) and in bf16
(transformers' own SDPA) (not a test).

The steps are those of a trial of the default main job: its student-train split (PKU-SafeRLHF), 128 tokens, 16
pairs a step in length-grouped batches, naive W2S on seeded soft labels (their values do not change the time),
`--precision auto`, the student as `stages.load_student` loads it. Each run trains one epoch over the split's
first --steps x 16 pairs and times each step; the first is a warm-up and left out. Two places:

    plain   a child process of this script, no Ray, torch threads as a trial's worker gets them
    worker  a Ray Train worker: a local Ray instance started as `pipelines/tune.py` starts one
            (tuning.search.init_ray: dashboard and State API included), one TorchTrainer worker with the CPUs and
            torch threads `tuning.trainable.worker_resources` gives a trial at --concurrency 1, the worker
            setting its threads as `train_loop_per_worker` does

Each run is its own process; the order of the four (place, attention) runs rotates between repeats. Over the
timed steps each run also reads where the machine's CPU went (/proc): the training process itself, the rest of
the run's process tree (a worker run: its Ray driver, Ray's daemons and Train's actors), and every other
process. Every run is shown; one during which other processes took more than 10% of the machine is marked
disturbed and left out of the medians (the rule of bench_common.Disturbance, fixed before the run).

    .venv/bin/python bench/worker_steps.py                     # 3 repeats x 4 runs of 30 steps, ~12 min on 2 cores
    .venv/bin/python bench/worker_steps.py --steps 10 --repeats 1

Under fp32 training (`auto` on a CPU without native bf16) the two attentions are the same computation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import ROOT, Disturbance, machine, markdown_table, median, positive_int

PLACES = ("plain", "worker")
ATTENTIONS = ("fp32", "bf16")  # fp32: the project's CPU attention under bf16 autocast; bf16: transformers' SDPA
TRANSFORMERS_ATTENTION = "sdpa"
SEED = 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=30, help="training steps timed per run (at most one "
                        "epoch of the default student-train split: 40), the first a warm-up")
    parser.add_argument("--repeats", type=positive_int, default=3, help="rounds of all four runs")
    parser.add_argument("--out", help="also write every measurement as JSON here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: "place,attention" in this process
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is a warm-up")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        parser.error(f"--out {args.out}: its folder does not exist")
    return args


def student_train(seed: int = SEED):
    """(the default main job's protocol config, its student-train pairs)."""
    from anchor_rm.data.splits import build_protocol_splits
    from anchor_rm.pipeline.config import tune_preset

    cfg = tune_preset("default", "harmless")  # what `pipelines/tune.py` runs without arguments
    return cfg, build_protocol_splits(cfg.source, [], seed, max_pairs=cfg.max_pairs).student_train


def workload(steps: int):
    """(student, encoded pairs, soft labels, train config): one epoch of `steps` steps of a default trial's
    training, over the first `steps` batches' worth of its student-train pairs."""
    import numpy as np

    from anchor_rm.method.training import TrainConfig
    from anchor_rm.model.precision import resolve_precision
    from anchor_rm.model.reward_model import load_pretrained

    cfg, pairs = student_train()
    train = cfg.student_train
    pairs = pairs[:steps * train.batch_size]
    encoded = load_pretrained(cfg.student, train.max_length, SEED).encode(pairs)
    labels = np.random.default_rng(SEED).uniform(0.3, 0.9, len(encoded)).tolist()
    config = TrainConfig(**{**train.to_dict(), "method": "naive", "epochs": 1, "seed": SEED,
                            "precision": resolve_precision(train.precision)})
    return cfg.student, encoded, labels, config


def time_steps(student: str, encoded, labels, config, steps: int, attention: str, threads: int, root_pid: int) -> dict:
    """Seconds of each of the first `steps` training steps, in this process, and where the machine's CPU went
    from the end of the warm-up step to the last: this process, the rest of `root_pid`'s process tree (a worker
    run: its Ray driver, Ray's daemons and actors), and every other process."""
    import resource

    import torch

    from anchor_rm.method.stages import load_student
    from anchor_rm.method.training import train_reward_model
    from bench_common import _busy_seconds, tree_seconds_by_kind

    def own_seconds() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    torch.set_num_threads(threads)
    rm = load_student(student, config, device="cpu")
    if attention == "bf16":
        rm.model.set_attn_implementation(TRANSFORMERS_ATTENTION)
    ends: list[float] = []
    # (machine busy, root's tree by kind, this process), after the warm-up step and after the last
    cpu: list[tuple[float, dict[str, float], float]] = []

    class Enough(Exception):
        pass

    def on_step(log) -> None:
        ends.append(time.perf_counter())
        if len(ends) in (1, steps):
            cpu.append((_busy_seconds(), tree_seconds_by_kind(root_pid), own_seconds()))
        if len(ends) == steps:
            raise Enough

    started = time.perf_counter()
    try:
        train_reward_model(rm.model, encoded, labels, config, pad_token_id=rm.encoder.pad_token_id, on_step=on_step)
    except Enough:
        pass
    bounds = [started] + ends
    capacity = (ends[-1] - ends[0]) * (os.cpu_count() or 1)  # CPU seconds the machine had over the timed steps
    (busy0, kinds0, own0), (busy1, kinds1, own1) = cpu
    tree0, tree1 = sum(kinds0.values()), sum(kinds1.values())
    return {"step_seconds": [b - a for a, b in zip(bounds, bounds[1:])], "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "attention": rm.model.config._attn_implementation,
            "precision": config.precision, "batch_pairs": config.batch_size, "own_share": (own1 - own0) / capacity,
            "rest_of_tree_share": max(0.0, (tree1 - tree0) - (own1 - own0)) / capacity,
            "others": max(0.0, (busy1 - busy0) - (tree1 - tree0)) / capacity,
            "tree_share_by_kind": {k: (v - kinds0.get(k, 0.0)) / capacity for k, v in kinds1.items()
                                   if v - kinds0.get(k, 0.0) > 0}}


def _worker_loop(config: dict) -> None:
    """Ray Train's per-worker function: the timed steps, written where the driver reads them."""
    sys.path.insert(0, config["bench"])  # bench_common, which a Ray worker does not find by itself
    result = time_steps(config["student"], config["encoded"], config["labels"], config["train"], config["steps"],
                        config["attention"], config["threads"], config["root_pid"])
    Path(config["out"]).write_text(json.dumps(result))


def run_one(place: str, attention: str, steps: int) -> dict:
    student, encoded, labels, config = workload(steps)
    if place == "plain":
        from tuning.trainable import worker_resources

        _, threads = worker_resources([float(os.cpu_count() or 1)], 1, 1)
        return time_steps(student, encoded, labels, config, steps, attention, threads, os.getpid())
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from tuning.search import init_ray
    from tuning.trainable import node_resources, worker_resources

    init_ray(None)
    try:
        cpus, threads = worker_resources(node_resources()[0], 1, 1)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "steps.json"
            TorchTrainer(
                _worker_loop,
                train_loop_config={"student": student, "encoded": encoded, "labels": labels, "train": config,
                                   "steps": steps, "attention": attention, "threads": threads, "out": str(out),
                                   "root_pid": os.getpid(), "bench": str(Path(__file__).resolve().parent)},
                scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": cpus}),
                run_config=ray.train.RunConfig(name="worker-steps", storage_path=str(Path(tmp) / "ray")),
            ).fit()
            return {**json.loads(out.read_text()), "cpus_per_worker": cpus}
    finally:
        ray.shutdown()


def run_in_subprocess(place: str, attention: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, __file__, "--steps", str(steps), "--one", f"{place},{attention}",
                        "--json-out", str(out)], check=True, cwd=ROOT)
        result = json.loads(out.read_text())
        return {**result, "place": place, "attention_variant": attention,
                "disturbed": result["others"] > Disturbance.DISTURBED}


def seconds_per_step(run: dict) -> float:
    return median(run["step_seconds"][1:])


def report(runs: list[dict], args: argparse.Namespace) -> str:
    kept = [r for r in runs if not r["disturbed"]]
    medians = {(p, a): median([seconds_per_step(r) for r in kept if (r["place"], r["attention_variant"]) == (p, a)])
               for p in PLACES for a in ATTENTIONS}
    rows = [[p, a, f"{medians[(p, a)]:.3f}", f"{medians[(p, 'bf16')] / medians[(p, a)]:.2f}",
             f"{medians[(p, a)] / medians[('plain', a)]:.2f}"] for p in PLACES for a in ATTENTIONS]
    summary = markdown_table(["place", "attention", "s per step (median)", "bf16 attention / this",
                              "this / plain, same attention"], rows)
    every = markdown_table(
        ["repeat", "place", "attention", "threads", "OMP_NUM_THREADS", "s per step (median of the run)",
         "steps 2.. s", "CPU: training process", "CPU: rest of the run (Ray)", "CPU: other processes"],
        [[str(r["repeat"]), r["place"], r["attention_variant"], str(r["threads"]), str(r["omp_num_threads"]),
          f"{seconds_per_step(r):.3f}" + (" (disturbed: left out)" if r["disturbed"] else ""),
          f"{sum(r['step_seconds'][1:]):.1f}", f"{r['own_share']:.0%}", f"{r['rest_of_tree_share']:.0%}",
          f"{r['others']:.0%}"] for r in runs])
    workers = [r for r in kept if r["place"] == "worker"]
    shares = {k: median([r["tree_share_by_kind"].get(k, 0.0) for r in workers])
              for k in {k for r in workers for k in r["tree_share_by_kind"]}}
    by_kind = ", ".join(f"{k} {v:.1%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v >= 0.001)
    first = runs[0]
    notes = (f"{args.steps} steps a run (the first a warm-up), {first['batch_pairs']} pairs a step, precision {first['precision']}, "
             f"{args.repeats} repeats (medians of the undisturbed ones); CPU shares are of the whole machine over the "
             f"timed steps; {machine()}")
    if by_kind:
        notes += f"\n\nWorker runs, the machine's CPU by process during the timed steps (median): {by_kind}"
    return f"{summary}\n\n{notes}\n\nEvery run:\n\n{every}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        place, attention = args.one.split(",")
        Path(args.json_out).write_text(json.dumps(run_one(place, attention, args.steps)))
        return 0
    cfg, pairs = student_train()
    if args.steps > len(pairs) // cfg.student_train.batch_size:
        raise SystemExit(f"--steps {args.steps}: the default student-train split has {len(pairs)} pairs, "
                         f"{len(pairs) // cfg.student_train.batch_size} steps of {cfg.student_train.batch_size}")
    combos = [(p, a) for p in PLACES for a in ATTENTIONS]
    runs = []
    for repeat in range(args.repeats):
        for place, attention in combos[repeat % len(combos):] + combos[:repeat % len(combos)]:
            run = {**run_in_subprocess(place, attention, args.steps), "repeat": repeat + 1}
            runs.append(run)
            print(f"repeat {repeat + 1}/{args.repeats} {place} {attention} attention: {seconds_per_step(run):.3f} s "
                  f"per step ({run['threads']} threads, OMP_NUM_THREADS {run['omp_num_threads']}; CPU: training "
                  f"{run['own_share']:.0%}, rest of the run {run['rest_of_tree_share']:.0%}, other processes "
                  f"{run['others']:.0%})", flush=True)
    table = report(runs, args)
    print("\n" + table)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs, "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
