"""Two processes training at once on the same cores, with 2 torch threads each against 1 each, and with
OpenMP's waiting threads spinning as long as libgomp's default, sleeping at once (OMP_WAIT_POLICY=PASSIVE) or
spinning briefly (GOMP_SPINCOUNT=1000) (not a test).

What two pytest-xdist workers on a 2-core machine do when each runs a torch-heavy test: each process runs
MiniLM-L6-shaped BERT training steps (random weights, 16 sequences x 128 tokens, forward + backward + AdamW);
the script times them alone with 2 threads, then two at once with 2 threads each, then two at once with 1
thread each, each setup under the three waits, and prints seconds per step and the pairs' combined steps
per second.

    .venv/bin/python bench/oversubscription.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def one(threads: int, steps: int = 6) -> float:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                                     intermediate_size=1536, num_labels=1))
    x = torch.randint(0, 30000, (16, 128))
    optimizer = torch.optim.AdamW(model.parameters())

    def step():
        model(input_ids=x).logits.sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):  # warm-up
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - started) / steps


WAITS = {"default": {}, "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
         "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"}}


def run(threads: int, processes: int, wait: dict) -> list[float]:
    env = {**{k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}, **wait}
    procs = [subprocess.Popen([sys.executable, __file__, "--one", str(threads)], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(processes)]
    return [float(p.communicate()[0].strip()) for p in procs]


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(one(int(sys.argv[2])))
        return 0
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_common import machine

    print(f"Machine: {machine()}\n")
    print("| setup | waiting threads | s per step, each process | steps/s, all processes |")
    print("|---|---|---|---:|")
    for threads, processes in ((2, 1), (2, 2), (1, 2)):
        for name, wait in WAITS.items():
            times = run(threads, processes, wait)
            print(f"| {processes} process(es) x {threads} thread(s) | {name} | "
                  f"{', '.join(f'{t:.2f}' for t in times)} | {sum(1 / t for t in times):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
