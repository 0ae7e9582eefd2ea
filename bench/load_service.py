"""Bounded load test of the reward service (docs/reliability.md), not a unit test.

Registers two versions of a reward model in a temporary MLflow store (champion on version 1), starts a real
`bentoml serve` on 127.0.0.1 with an API key, then:

1. steady load: `--concurrency` clients (64) post /score back to back for `--seconds` (60);
2. the same load for `--alias-seconds` (60) while the champion alias moves between the two versions every
   `--move-every` seconds (each move followed by an authenticated POST /reload).

Every response is counted by status code. The only acceptable non-200 answer is 503, the service's documented
backpressure (a request queued for the model longer than ANCHOR_RM_MAX_LATENCY_MS);
anything else, a transport error included, is a failure. The server's resident memory (the whole `bentoml
serve` process tree) is sampled every 5 s. Exit status 1 when there is any failure.

    .venv/bin/python bench/load_service.py                        # MiniLM-L6, 64 clients, 60 s + 60 s
    .venv/bin/python bench/load_service.py --model tiny --seconds 10 --alias-seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
NAME = "anchor-rm-harmless"  # the name the service serves by default (ANCHOR_RM_MODEL_URI is not set)
API_KEY = "load-test-key"
BACKPRESSURE = {503}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minilm-l6", help="minilm-l6 (pretrained, fresh reward head) or tiny "
                                                            "(a 2-layer 32-wide random BERT)")
    parser.add_argument("--max-length", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0, help="steady load")
    parser.add_argument("--alias-seconds", type=float, default=60.0, help="load while the alias moves; 0: skip")
    parser.add_argument("--move-every", type=float, default=10.0)
    parser.add_argument("--poll-seconds", type=float, default=5.0, help="ANCHOR_RM_POLL_SECONDS of the service")
    parser.add_argument("--out", help="also write the figures as JSON here")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# Setup.

# ---------------------------------------------------------------------------------------------------
# Measuring.

def tree_rss_mb(pid: int) -> float:
    """Resident memory of `pid` and all its descendants (bentoml serve, its arbiter and its workers), MB."""
    from bench_common import process_tree

    rss_kb = 0
    for member in process_tree(pid):
        try:
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kb += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return rss_kb / 1024


class Tally:
    def __init__(self) -> None:
        self.codes: Counter = Counter()
        self.versions: Counter = Counter()
        self.failures: list[str] = []
        self.transport_errors = 0  # failures without an HTTP answer (connection reset, closed, timed out)
        self.latencies: list[float] = []
        self.lock = threading.Lock()

    def summary(self, seconds: float) -> dict:
        ordered = sorted(self.latencies)

        def pct(q: float) -> float:
            return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else float("nan")

        ok = self.codes.get(200, 0)
        return {"requests": sum(self.codes.values()), "ok": ok, "status_codes": {str(k): v for k, v in sorted(self.codes.items(), key=str)},
                "backpressure": sum(v for k, v in self.codes.items() if k in BACKPRESSURE),
                "failures": len(self.failures), "transport_errors": self.transport_errors,
                "failure_examples": self.failures[:5],
                "versions_seen": dict(self.versions), "requests_per_s": round(ok / seconds, 1),
                "p50_ms": pct(0.5), "p99_ms": pct(0.99), "seconds": round(seconds, 1)}


async def _client(http, pairs, worker: int, deadline: float, tally: Tally) -> None:
    i = worker * 7
    while time.monotonic() < deadline:
        prompt, response = pairs[i % len(pairs)]
        i += 1
        started = time.monotonic()
        try:
            r = await http.post("/score", json={"items": [{"prompt": prompt, "response": response}]})
        except Exception as exc:  # a transport error is a failure: the server dropped or refused the connection
            chain, cause = [], exc
            while cause is not None and len(chain) < 5:
                chain.append(f"{type(cause).__module__}.{type(cause).__name__}: {cause}")
                cause = cause.__cause__ or cause.__context__
            tally.failures.append(f"{' <- '.join(chain)} after {time.monotonic() - started:.1f} s"[:500])
            tally.transport_errors += 1
            continue
        tally.codes[r.status_code] += 1
        if r.status_code == 200:
            tally.latencies.append(time.monotonic() - started)
            tally.versions[r.json()["model"]["version"]] += 1
        elif r.status_code not in BACKPRESSURE:
            tally.failures.append(f"{r.status_code}: {r.text[:200]}")


async def _load(url: str, pairs, concurrency: int, seconds: float, tally: Tally, api_key: str) -> float:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": api_key}, timeout=300, limits=limits) as http:
        started = time.monotonic()
        await asyncio.gather(*(_client(http, pairs, w, started + seconds, tally) for w in range(concurrency)))
        return time.monotonic() - started


def drive(url: str, pairs, concurrency: int, seconds: float, server_pid: int | None = None,
          during=None, api_key: str = API_KEY) -> tuple[dict, list[tuple[float, float]]]:
    """`concurrency` clients for `seconds`; `during(stop_event)` runs in a thread meanwhile (alias moves).
    Returns the tally's summary and (time, server RSS MB) samples every 5 s."""
    tally, samples, stop = Tally(), [], threading.Event()
    started = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            samples.append((round(time.monotonic() - started, 1), round(tree_rss_mb(server_pid), 1)))
            stop.wait(5)

    threads = [threading.Thread(target=sample)] if server_pid else []
    if during is not None:
        threads.append(threading.Thread(target=during, args=(stop,)))
    for t in threads:
        t.start()
    try:
        elapsed = asyncio.run(_load(url, pairs, concurrency, seconds, tally, api_key))
    finally:
        stop.set()
        for t in threads:
            t.join()
    if server_pid:
        samples.append((round(time.monotonic() - started, 1), round(tree_rss_mb(server_pid), 1)))
    return tally.summary(elapsed), samples


def alias_mover(url: str, every: float, moves: list, api_key: str = API_KEY):
    """Moves champion 1 -> 2 -> 1 ... every `every` seconds, each time followed by POST /reload."""
    import httpx
    from mlflow.tracking import MlflowClient

    def run(stop: threading.Event) -> None:
        version = "1"
        with httpx.Client(base_url=url, headers={"X-API-Key": api_key}, timeout=300) as http:
            while not stop.wait(every):
                version = "2" if version == "1" else "1"
                MlflowClient().set_registered_model_alias(NAME, "champion", version)
                reloaded = http.post("/reload").json()
                moves.append({"to": version, "served": reloaded.get("current_version"), "error": reloaded.get("error")})
    return run


def main(argv=None) -> int:
    from bench_common import load_pairs, register_versions, service_machine, start_service, stop_service

    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="anchor-rm-load-"))
    print(f"workdir {workdir}", flush=True)
    uri, _ = register_versions(workdir, args.model, args.max_length, NAME, (0, 1), "load-test")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    pairs = load_pairs()
    proc, url = start_service(workdir, {
        "MLFLOW_TRACKING_URI": uri, "ANCHOR_RM_API_KEY": API_KEY, "ANCHOR_RM_POLL_SECONDS": str(args.poll_seconds),
        "ANCHOR_RM_DOWNLOAD_DIR": str(workdir / "downloads")})
    results = {"command": "python bench/load_service.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "machine": service_machine(), "model": f"{args.model}, max length {args.max_length}",
               "concurrency": args.concurrency}
    try:
        results["rss_mb_after_start"] = round(tree_rss_mb(proc.pid), 1)
        drive(url, pairs, 8, 5)  # warm-up: the batching dispatcher fits its latency model on the first calls
        steady, samples = drive(url, pairs, args.concurrency, args.seconds, proc.pid)
        results["steady"] = {**steady, "rss_mb_samples": samples}
        print(json.dumps({"steady": results["steady"]}), flush=True)
        if args.alias_seconds > 0:
            moves: list = []
            moving, samples = drive(url, pairs, args.concurrency, args.alias_seconds, proc.pid,
                                    during=alias_mover(url, args.move_every, moves))
            results["alias_moves"] = {**moving, "moves": moves, "rss_mb_samples": samples}
            print(json.dumps({"alias_moves": results["alias_moves"]}), flush=True)
    finally:
        stop_service(proc)
    failures = results["steady"]["failures"] + results.get("alias_moves", {}).get("failures", 0)
    print()
    print(f"Command: `{results['command']}`  ")
    print(f"Machine: {results['machine']}  ")
    print(f"Model: {results['model']}; {args.concurrency} concurrent clients, one pair per /score request.")
    print()
    print("| phase | seconds | requests | 200 | 503 (backpressure) | failures | req/s | p50 ms | p99 ms | "
          "server RSS MB start -> end |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, key in (("steady load", "steady"), ("alias moving", "alias_moves")):
        if key in results:
            c = results[key]
            rss = c["rss_mb_samples"]
            print(f"| {label} | {c['seconds']} | {c['requests']} | {c['ok']} | {c['backpressure']} | {c['failures']} | "
                  f"{c['requests_per_s']} | {c['p50_ms']} | {c['p99_ms']} | {rss[0][1]} -> {rss[-1][1]} |")
    if "alias_moves" in results:
        print(f"\nalias moves: {results['alias_moves']['moves']}; versions seen: "
              f"{results['alias_moves']['versions_seen']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
