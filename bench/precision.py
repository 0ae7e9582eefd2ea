"""What bf16 costs or saves on this machine, and what `--precision auto` chooses (not a test).

Four parts, each in the same run so that ratios are taken on the same machine state:

    matmul     torch matmul 1024x1024 with this process's threads: GFLOP/s in fp32 and in bf16
    attention  torch's SDPA kernel alone on MiniLM-L6's shape in a training batch (32 sequences x 12 heads x
               160 tokens x 32 dims, a padding mask): milliseconds forward and forward + backward in fp32 and
               in bf16 (median of --steps calls, alternating): why attention runs in fp32 under bf16 autocast on
               a CPU (anchor_rm.model.precision.use_cpu_fp32_attention)
    step       MiniLM-L6 forward + backward + fused AdamW on 16 pairs (32 sequences) x 128 tokens of HH
               helpful-base: seconds per step in fp32, under bf16 autocast (attention in fp32, as the project
               trains), and under bf16 autocast with bf16 attention (transformers' own SDPA); median of
               --steps, after one warm-up step
    smoke      `pipelines/train.py --preset smoke` end to end with --precision auto, fp32 and bf16, each in a
               fresh folder with a fresh MLflow store (no stage reused); the order rotates between repeats

Every repeat is shown. The rule for a disturbed repeat is fixed before the run (bench/bench_common.Disturbance):
if other processes took more than 10% of the machine's CPU while it ran, it is marked "disturbed" and left
out of the medians.

    .venv/bin/python bench/precision.py                       # all four parts, 3 smoke repeats (~5 min native bf16)
    .venv/bin/python bench/precision.py --parts matmul,attention,step   # a minute

A CPU without native bf16 can be imitated on one that has it: torch and oneDNN then dispatch as on an
AVX2-only CPU (bf16 emulated, about 1 GFLOP/s), while fp32 keeps this CPU's own speed. The machine line says
so. bf16 smoke runs take minutes each there, so leave them out:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/precision.py --parts matmul,smoke --precisions auto,fp32
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

PARTS = ("matmul", "attention", "step", "smoke")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS))
    parser.add_argument("--repeats", type=positive_int, default=3, help="smoke runs per precision")
    parser.add_argument("--steps", type=positive_int, default=5, help="training steps (and attention calls) timed per precision")
    parser.add_argument("--precisions", default="auto,fp32,bf16", help="smoke: comma-separated subset of auto,fp32,bf16")
    parser.add_argument("--out", help="also write every measurement as JSON here")
    args = parser.parse_args(argv)
    args.part_list = [p for p in args.parts.split(",") if p]
    unknown = [p for p in args.part_list if p not in PARTS]
    if unknown or not args.part_list:
        parser.error(f"--parts: unknown {unknown or 'empty'}; choose from {', '.join(PARTS)}")
    args.precision_list = [p for p in args.precisions.split(",") if p]
    if not args.precision_list or set(args.precision_list) - {"auto", "fp32", "bf16"}:
        parser.error(f"--precisions: {args.precisions!r}; choose from auto, fp32, bf16")
    return args


def matmul(size: int = 1024, calls: int = 10) -> list[list[str]]:
    import torch

    rows = []
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b
        with Disturbance() as d:
            started = time.perf_counter()
            for _ in range(calls):
                a @ b
            seconds = time.perf_counter() - started
        rows.append([name, f"{2 * size**3 * calls / seconds / 1e9:.1f}", f"{d.fraction:.0%}"])
    return rows


def attention(calls: int) -> tuple[list[list[str]], dict]:
    import torch
    import torch.nn.functional as F

    shape = (32, 12, 160, 32)
    mask = torch.ones(shape[0], 1, 1, shape[2], dtype=torch.bool)
    mask[::2, :, :, 120:] = False  # half the sequences padded, as in a batch of mixed lengths
    inputs = {dtype: [torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3)]
              for dtype in (torch.float32, torch.bfloat16)}
    ms: dict[str, list[float]] = {f"{d} {p}": [] for d in ("fp32", "bf16") for p in ("forward", "forward+backward")}
    for call in range(calls + 1):
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            q, k, v = inputs[dtype]
            with Disturbance() as d:
                started = time.perf_counter()
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                forward = time.perf_counter() - started
                started = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
                both = time.perf_counter() - started
            if call and not d.disturbed:  # call 0 warms up
                ms[f"{name} forward"].append(1e3 * forward)
                ms[f"{name} forward+backward"].append(1e3 * both)
    rows = [[key, f"{median(values):.1f}", str(len(values))] for key, values in ms.items()]
    return rows, ms


def training_step(steps: int) -> tuple[list[list[str]], dict]:
    import torch

    from anchor_rm.data.splits import build_protocol_splits
    from anchor_rm.model.encoding import collate
    from anchor_rm.model.precision import autocast
    from anchor_rm.model.reward_model import load_pretrained
    from anchor_rm.model.scoring import reward_forward

    splits = build_protocol_splits("hh-helpful-base", [], 0, max_pairs={"student_train": 16})
    rm = load_pretrained("minilm-l6", 128, 0)
    encoded = rm.encode(splits.student_train)
    batch = collate(encoded.chosen + encoded.rejected, rm.encoder.pad_token_id)
    optimizer = torch.optim.AdamW(rm.model.parameters(), lr=1e-5, fused=True)
    seconds: dict[str, list[float]] = {"fp32": [], "bf16": [], "bf16, bf16 attention": []}
    rows = []
    attention = rm.model.config._attn_implementation
    for variant in seconds:
        precision = variant.split(",")[0]
        rm.model.set_attn_implementation("sdpa" if variant == "bf16, bf16 attention" else attention)
        for step in range(steps + 1):
            with Disturbance() as d:
                started = time.perf_counter()
                with autocast(precision, "cpu"):
                    rewards = reward_forward(rm.model, batch).logits[:, 0].float()
                (rewards[:16] - rewards[16:]).sigmoid().log().neg().mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                took = time.perf_counter() - started
            if step:  # step 0 warms up
                if not d.disturbed:
                    seconds[variant].append(took)
                rows.append([variant, str(step), f"{took:.3f}", f"{d.fraction:.0%}" + (" disturbed" if d.disturbed else "")])
    return rows, seconds


def smoke(repeats: int, precisions: list[str]) -> tuple[list[list[str]], dict]:
    seconds: dict[str, list[float]] = {p: [] for p in precisions}
    rows = []
    for repeat in range(repeats):
        order = precisions[repeat % len(precisions):] + precisions[: repeat % len(precisions)]
        for precision in order:
            with tempfile.TemporaryDirectory() as tmp, Disturbance() as d:
                started = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, str(ROOT / "pipelines" / "train.py"), "--preset", "smoke", "--precision", precision,
                     "--tracking-uri", f"sqlite:///{tmp}/mlflow.db"],
                    cwd=tmp, capture_output=True, text=True, env={**os.environ, "MLFLOW_TRACKING_URI": ""})
                took = time.perf_counter() - started
            if done.returncode != 0:
                raise SystemExit(f"train.py --precision {precision} failed:\n{done.stderr[-2000:]}")
            resolved = next((line.split("precision auto -> ")[1].split()[0] for line in done.stderr.splitlines()
                             if "precision auto -> " in line), precision)
            if not d.disturbed:
                seconds[precision].append(took)
            rows.append([str(repeat + 1), precision, resolved, f"{took:.1f}",
                         f"{d.fraction:.0%}" + (" disturbed" if d.disturbed else "")])
            print(f"smoke repeat {repeat + 1} --precision {precision} ({resolved}): {took:.1f} s, "
                  f"others {d.fraction:.0%}", flush=True)
    return rows, seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    from anchor_rm.model.precision import resolve_precision

    print(f"machine: {machine()}; --precision auto -> {resolve_precision('auto')}\n", flush=True)
    record: dict = {"machine": machine(), "auto": resolve_precision("auto")}
    if "matmul" in args.part_list:
        rows = matmul()
        record["matmul"] = rows
        print(markdown_table(["dtype", "GFLOP/s (1024x1024 matmul)", "other processes"], rows) + "\n", flush=True)
    if "attention" in args.part_list:
        rows, ms = attention(args.steps)
        record["attention"] = ms
        print(markdown_table(["SDPA kernel", "ms (median)", "undisturbed calls"], rows), flush=True)
        print("\nbf16 / fp32: forward {:.2f}, forward + backward {:.2f}\n".format(
            median(ms["bf16 forward"]) / median(ms["fp32 forward"]),
            median(ms["bf16 forward+backward"]) / median(ms["fp32 forward+backward"])), flush=True)
    if "step" in args.part_list:
        rows, seconds = training_step(args.steps)
        record["step"] = seconds
        print(markdown_table(["precision", "step", "seconds", "other processes"], rows), flush=True)
        fp32, bf16, bf16_attention = (median(seconds[k]) for k in ("fp32", "bf16", "bf16, bf16 attention"))
        print(f"\nMiniLM-L6 training step, median: fp32 {fp32:.3f} s, bf16 {bf16:.3f} s, bf16 with bf16 attention "
              f"{bf16_attention:.3f} s; bf16 / fp32 = {bf16 / fp32:.2f}, bf16 attention / fp32 attention = "
              f"{bf16_attention / bf16:.2f}\n", flush=True)
    if "smoke" in args.part_list:
        rows, seconds = smoke(args.repeats, args.precision_list)
        record["smoke"] = seconds
        print("\n" + markdown_table(["repeat", "--precision", "ran in", "wall s", "other processes"], rows))
        medians = {p: median(v) for p, v in seconds.items()}
        print("\ntrain.py --preset smoke, medians of undisturbed repeats: "
              + ", ".join(f"{p} {m:.1f} s" for p, m in medians.items())
              + "".join(f"; auto / {p} = {medians['auto'] / medians[p]:.2f}" for p in ("bf16", "fp32")
                        if "auto" in medians and p in medians)
              + f" (auto ran {record['auto']})")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
