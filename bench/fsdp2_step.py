"""FSDP2 training steps on every GPU of a machine (or CPU workers over gloo), naive W2S and ANCHOR, with the figures
a GPU run must report: pairs/s, ANCHOR's epoch over naive, peak memory per device, beside the memory plan (not a
test). Run under torchrun, one process per device:

    torchrun --nproc_per_node 8 bench/fsdp2_step.py --student Qwen/Qwen2.5-7B --pairs 256 --max-length 1024
    torchrun --nproc_per_node 2 bench/fsdp2_step.py --device cpu --student minilm-l6 --pairs 16 --max-length 64

Each variant trains the student from its pretrained weights on the same synthetic pairs (one epoch) with
TrainConfig.strategy = "fsdp2"; ANCHOR's frozen reference is a second, sharded copy (full fine-tuning) or the
student with its adapters off (--lora-rank). Rank 0 prints one JSON line and, with --out, writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", default="smollm2-135m")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="pairs per step over all workers")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    p.add_argument("--out")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    import torch
    import torch.distributed as dist

    from anchor_rm.data.records import PreferencePair
    from anchor_rm.method.memory_plan import model_shape, plan_memory
    from anchor_rm.method.stages import load_student
    from anchor_rm.method.training import TrainConfig, train_reward_model
    from anchor_rm.model.precision import resolve_precision
    from anchor_rm.model.sharded import load_pretrained_sharded

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    precision = resolve_precision(args.precision, args.device)  # for the device the workers train on
    text = "an answer that goes on for a while " * 60
    pairs = [PreferencePair(f"question {i} " * 10, f"good {i} " + text, f"bad {i} " + text, "bench")
             for i in range(args.pairs)]
    result = {"student": args.student, "device": args.device, "workers": world, "precision": precision,
              "pairs": args.pairs, "batch_size": args.batch_size, "max_length": args.max_length,
              "lora_rank": args.lora_rank, "activation_checkpointing": args.activation_checkpointing,
              "peak_measure": "torch.cuda.max_memory_allocated" if args.device == "cuda" else "peak RSS of the worker process",
              "variants": {}}
    for method in ("naive", "anchor"):
        config = TrainConfig(method=method, anchor_lambda=0.1 if method == "anchor" else 0.0, epochs=1,
                             batch_size=args.batch_size, learning_rate=1e-5, max_length=args.max_length,
                             precision=precision, lora_rank=args.lora_rank, strategy="fsdp2",
                             activation_checkpointing=args.activation_checkpointing)
        rm = load_student(args.student, config, device=device)  # loaded sharded: meta, shard, rank 0's weights
        encoded = rm.encode(pairs)
        reference = (load_pretrained_sharded(args.student, device, precision=precision).eval()
                     if method == "anchor" and not args.lora_rank else None)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        started = time.perf_counter()
        train_reward_model(rm.model, encoded, [0.7] * len(encoded), config, reference=reference,
                           pad_token_id=rm.encoder.pad_token_id)
        dist.barrier()
        seconds = time.perf_counter() - started
        # a GPU's allocator peak; on a CPU the worker process's peak RSS (since it started: an upper bound)
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) if args.device == "cuda"
                             else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
        peaks = [torch.zeros_like(peak) for _ in range(world)]
        dist.all_gather(peaks, peak)
        result["variants"][method] = {"seconds": round(seconds, 2), "pairs_per_s": round(len(encoded) / seconds, 2),
                                      "peak_memory_gib_per_device": [round(float(x) / 2**30, 2) for x in peaks]}
        plan = plan_memory(model_shape(rm.model.config), batch_size=args.batch_size, max_length=args.max_length,
                           lora_rank=args.lora_rank, anchor=method == "anchor",
                           activation_checkpointing=args.activation_checkpointing, strategy="fsdp2", workers=world,
                           device=args.device, precision=precision)
        result["variants"][method]["plan_gib_per_device"] = round(plan.total / 2**30, 2)
        del rm, reference
    result["anchor_over_naive"] = round(result["variants"]["anchor"]["seconds"] / result["variants"]["naive"]["seconds"], 3)
    if rank == 0:
        print(json.dumps(result))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
