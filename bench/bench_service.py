"""Throughput and latency of the reward service (not a test).

Registers a reward model in a temporary MLflow store and starts two real `bentoml serve` processes on
127.0.0.1, one with batching on and one with it off (ANCHOR_RM_BATCHING=0); loads the same model in a plain
transformers loop (tokenizer + AutoModelForSequenceClassification, one pair at a time, no service) in the
precision the service resolved `--precision` to; where that is bf16 on a CPU, a second plain loop holds the
matmul weights in bf16 as the service does (scoring.cast_matmul_weights_once), so that the service's own
overhead can be told from that saving. Every setup first scores every pair once (warm-up). Then,
`--repeats` times, interleaved: the plain loop, and /score driven by 1, 8 and 32 concurrent clients on each
server, each cell for a fixed time. Prints every repeat, with how much CPU other processes took meanwhile
(the servers and the clients excepted; more than 10%: "disturbed", bench/bench_common.Disturbance), then the
medians of the undisturbed repeats and each over the plain loop's median (and the cast loop's).

    .venv/bin/python bench/bench_service.py                       # MiniLM-L6, max length 192, 3 x 10 s per cell (~5 min)
    .venv/bin/python bench/bench_service.py --seconds 5 --repeats 1 --model tiny --concurrency 1,8
    .venv/bin/python bench/bench_service.py --skip no-batching --service-env OMP_WAIT_POLICY=PASSIVE

`--service-env NAME=VALUE[,NAME=VALUE]` (repeatable) adds a batching server whose process gets those
environment variables on top, measured in the same rounds as the others: a candidate setting against the
default in one run.

Pairs are (prompt, chosen) and (prompt, rejected) of the shipped HH helpful-base test split: long
multi-turn prompts, truncated from the left to the model's max length as evaluation does. The clients run on
the same machine as the server and take some of its CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_common import Disturbance, load_pairs, median, service_machine, register_versions, start_service, stop_service

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
NAME = "anchor-rm-harmless"  # the name the service serves by default (ANCHOR_RM_MODEL_URI is not set)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minilm-l6", help="minilm-l6 (pretrained MiniLM-L6, fresh reward head) "
                                                            "or tiny (a 2-layer 32-wide random BERT)")
    parser.add_argument("--max-length", type=int, default=192, help="tokens per pair (the tune preset's until 2026-12-02; its figures in docs/benchmarks.md use 192)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured time per cell")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every setup, interleaved")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts")
    parser.add_argument("--pairs-per-request", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=32, help="ANCHOR_RM_MAX_BATCH_SIZE when batching")
    parser.add_argument("--forward-batch-size", type=int, default=8,
                        help="ANCHOR_RM_FORWARD_BATCH_SIZE: sequences per forward pass inside a batch")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="ANCHOR_RM_PRECISION for the service; the plain loop runs in what it resolves to")
    parser.add_argument("--device", default="cpu", help="where the service and the plain loop score: cpu, cuda or "
                        "cuda:N (ANCHOR_RM_DEVICE)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: batching,no-batching,loop,loop-cast "
                        "(the second plain loop, with the service's bf16 weights)")
    parser.add_argument("--service-env", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                        help="an extra batching server with these environment variables (repeatable)")
    parser.add_argument("--out", help="also write the figures as JSON here")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# Setup: a registered model and the pairs to score.

# ---------------------------------------------------------------------------------------------------
# Measuring.

def summarise(latencies: list[float], pairs: int, elapsed: float, errors: int) -> dict:
    ordered = sorted(latencies)

    def pct(q):
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    return {"pairs_per_s": pairs / elapsed, "p50_ms": pct(0.50), "p99_ms": pct(0.99), "requests": len(latencies),
            "errors": errors, "seconds": elapsed}


def drive(url: str, pairs: list[tuple[str, str]], concurrency: int, seconds: float, per_request: int) -> dict:
    import httpx

    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    start_barrier = threading.Barrier(concurrency + 1)
    deadline = [0.0]

    def client(worker: int):
        local, failed, i = [], 0, worker * 7
        with httpx.Client(base_url=url, timeout=300) as http:
            start_barrier.wait()
            while time.perf_counter() < deadline[0]:
                items = [{"prompt": p, "response": r} for p, r in
                         (pairs[(i + k) % len(pairs)] for k in range(per_request))]
                i += per_request
                t0 = time.perf_counter()
                response = http.post("/score", json={"items": items})
                if response.status_code == 200:
                    local.append(time.perf_counter() - t0)
                else:
                    failed += 1
        with lock:
            latencies.extend(local)
            errors[0] += failed

    threads = [threading.Thread(target=client, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    begin = time.perf_counter()
    deadline[0] = begin + seconds
    start_barrier.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - begin  # includes the requests that finish after the deadline
    return summarise(latencies, len(latencies) * per_request, elapsed, errors[0])


def warm_up(url: str, pairs: list[tuple[str, str]]) -> None:
    """WARM_UP: every pair scored once before anything is timed, in the service and in the plain loop alike.
    oneDNN builds a kernel per input shape on first use, so a cold process runs about 15% slower over its
    first pass of these 400 pairs (about 190 distinct lengths) than later."""
    import httpx

    with httpx.Client(base_url=url, timeout=300) as http:
        for prompt, response in pairs:
            http.post("/score", json={"items": [{"prompt": prompt, "response": response}]}).raise_for_status()


def parse_service_env(text: str) -> dict[str, str]:
    """'A=1,B=2' -> {'A': '1', 'B': '2'}; a clear error for anything else."""
    env = {}
    for part in filter(None, text.split(",")):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--service-env {text!r}: expected NAME=VALUE[,NAME=VALUE], got {part!r}")
        env[name.strip()] = value
    return env


def serve(workdir: Path, batching: bool, max_batch_size: int, precision: str,
          forward_batch_size: int = 8, device: str = "cpu", extra_env: dict[str, str] | None = None,
          name: str | None = None) -> tuple[subprocess.Popen, str]:
    name = name or ("batching" if batching else "no-batching")
    return start_service(workdir, {"ANCHOR_RM_DEVICE": device,
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}", "ANCHOR_RM_POLL_SECONDS": "0",
        "ANCHOR_RM_BATCHING": "1" if batching else "0", "ANCHOR_RM_MAX_BATCH_SIZE": str(max_batch_size),
        "ANCHOR_RM_PRECISION": precision, "ANCHOR_RM_FORWARD_BATCH_SIZE": str(forward_batch_size),
        "ANCHOR_RM_DOWNLOAD_DIR": str(workdir / f"downloads-{name}"), **(extra_env or {})},
        log_name=f"serve-{name}.log")


class PlainLoop:
    """One pair at a time through transformers: the tokenizer (prompt cut from the left) and the model, under
    bf16 autocast where `precision` is bf16 (what the service scores in). Loaded and warmed once."""

    def __init__(self, folder: Path, pairs: list[tuple[str, str]], max_length: int, precision: str, device: str = "cpu",
                 cast_once: bool = False):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.tokenizer.truncation_side = "left"
        self.model = AutoModelForSequenceClassification.from_pretrained(folder).eval().to(device)
        if cast_once:  # what the service does on a bf16 CPU (scoring.cast_matmul_weights_once)
            from anchor_rm.model.scoring import cast_matmul_weights_once

            cast_matmul_weights_once(self.model, torch.bfloat16)
        self.pairs, self.max_length, self.precision = pairs, max_length, precision
        self.device = torch.device(device)
        for prompt, response in pairs:  # warm-up: every pair once, as the service gets (see warm_up)
            self._score(prompt, response)

    def _score(self, prompt: str, response: str) -> None:
        import torch

        from anchor_rm.model.precision import autocast

        with torch.inference_mode(), autocast(self.precision, self.device.type):
            inputs = self.tokenizer(prompt, response, truncation=True, max_length=self.max_length, return_tensors="pt")
            self.model(**inputs.to(self.device)).logits.item()  # .item(): waits for the GPU, as the service does

    def measure(self, seconds: float) -> dict:
        latencies, i = [], 0
        begin = time.perf_counter()
        while time.perf_counter() - begin < seconds:
            t0 = time.perf_counter()
            self._score(*self.pairs[i % len(self.pairs)])
            latencies.append(time.perf_counter() - t0)
            i += 1
        return summarise(latencies, len(latencies), time.perf_counter() - begin, 0)


def main(argv=None) -> int:
    args = parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    variants = [parse_service_env(text) for text in args.service_env]
    skip = set(filter(None, args.skip.split(",")))
    workdir = Path(tempfile.mkdtemp(prefix="anchor-rm-bench-"))
    print(f"workdir {workdir}", flush=True)
    _, folders = register_versions(workdir, args.model, args.max_length, NAME, (0,), "bench-service")
    folder = next(iter(folders.values()))
    pairs = load_pairs()
    from anchor_rm.model.reward_model import load_saved

    rm = load_saved(folder)
    encoded = [rm.encoder.encode(p, r) for p, r in pairs]
    tokens = statistics.mean(len(e.input_ids) for e in encoded)
    truncated = sum(e.truncated for e in encoded) / len(encoded)
    n_params = sum(p.numel() for p in rm.model.parameters())
    del rm
    results = {"command": "python bench/bench_service.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "machine": service_machine(), "model": f"{args.model} ({n_params / 1e6:.1f}M parameters), max length "
               f"{args.max_length}", "data": f"{len(pairs)} HH helpful-base pairs, mean {tokens:.0f} tokens after "
               f"truncation, {100 * truncated:.0f}% truncated", "pairs_per_request": args.pairs_per_request,
               "seconds_per_cell": args.seconds, "cells": []}
    from anchor_rm.model.precision import resolve_precision

    import torch

    precision = resolve_precision(args.precision, torch.device(args.device).type)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for batching in (True, False):
            label = "batching" if batching else "no-batching"
            if label not in skip:
                servers[f"service, batching {'on' if batching else 'off'}"] = serve(
                    workdir, batching, args.max_batch_size, args.precision, args.forward_batch_size, args.device)
        for i, env in enumerate(variants):
            label = ",".join(f"{k}={v}" for k, v in env.items())
            servers[f"service, batching on, {label}"] = serve(workdir, True, args.max_batch_size, args.precision,
                                                              args.forward_batch_size, args.device, env, f"variant-{i}")
        for proc, url in servers.values():
            warm_up(url, pairs)
            drive(url, pairs, 8, 3, args.pairs_per_request)
        loops = {}
        if "loop" not in skip:
            loops[f"plain transformers loop, one pair at a time ({precision})"] = PlainLoop(
                folder, pairs, args.max_length, precision, args.device)
            if precision == "bf16" and args.device == "cpu" and "loop-cast" not in skip:
                loops["plain transformers loop, matmul weights cast to bf16 once, as the service does"] = PlainLoop(
                    folder, pairs, args.max_length, precision, args.device, cast_once=True)
        pids = [proc.pid for proc, _ in servers.values()]
        # Repeats interleave every setup, so that a slow minute of the shared machine hits all of them alike.
        for repeat in range(1, args.repeats + 1):
            for setup, loop in loops.items():
                with Disturbance(others_than=pids) as d:
                    cell = loop.measure(args.seconds)
                cell.update({"setup": setup, "concurrency": 1, "repeat": repeat, "others": d.fraction})
                results["cells"].append(cell)
                print(json.dumps(cell), flush=True)
            for setup, (proc, url) in servers.items():
                for c in concurrencies:
                    with Disturbance(others_than=pids) as d:
                        cell = drive(url, pairs, c, args.seconds, args.pairs_per_request)
                    cell.update({"setup": setup, "concurrency": c, "repeat": repeat, "others": d.fraction})
                    results["cells"].append(cell)
                    print(json.dumps(cell), flush=True)
    finally:
        for proc, _ in servers.values():
            stop_service(proc)
    print()
    print(f"Command: `{results['command']}`  ")
    print(f"Machine: {results['machine']}  ")
    print(f"Model: {results['model']}; data: {results['data']}; {args.pairs_per_request} pair(s) per request, "
          f"{args.seconds:g} s per cell; batches of up to {args.max_batch_size} pairs, forward passes of "
          f"{args.forward_batch_size} sequences; precision {args.precision}; device {args.device}.")
    print()
    def undisturbed(setup: str, concurrency: int) -> list[dict]:
        return [c for c in results["cells"] if c["setup"] == setup and c["concurrency"] == concurrency
                and c["others"] <= Disturbance.DISTURBED]

    loop_setup = next((c["setup"] for c in results["cells"] if c["setup"].startswith("plain")), None)
    loop_median = median([c["pairs_per_s"] for c in undisturbed(loop_setup, 1)]) if loop_setup else None
    cast_setup = next((c["setup"] for c in results["cells"] if c["setup"].startswith("plain") and "cast" in c["setup"]),
                      None)
    cast_cells = undisturbed(cast_setup, 1) if cast_setup else []
    cast_median = median([c["pairs_per_s"] for c in cast_cells]) if cast_cells else None
    print("Every repeat:\n")
    print("| repeat | setup | clients | pairs/s | p50 ms | p99 ms | requests | errors | other processes |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in results["cells"]:
        print(f"| {c['repeat']} | {c['setup']} | {c['concurrency']} | {c['pairs_per_s']:.1f} | {c['p50_ms']:.1f} | "
              f"{c['p99_ms']:.1f} | {c['requests']} | {c['errors']} | {c['others']:.0%}"
              f"{' disturbed' if c['others'] > Disturbance.DISTURBED else ''} |")
    print("\nMedians of the undisturbed repeats, and over the plain loop's median (and over the loop with the "
          "service's bf16 weights, where it ran):\n")
    print("| setup | clients | pairs/s | over plain loop | over cast loop | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    seen = []
    for c in results["cells"]:
        key = (c["setup"], c["concurrency"])
        if key in seen:
            continue
        seen.append(key)
        cells = undisturbed(*key)
        if not cells:
            print(f"| {key[0]} | {key[1]} | every repeat disturbed | | | | |")
            continue
        rate = median([x["pairs_per_s"] for x in cells])
        ratio = f"{rate / loop_median:.2f}" if loop_median else "-"
        cast_ratio = f"{rate / cast_median:.2f}" if cast_median else "-"
        print(f"| {key[0]} | {key[1]} | {rate:.1f} | {ratio} | {cast_ratio} | {median([x['p50_ms'] for x in cells]):.1f} | "
              f"{median([x['p99_ms'] for x in cells]):.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
