"""The GPU path in one command (not a test): the main job, ANCHOR's cost and the service on a CUDA GPU.

    .venv/bin/python bench/gpu_path.py                                   # SmolLM2-135M on the first GPU, bf16
    .venv/bin/python bench/gpu_path.py --student Qwen/Qwen2.5-0.5B       # any hub id, where there is a network
    .venv/bin/python bench/gpu_path.py --device cpu --student minilm-l6 --quick   # the same steps on a CPU
    .venv/bin/python bench/gpu_path.py --dry-run                         # print the steps' commands only

Seven steps, each a subprocess of the project's own commands, its output kept under --out:

1. `pipelines/tune.py --preset smoke` with the student, `--use-gpu yes` and the precision (bf16 on a GPU
   that has it): Ray Train sets up its process group with nccl on GPU workers. Reported: wall time, and
   per trial, from its MLflow run, the process-group backend, the peak GPU memory of its worker
   (`worker/peak_vram_mb`) and its peak RSS. The shared stages (teacher, ceiling, soft labels, evaluation)
   run in the driver process, on its CPU (docs/scaling.md).
2. `bench/anchor_cost.py` on the device: ANCHOR (reference states in RAM, on disk, or the live reference)
   over naive W2S, per epoch, every repeat.
3. `bench/bench_service.py` with the service on the device (ANCHOR_RM_DEVICE) and batching on, at 1 and 32
   clients, beside the plain transformers loop on the same device.
4. `tune.py --dry-run --lora-rank 16`: the memory plan of a LoRA student, to read beside step 5's peak VRAM.
5. The tune run of step 1 with a LoRA student (rank 16; ANCHOR's reference is the student with its adapters
   off); its trials' peak VRAM and RSS are in the same table.
6. `bench/fsdp2_step.py` under torchrun, one process per GPU: naive and ANCHOR epochs with FSDP2, pairs/s,
   ANCHOR over naive, peak memory per device beside the plan's (fsdp2.json).
7. The same with a LoRA student (rank 16) sharded over the devices (fsdp2_lora.json).

Writes summary.md (what docs/benchmarks.md takes) and summary.json under --out. `--quick` shrinks every step
(fewer pairs, epochs, repeats and seconds) to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", default="smollm2-135m", help="short name, folder or hub id")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (to check the script on a CPU)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="auto: bf16 where the device computes it natively (a CUDA GPU with bf16)")
    parser.add_argument("--out", default="gpu-path", help="folder for every step's output and the summary")
    parser.add_argument("--quick", action="store_true", help="small sizes everywhere: a check, not a measurement")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    return parser.parse_args(argv)


def steps(args: argparse.Namespace, out: Path) -> dict[str, list[str]]:
    """Each step's command line (a list of arguments), by step name."""
    gpu = args.device.startswith("cuda")
    tune = [PYTHON, str(ROOT / "pipelines" / "tune.py"), "--preset", "smoke", "--student", args.student,
            "--precision", args.precision, "--use-gpu", "yes" if gpu else "no", "--tracking-uri",
            f"sqlite:///{out / 'mlflow.db'}", "--storage-path", str(out / "ray"), "--name", "gpu-path"]
    if args.quick:
        tune += ["--num-samples", "1", "--epochs", "1"]
    cost = [PYTHON, str(ROOT / "bench" / "anchor_cost.py"), "--model", args.student, "--device", args.device,
            "--precision", args.precision, "--variants", "naive,anchor-last-cached,anchor-last-disk,anchor-last-uncached",
            "--out", str(out / "anchor_cost.json")]
    cost += ["--pairs", "32", "--epochs", "2", "--repeats", "1", "--max-length", "64"] if args.quick else \
        ["--pairs", "512", "--epochs", "3", "--repeats", "3", "--batch-size", "16"]
    service = [PYTHON, str(ROOT / "bench" / "bench_service.py"), "--model", args.student, "--device", args.device,
               "--precision", args.precision, "--concurrency", "1,32", "--skip", "no-batching",
               "--out", str(out / "service.json")]
    service += ["--seconds", "3", "--repeats", "1"] if args.quick else ["--seconds", "10", "--repeats", "3"]
    # LoRA: the same tune run with adapters (reference: the student with its adapters off), and its memory plan
    lora = ["--lora-rank", "16", "--lora-learning-rate", "1e-3"]
    tune_lora = [*tune[:tune.index("--name")], "--name", "gpu-path-lora", *tune[tune.index("--name") + 2:], *lora]
    plan_lora = [PYTHON, str(ROOT / "pipelines" / "tune.py"), "--preset", "smoke", "--student", args.student,
                 "--precision", args.precision, "--use-gpu", "yes" if gpu else "no", "--dry-run", *lora]
    # FSDP2: one process per device (every GPU of the machine, or 2 CPU workers), naive and ANCHOR steps
    workers = _gpu_count() if gpu else 2
    fsdp2 = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(workers), "--master_addr", "127.0.0.1",
             "--master_port", "29533", str(ROOT / "bench" / "fsdp2_step.py"), "--student", args.student,
             "--device", "cuda" if gpu else "cpu", "--precision", args.precision, "--out", str(out / "fsdp2.json")]
    fsdp2 += ["--pairs", "16", "--batch-size", "8", "--max-length", "64"] if args.quick else \
        ["--pairs", "256", "--batch-size", "16", "--max-length", "512"]
    # the same with a LoRA student sharded over the devices (reference: adapters off; no frozen copy)
    fsdp2_lora = [*fsdp2[:fsdp2.index("--out")], "--out", str(out / "fsdp2_lora.json"),
                  *fsdp2[fsdp2.index("--out") + 2:], "--lora-rank", "16"]
    return {"tune": tune, "anchor_cost": cost, "service": service, "plan_lora": plan_lora, "tune_lora": tune_lora,
            "fsdp2": fsdp2, "fsdp2_lora": fsdp2_lora}


def _gpu_count() -> int:
    import torch

    return max(1, torch.cuda.device_count())


def run_step(name: str, command: list[str], out: Path) -> dict:
    log = out / f"{name}.log"
    print(f"[{name}] {' '.join(command)}\n  (output: {log})", flush=True)
    started = time.perf_counter()
    with open(log, "w") as f:
        returncode = subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - started
    print(f"[{name}] exit {returncode} after {seconds:.0f} s", flush=True)
    return {"command": " ".join(command), "returncode": returncode, "seconds": round(seconds, 1), "log": str(log)}


def trial_figures(out: Path) -> list[dict]:
    """Per trial of the tune step: method, backend, peak VRAM and RSS of its worker, from its MLflow run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    rows = []
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], "tags.`anchor_rm.stage` = 'trial'"):
            def peak(key):
                values = [m.value for m in client.get_metric_history(run.info.run_id, key)]
                return round(max(values), 1) if values else None
            rows.append({"trial": run.data.tags.get("anchor_rm.trial_id"),
                         "method": run.data.tags.get("anchor_rm.method")
                         + (f" LoRA r{run.data.params['train.lora_rank']}"
                            if run.data.params.get("train.lora_rank", "0") != "0" else ""),
                         "status": run.info.status, "backend": run.data.tags.get("anchor_rm.process_group_backend"),
                         "peak_vram_mb": peak("worker/peak_vram_mb"), "peak_rss_mb": peak("worker/peak_rss_mb")})
    return rows


def machine(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}"
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_common import machine as cpu_machine

    return cpu_machine()


def summary_markdown(result: dict) -> str:
    lines = [f"Machine: {result['machine']}; student {result['student']}, device {result['device']}, precision "
             f"{result['precision']}{' (--quick: a check, not a measurement)' if result['quick'] else ''}.", ""]
    lines += ["| step | exit | seconds | command |", "|---|---:|---:|---|"]
    for name, step in result["steps"].items():
        lines.append(f"| {name} | {step['returncode']} | {step['seconds']} | `{step['command']}` |")
    lines += ["", "Trials of the tune step:", "", "| trial | method | status | process group | peak VRAM MB | peak RSS MB |",
              "|---|---|---|---|---:|---:|"]
    for row in result["trials"]:
        lines.append(f"| {row['trial']} | {row['method']} | {row['status']} | {row['backend']} | "
                     f"{'-' if row['peak_vram_mb'] is None else row['peak_vram_mb']} | {row['peak_rss_mb']} |")
    for name, fsdp2 in result.get("fsdp2", {}).items():
        lines += ["", f"FSDP2 ({name}: {fsdp2['workers']} workers on {fsdp2['device']}, {fsdp2['precision']}, "
                  f"LoRA rank {fsdp2['lora_rank'] or '- (full fine-tune)'}, {fsdp2['pairs']} pairs, batch "
                  f"{fsdp2['batch_size']}, max length {fsdp2['max_length']}): ANCHOR over naive per epoch "
                  f"{fsdp2['anchor_over_naive']}; peak memory: {fsdp2.get('peak_measure', 'torch.cuda.max_memory_allocated')}", "",
                  "| method | seconds | pairs/s | peak GiB per device | plan GiB per device |", "|---|---:|---:|---|---:|"]
        for method, v in fsdp2["variants"].items():
            lines.append(f"| {method} | {v['seconds']} | {v['pairs_per_s']} | "
                         f"{', '.join(str(x) for x in v['peak_memory_gib_per_device'])} | {v['plan_gib_per_device']} |")
    lines += ["", "ANCHOR over naive per epoch and the service's pairs/s: the tables at the end of anchor_cost.log "
              "and service.log (every repeat, medians, ratios)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    commands = steps(args, out)
    if args.dry_run:
        for name, command in commands.items():
            print(f"[{name}] {' '.join(command)}")
        return 0
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"--device {args.device}: torch sees no CUDA GPU here (torch {torch.__version__}); use --device cpu "
                  "to check the script on this machine", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(args.device), "student": args.student, "device": args.device,
              "precision": args.precision, "quick": args.quick, "steps": {}}
    for name, command in commands.items():
        result["steps"][name] = run_step(name, command, out)
    result["trials"] = trial_figures(out) if (out / "mlflow.db").exists() else []
    result["fsdp2"] = {name: json.loads((out / f"{name}.json").read_text())
                       for name in ("fsdp2", "fsdp2_lora") if (out / f"{name}.json").exists()}
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    (out / "summary.md").write_text(summary_markdown(result))
    print("\n" + summary_markdown(result))
    return 0 if all(step["returncode"] == 0 for step in result["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
