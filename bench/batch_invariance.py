"""How much a response's reward depends on what else is scored with it, per precision, with each batch padded to
its longest sequence (dynamic) and with the width buckets scoring uses (anchor_rm/model/scoring.py, WIDTH_BUCKET), and
what the buckets cost.

    .venv/bin/python bench/batch_invariance.py                       # MiniLM-L6, fp32 and bf16
    .venv/bin/python bench/batch_invariance.py --model smollm2-135m --repeats 3

For each precision and each padding plan (dynamic: a batch padded to its longest; buckets: each sequence to its
own multiple of WIDTH_BUCKET tokens, batched only with its width), 48 prompt-response texts of 10-200 tokens:
- the largest |reward alone - reward in one call with all 48| and |alone - in a call with one other text|;
- the seconds to score all 48 in one call (batch size 8, one thread), every repeat shown; the buckets' cost is
  the ratio of the two plans' medians, measured in the same run.
bf16 on a CPU without native bf16 is emulated (several times slower than fp32): its times say nothing about a CPU
with AVX512-BF16 or AMX, only its differences do. The CPU is printed with the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from anchor_rm.model.precision import cpu_model
from anchor_rm.model.reward_model import load_pretrained
from anchor_rm.model.scoring import WIDTH_BUCKET, RewardScorer


def texts(n: int) -> list[tuple[str, str]]:
    return [(f"Question {i}: how should I handle situation number {i} at work?",
             ("Here is a careful answer with a reason. " * (1 + (7 * i) % 23)) + f"Item {i}.") for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rm = load_pretrained(args.model, 256, 0)
    rm.model.eval()
    items = texts(48)
    prompts, responses = [p for p, _ in items], [r for _, r in items]
    print(f"{args.model} on {cpu_model()}, torch {torch.__version__}, 1 thread; WIDTH_BUCKET {WIDTH_BUCKET}", flush=True)
    for precision in ("fp32", "bf16"):
        medians = {}
        for plan, invariant in (("dynamic", False), ("buckets", True)):
            scorer = RewardScorer(rm.model, rm.encoder, 8, precision, batch_invariant=invariant)
            alone = np.array([scorer.score([p], [r]).rewards[0] for p, r in items])
            together = scorer.score(prompts, responses).rewards
            with_one = np.array([scorer.score([items[i][0], items[-1 - i][0]], [items[i][1], items[-1 - i][1]]).rewards[0]
                                 for i in range(len(items))])
            seconds = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                scorer.score(prompts, responses)
                seconds.append(time.perf_counter() - started)
            medians[plan] = statistics.median(seconds)
            print(f"  {precision} {plan:7s}: max |alone - all 48 together| {np.abs(alone - together).max():.2e}, "
                  f"max |alone - with one other| {np.abs(alone - with_one).max():.2e} (rewards up to "
                  f"{np.abs(alone).max():.2f}); 48 texts in {', '.join(f'{s:.2f}' for s in seconds)} s", flush=True)
        print(f"  {precision}: buckets / dynamic time {medians['buckets'] / medians['dynamic']:.2f}x (medians)", flush=True)


if __name__ == "__main__":
    main()
