"""The memory plan (anchor_rm/method/memory_plan.py) against measured peaks on CPU (not a test).

Each case trains a few steps in a fresh Python process and reports its peak resident memory (ru_maxrss: the
whole process, as the plan's `overhead` counts it), beside the plan's estimate for the same model, batch,
length, LoRA rank and checkpointing. A ratio near 1 means the plan can be trusted to refuse what will not fit.

    .venv/bin/python bench/memory_plan.py                      # MiniLM-L6 and SmolLM2-135M, full and LoRA
    .venv/bin/python bench/memory_plan.py --cases minilm-full,minilm-lora --steps 2

Prints a Markdown table (docs/scaling.md); --out also writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# name: (model, pairs per step, max length, lora rank, activation checkpointing, anchor)
CASES = {
    "minilm-full": ("minilm-l6", 8, 128, 0, False, True),
    "minilm-full-ckpt": ("minilm-l6", 8, 128, 0, True, True),
    "minilm-lora": ("minilm-l6", 8, 128, 16, False, True),
    "smollm2-full": ("smollm2-135m", 4, 128, 0, False, True),
    "smollm2-lora": ("smollm2-135m", 4, 128, 16, False, True),
    "smollm2-lora-ckpt": ("smollm2-135m", 4, 128, 16, True, True),
}


def _child(case: str, steps: int, precision: str) -> dict:
    import time

    import torch

    from anchor_rm.data.records import PreferencePair
    from anchor_rm.method.stages import frozen_reference
    from anchor_rm.method.training import TrainConfig, train_reward_model
    from anchor_rm.model.reward_model import load_pretrained

    torch.set_num_threads(2)
    model, pairs, length, rank, checkpointing, anchor = CASES[case]
    rm = load_pretrained(model, length, seed=0, lora_rank=rank)
    text = "a long answer that goes on " * 40
    data = [PreferencePair(f"question {i} " * 8, f"good {i} " + text, f"bad {i} " + text, "bench")
            for i in range(pairs * steps)]
    encoded = rm.encode(data)
    config = TrainConfig(method="anchor" if anchor else "naive", anchor_lambda=0.1, anchor_layers="last", epochs=1,
                         batch_size=pairs, learning_rate=1e-4, max_length=length, precision=precision,
                         lora_rank=rank, activation_checkpointing=checkpointing)
    reference = frozen_reference(model) if anchor and not rank else None
    started = time.perf_counter()
    train_reward_model(rm.model, encoded, [0.7] * len(encoded), config, reference=reference,
                       pad_token_id=rm.encoder.pad_token_id)
    return {"case": case, "seconds_per_step": (time.perf_counter() - started) / steps,
            "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "tokens_per_sequence": max(len(e.input_ids) for e in encoded.chosen + encoded.rejected)}


def _estimate(case: str, precision: str) -> dict:
    from anchor_rm.method.memory_plan import model_shape, plan_memory
    from anchor_rm.model.reward_model import load_pretrained

    model, pairs, length, rank, checkpointing, anchor = CASES[case]
    config = load_pretrained(model, length, seed=0).model.config
    plan = plan_memory(model_shape(config), batch_size=pairs, max_length=length, lora_rank=rank, anchor=anchor,
                       activation_checkpointing=checkpointing, precision=precision)
    return plan.to_dict()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.steps, args.precision)))
        return 0
    from anchor_rm.model.precision import cpu_model

    rows = []
    for case in args.cases.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", case, "--steps", str(args.steps),
                              "--precision", args.precision], capture_output=True, text=True, check=True)
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({**measured, "plan": _estimate(case, args.precision)})
    print(f"CPU: {cpu_model()}; precision {args.precision}; {args.steps} steps per case\n")
    print("| case | trained / all parameters | plan GiB | measured peak GiB | measured / plan | s per step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        plan = r["plan"]
        print(f"| {r['case']} | {plan['trainable_parameters']:,} / {plan['parameters']:,} | {plan['total'] / 2**30:.2f} | "
              f"{r['peak_bytes'] / 2**30:.2f} | {r['peak_bytes'] / plan['total']:.2f} | {r['seconds_per_step']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
