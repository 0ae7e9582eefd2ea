"""The anchor term's scale for a student, before choosing lambda (not a test): lambda is not portable, since the anchor
loss is a mean over the hidden units of whatever model and layer it reads (MiniLM-L6's 384 small units, SmolLM2's
576 after its final norm), so a lambda tuned for one student says nothing for another.

Runs the calibration tune.py runs before its search (anchor_rm/method/lambda_scale.py: calibrate_lambda) on the default
protocol's split, the teacher's labels replaced by a fixed q (the scale of the drift, not its direction, is
measured): --steps naive W2S steps, then on one batch lambda_grad = |grad W2S loss| / |grad anchor loss| at each
layer choice (the anchor loss against the student's own pretrained states), and the drift on the probe's 64
student-train pairs. The search spans lambda_grad x 1e-4 .. x 1; what each lambda removes of naive W2S's drift is
measured after training (tune.py's report, the study's drift columns).

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
    p.add_argument("--layers", default="last;middle", help="layer choices separated by ';': last, middle or a list "
                                                                 "like 2,4 (default last;middle)")
    p.add_argument("--steps", type=int, default=8, help="naive W2S steps before the drift is measured (default 8)")
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
    from anchor_rm.method.lambda_scale import calibrate_lambda
    from anchor_rm.method.stages import load_student
    from anchor_rm.method.training import TrainConfig
    from anchor_rm.model.precision import driver_device_type, resolve_precision
    from anchor_rm.pipeline.config import preset
    from anchor_rm.pipeline.experiment import build_splits

    cfg = preset("default", args.category)
    cfg.seed = args.seed
    pairs = build_splits(cfg).student_train
    precision = resolve_precision(args.precision, driver_device_type())
    config = TrainConfig(method="naive", epochs=1, batch_size=args.batch_size, learning_rate=args.learning_rate,
                         max_length=args.max_length, seed=args.seed, precision=precision, lora_rank=args.lora_rank,
                         lora_alpha=args.lora_alpha, lora_learning_rate=args.lora_learning_rate, length_grouped=False)
    choices = [choice.strip() for choice in args.layers.split(";")]
    started = time.perf_counter()
    found = calibrate_lambda(load_student(args.student, config), pairs, [args.q] * len(pairs), config, choices,
                             steps=args.steps)
    seconds = time.perf_counter() - started
    result = {"student": args.student, "lora_rank": args.lora_rank, "batch_size": args.batch_size,
              "learning_rate": args.learning_rate, "lora_learning_rate": args.lora_learning_rate, "precision": precision,
              **found.to_dict(), "seconds": round(seconds, 1), "machine": machine()}
    print(f"{found.describe()}\ndrift after {found.steps} steps of {args.batch_size} pairs: "
          + ", ".join(f"{c} {v:.3g}" for c, v in found.drift.items()) + f"; W2S loss {found.w2s_loss:.4f}; "
          f"{args.student}{f' LoRA r{args.lora_rank}' if args.lora_rank else ''}, {precision}, {seconds:.0f} s; "
          f"{machine()}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
