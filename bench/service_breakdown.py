"""Where a lone /score request's time goes (not a test): the service at one client against a plain loop.

One client sends one pair per request and waits, as bench_service.py's 1-client cell does. Measured in one
run, interleaved over `--repeats` rounds, each row the median per request:

  plain loop       bench_service.PlainLoop: tokenizer + AutoModelForSequenceClassification, one pair
  scorer           the service's own scoring path (service.holder.load_served_model, loaded in a thread that
                   ends, then ServedModel.score on one dedicated thread, as the service's batcher does): no HTTP
  GET /livez       a round trip through `bentoml serve` that touches no model: the HTTP floor
  POST /score      the full request

and the CPU each side spends per /score request: the client thread's (time.thread_time) and the service's
processes' (from /proc), so that what the client takes from the shared cores is visible.

The plain loop and the scorer each run in a child process of their own, started for each round, as the
service has its own process. An earlier version ran both in this process, which registers the model on its
main thread, so that two threads had run torch operations: it read the plain loop at 18.3 ms per pair where
bench_service.py, whose process runs torch on one thread only, read 11.4 minutes later (M1, 2026-12-06).
The likely cause: torch's OpenMP pool is per thread, and with more pool threads than cores libgomp stops
spinning between parallel regions, as OMP_WAIT_POLICY=PASSIVE makes it do (about as slow).

    .venv/bin/python bench/service_breakdown.py                   # MiniLM-L6, 3 rounds x 300 requests (~3 min)
    .venv/bin/python bench/service_breakdown.py --model tiny --requests 100 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_common import _tree_seconds, load_pairs, register_versions, service_machine, stop_service
from bench_service import NAME, PlainLoop, serve, warm_up

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minilm-l6", help="minilm-l6 or tiny (bench_common.bench_reward_model)")
    parser.add_argument("--max-length", type=int, default=192)
    parser.add_argument("--requests", type=int, default=300, help="requests per row and round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--child", choices=["plain loop", "scorer"], help=argparse.SUPPRESS)  # one row's process
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    parser.add_argument("--downloads", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("max_length", "requests", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected at least 1")
    return args


def child(kind: str, folder: str, uri: str, downloads: str, requests: int, max_length: int, precision: str) -> None:
    """One row measured in this (child) process: prints its per-request seconds as JSON on stdout's last line."""
    import json
    import os

    pairs = load_pairs()
    if kind == "plain loop":
        from anchor_rm.model.precision import resolve_precision

        loop = PlainLoop(Path(folder), pairs, max_length, resolve_precision(precision, "cpu"))  # warmed on every pair
        times = per_request(lambda i: loop._score(*pairs[i % len(pairs)]), requests)
    else:
        from service.holder import in_fresh_thread, load_served_model

        os.environ["MLFLOW_TRACKING_URI"] = uri
        served = in_fresh_thread(lambda: load_served_model(f"models:/{NAME}/1", Path(downloads), batch_size=8,
                                                           precision=precision, device="cpu"))
        scoring_thread = ThreadPoolExecutor(max_workers=1)  # as the service's batcher: one dedicated thread
        for p, r in pairs:  # warm-up: every pair once
            scoring_thread.submit(served.score, [p], [r]).result()
        times = per_request(lambda i: scoring_thread.submit(served.score, [pairs[i % len(pairs)][0]],
                                                            [pairs[i % len(pairs)][1]]).result(), requests)
        scoring_thread.shutdown()
    print(json.dumps(times))


def in_child(kind: str, folder: Path, uri: str, downloads: Path, args: argparse.Namespace) -> list[float]:
    import json
    import subprocess

    done = subprocess.run([sys.executable, __file__, "--child", kind, "--folder", str(folder), "--uri", uri,
                           "--downloads", str(downloads), "--requests", str(args.requests),
                           "--max-length", str(args.max_length), "--precision", args.precision],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the {kind} child failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def per_request(fn, n: int) -> list[float]:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    import httpx
    import torch

    from anchor_rm.model.precision import resolve_precision

    args = parse_args(argv)
    if args.child:
        child(args.child, args.folder, args.uri, args.downloads, args.requests, args.max_length, args.precision)
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="anchor-rm-breakdown-"))
    from anchor_rm.model.loading import ModelError

    try:
        uri, folders = register_versions(workdir, args.model, args.max_length, NAME, (0,), "bench-breakdown")
    except ModelError as exc:
        raise SystemExit(f"--model {args.model}: {exc}") from None
    folder = next(iter(folders.values()))
    pairs = load_pairs()
    precision = resolve_precision(args.precision, "cpu")
    proc, url = serve(workdir, True, 32, args.precision)
    try:
        warm_up(url, pairs)
        http = httpx.Client(base_url=url, timeout=300)
        rows: dict[str, list[float]] = {"plain loop": [], "scorer": [], "GET /livez": [], "POST /score": []}
        client_cpu, server_cpu = [], []

        def post(i: int) -> None:
            p, r = pairs[i % len(pairs)]
            http.post("/score", json={"items": [{"prompt": p, "response": r}]}).raise_for_status()

        for _ in range(args.repeats):
            rows["plain loop"] += in_child("plain loop", folder, uri, workdir / "dl", args)
            rows["scorer"] += in_child("scorer", folder, uri, workdir / "dl", args)
            rows["GET /livez"] += per_request(lambda i: http.get("/livez").raise_for_status(), args.requests)
            server0, client0 = _tree_seconds(proc.pid), time.thread_time()
            rows["POST /score"] += per_request(post, args.requests)
            client_cpu.append((time.thread_time() - client0) / args.requests)
            server_cpu.append((_tree_seconds(proc.pid) - server0) / args.requests)
        http.close()
    finally:
        stop_service(proc)
    print(f"Command: `python bench/service_breakdown.py {' '.join(sys.argv[1:] if argv is None else argv)}`  ")
    print(f"Machine: {service_machine()}; torch threads {torch.get_num_threads()}; precision {args.precision} -> "
          f"{precision}; model {args.model}, max length {args.max_length}; {args.repeats} rounds x "
          f"{args.requests} requests, one client, one pair per request.\n")
    print("| row | p50 ms | mean ms | over plain loop (p50) |")
    print("|---|---:|---:|---:|")
    base = statistics.median(rows["plain loop"])
    for name, times in rows.items():
        print(f"| {name} | {1000 * statistics.median(times):.2f} | {1000 * statistics.mean(times):.2f} | "
              f"{statistics.median(times) / base:.2f} |")
    print(f"\nCPU per /score request: client thread {1000 * statistics.median(client_cpu):.2f} ms, service processes "
          f"{1000 * statistics.median(server_cpu):.2f} ms (medians of the rounds: "
          f"{', '.join(f'{1000 * c:.2f}' for c in client_cpu)} / {', '.join(f'{1000 * s:.2f}' for s in server_cpu)}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
