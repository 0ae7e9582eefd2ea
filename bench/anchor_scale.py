"""The anchor term's scale for a student, before choosing lambda (not a test): lambda is not portable, since the anchor
loss is a mean over the hidden units of whatever model and layer it reads (MiniLM-L6's 384 small units, SmolLM2's
576 after its final norm), so a lambda tuned for one student says nothing for another.

Trains the student as naive W2S would (the default protocol's harmless split, the teacher's calibrated labels
replaced by a fixed q: the scale of the drift, not its direction, is measured) for --steps steps, logging at every
step the anchor loss it would add (lambda 1e-30: computed, not applied) and the W2S loss. Prints the anchor loss
per step and lambda_balance = W2S loss / anchor loss at the last step: the lambda at which the anchor term equals
the W2S term once naive training has drifted that far. A search spanning lambda_balance x 1e-2 .. x 1e2 goes from
nearly naive to nearly frozen features; what it removes of naive W2S's drift is measured after training, not
assumed (the study's drift columns).

    .venv/bin/python bench/anchor_scale.py --student smollm2-135m --lora-rank 16 --lora-alpha 32 --lora-learning-rate 1e-3
    .venv/bin/python bench/anchor_scale.py --student minilm-l6 --learning-rate 1e-4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench_common import machine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--student", default="smollm2-135m")
    p.add_argument("--category", choices=["helpful", "harmless"], default="harmless")
    p.add_argument("--layers", default="last", help="anchor layers: last, middle or a list")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-learning-rate", type=float)
    p.add_argument("--q", type=float, default=0.7, help="the soft label every pair trains on (default 0.7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    p.add_argument("--out", help="also write the figures as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from anchor_rm.config import preset
    from anchor_rm.experiment import build_splits
    from anchor_rm.precision import driver_device_type, resolve_precision
    from anchor_rm.splits import subsample
    from anchor_rm.training import TrainConfig
    from anchor_rm.workflow import frozen_reference, load_student, train_on_pairs

    cfg = preset("default", args.category)
    cfg.seed = args.seed
    splits = build_splits(cfg)
    pairs = subsample(splits.student_train, args.steps * args.batch_size, args.seed, "anchor-scale")
    precision = resolve_precision(args.precision, driver_device_type())
    config = TrainConfig(method="anchor", anchor_lambda=1e-30, anchor_layers=args.layers, epochs=1,
                         batch_size=args.batch_size, learning_rate=args.learning_rate, max_length=args.max_length,
                         seed=args.seed, precision=precision, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                         lora_learning_rate=args.lora_learning_rate, warmup_fraction=0.0, length_grouped=False)
    rm = load_student(args.student, config)
    reference = None if args.lora_rank else frozen_reference(args.student, next(rm.model.parameters()).device)
    logs = []
    started = time.perf_counter()
    train_on_pairs(rm, pairs, [args.q] * len(pairs), config, reference=reference, on_step=logs.append)
    seconds = time.perf_counter() - started
    last = logs[-1]
    balance = last.w2s_loss / last.anchor_loss if last.anchor_loss > 0 else float("inf")
    result = {"student": args.student, "lora_rank": args.lora_rank, "layers": args.layers, "steps": len(logs),
              "batch_size": args.batch_size, "learning_rate": args.learning_rate,
              "lora_learning_rate": args.lora_learning_rate, "precision": precision,
              "anchor_loss_per_step": [log.anchor_loss for log in logs], "w2s_loss_per_step": [log.w2s_loss for log in logs],
              "lambda_balance": balance, "seconds": round(seconds, 1), "machine": machine()}
    print("step  w2s loss  anchor loss")
    for log in logs:
        print(f"{log.step:>4}  {log.w2s_loss:.4f}    {log.anchor_loss:.3e}")
    print(f"\nlambda_balance = {balance:.3g} (W2S {last.w2s_loss:.4f} / anchor {last.anchor_loss:.3e} after {len(logs)} "
          f"steps of {args.batch_size} pairs); {args.student}{f' LoRA r{args.lora_rank}' if args.lora_rank else ''}, "
          f"layers {args.layers}, {precision}, {seconds:.0f} s; {machine()}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
