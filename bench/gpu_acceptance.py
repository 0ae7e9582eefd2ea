"""The GPU acceptance check: what a CPU cannot check of the GPU path, in one command, one JSON of pass/fail per
check (not a test; the suite runs it with --device cpu, so the script is known to work before a GPU runs it).

    .venv/bin/python bench/gpu_acceptance.py                    # the first CUDA GPU, SmolLM2-135M (planned: under 10 min on one H100)
    .venv/bin/python bench/gpu_acceptance.py --device cpu       # every check that applies on a CPU, at small sizes

Checks (each a result in --out, default gpu-acceptance.json; the exit status is 0 when every check that ran passed):
- precision: `auto` resolved for the device (bf16 on a GPU that computes it, whatever the host CPU), TF32 for fp32;
- fsdp2_world1: the student loaded sharded at one worker (DTensor parameters), the bf16 gather policy on each layer;
- anchor_step_full: two ANCHOR steps of the sharded student against a sharded frozen copy: finite loss and
  gradients, an anchor term past zero at the second, fp32 rewards;
- dcp_roundtrip: that step's sharded checkpoint (torch.distributed.checkpoint) read into a fresh sharded student
  gives equal parameters;
- anchor_step_lora: two ANCHOR steps of a sharded LoRA student (rank 16, activation checkpointing; its reference its
  adapters off; its frozen base bf16 where the device computes bf16);
- lora_steps: train_reward_model with LoRA r16 at --max-length (1,024 on a GPU) for --steps steps: seconds per
  step, and the device's peak memory (torch.cuda.max_memory_allocated; a CPU's peak RSS) beside the memory plan's;
- reference_cache: the frozen reference's states cached on the device against the live reference's;
- served_dtypes: the service's bf16 placement (service.holder.place_for_scoring): dtypes, and the rewards' largest
  difference from fp32 scoring of the same weights;
- tune_smoke (GPU only): `tune.py --preset smoke --use-gpu yes` with the GPUs' memory per process sampled every
  second (nvidia-smi): does the driver hold GPU memory while the trials run?
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

CHECKS = ("precision", "fsdp2_world1", "anchor_step_full", "dcp_roundtrip", "anchor_step_lora", "lora_steps",
          "reference_cache", "served_dtypes", "tune_smoke")
# The driver's GPU memory while trials run: its CUDA context (a few hundred MiB) and nothing more.
DRIVER_GPU_MIB_LIMIT = 1536


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--student", default="smollm2-135m", help="a decoder: short name, folder or hub id")
    p.add_argument("--max-length", type=int, help="tokens per sequence of lora_steps (default 1024 on cuda, 64 on cpu)")
    p.add_argument("--steps", type=int, help="lora_steps' training steps (default 15 on cuda, 2 on cpu)")
    p.add_argument("--batch-size", type=int, help="pairs per step of lora_steps (default 16 on cuda, 2 on cpu)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    p.add_argument("--out", default="gpu-acceptance.json")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    args.max_length = args.max_length or (1024 if gpu else 64)
    args.steps = args.steps or (15 if gpu else 2)
    args.batch_size = args.batch_size or (16 if gpu else 2)
    unknown = set(args.checks.split(",")) - set(CHECKS)
    if unknown:
        p.error(f"--checks: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CHECKS)}")
    return args


def _pairs(n: int, words: int):
    from anchor_rm.data.records import PreferencePair

    text = " ".join(f"w{i % 97}" for i in range(words))
    return [PreferencePair(f"question {i}: " + text[: words // 2], f"a good answer {i} " + text, f"a bad answer {i} " + text,
                           "acceptance") for i in range(n)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finite(*values) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def _peak_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class Acceptance:
    """The checks, sharing one process group (one worker), the device, the resolved precision and the student."""

    def __init__(self, args: argparse.Namespace, work: Path):
        import torch
        import torch.distributed as dist

        from anchor_rm.model.precision import resolve_precision

        self.args, self.work = args, work
        self.device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.precision = resolve_precision("auto", self.device.type)
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        self.shared: dict = {}

    def config(self, **fields):
        from anchor_rm.method.training import TrainConfig

        base = dict(method="anchor", anchor_lambda=1.0, epochs=1, batch_size=2, learning_rate=1e-5, max_length=64,
                    precision=self.precision, warmup_fraction=0.0)
        return TrainConfig(**{**base, **fields})

    def precision_check(self) -> dict:
        import torch

        from anchor_rm.model.precision import describe_hardware, native_bf16, resolve_precision

        expected = "bf16" if native_bf16(self.device.type) else "fp32"
        result = {"device": describe_hardware(self.device.type), "auto": self.precision, "expected": expected}
        passed = self.precision == expected
        if self.device.type == "cuda":
            resolve_precision("fp32", "cuda")
            result["tf32_for_fp32"] = bool(torch.backends.cuda.matmul.allow_tf32)
            passed = passed and result["tf32_for_fp32"]
        return {"passed": passed, **result}

    def fsdp2_world1(self) -> dict:
        import torch
        from torch.distributed.tensor import DTensor

        from anchor_rm.model.loading import transformer_parts
        from anchor_rm.model.sharded import load_pretrained_sharded

        _reset_peak(self.device)
        model = load_pretrained_sharded(self.args.student, self.device, precision=self.precision)
        dtensors = all(isinstance(p, DTensor) for p in model.parameters())
        _, layers, _ = transformer_parts(model, "acceptance")
        policies = {str(layer._get_fsdp_state()._mp_policy.param_dtype) for layer in layers}
        wanted = str(torch.bfloat16) if self.device.type == "cuda" and self.precision == "bf16" else "None"
        self.shared["sharded_student"] = model
        return {"passed": dtensors and policies == {wanted}, "dtensor_parameters": dtensors,
                "layer_param_dtypes": sorted(policies), "expected_param_dtype": wanted,
                "peak_gib_while_loading": round(_peak_bytes(self.device) / 2**30, 3)}

    def anchor_step_full(self) -> dict:
        from anchor_rm.method.training import train_reward_model
        from anchor_rm.model.encoding import RewardEncoder
        from anchor_rm.model.loading import load_tokenizer, resolve_model
        from anchor_rm.model.sharded import load_pretrained_sharded, save_sharded

        model = self.shared.get("sharded_student") or load_pretrained_sharded(self.args.student, self.device,
                                                                             precision=self.precision)
        reference = load_pretrained_sharded(self.args.student, self.device, precision=self.precision).eval()
        tokenizer = load_tokenizer(resolve_model(self.args.student))
        encoder = RewardEncoder(tokenizer, 64, decoder=True)
        encoded = self._encoded(encoder, 4, 40)  # two steps: the second's anchor term is past zero
        config = self.config(strategy="fsdp2", learning_rate=1e-3)
        folder = self.work / "dcp"
        kept = {}

        def checkpoint(epoch, core, state):
            save_sharded(folder, core, state["sharded_optimizer"])
            kept["parameters"] = {n: p.full_tensor().detach().clone() for n, p in core.named_parameters()}

        logs = []
        train_reward_model(model, encoded, [0.8] * len(encoded), config, reference=reference,
                           pad_token_id=encoder.pad_token_id, on_step=logs.append, on_epoch_end=checkpoint)
        rewards_dtype = self._reward_dtype(model, encoder, encoded)
        self.shared.update(dcp_folder=folder, dcp_parameters=kept["parameters"])
        log = logs[-1]
        return {"passed": _finite(log.loss, log.w2s_loss, log.anchor_loss, log.grad_norm) and log.anchor_loss > 0
                and rewards_dtype == "torch.float32",
                "loss": log.loss, "anchor_loss": log.anchor_loss, "grad_norm": log.grad_norm, "reward_dtype": rewards_dtype}

    def _encoded(self, encoder, n: int, words: int):
        from anchor_rm.model.scoring import encode_pairs

        return encode_pairs(encoder, _pairs(n, words))

    def _reward_dtype(self, model, encoder, encoded) -> str:
        import torch

        from anchor_rm.model.encoding import collate
        from anchor_rm.model.precision import autocast
        from anchor_rm.model.scoring import fp32_reward_head, reward_forward

        batch = {k: v.to(self.device) for k, v in collate(encoded.chosen, encoder.pad_token_id).items()}
        with torch.no_grad(), autocast(self.precision, self.device.type), fp32_reward_head(model):
            return str(reward_forward(model, batch).logits.dtype)

    def dcp_roundtrip(self) -> dict:
        from anchor_rm.model.sharded import load_pretrained_sharded, load_sharded

        if "dcp_folder" not in self.shared:
            return {"passed": False, "error": "needs anchor_step_full's checkpoint"}
        fresh = load_pretrained_sharded(self.args.student, self.device, precision=self.precision)
        load_sharded(self.shared["dcp_folder"], fresh)
        differences = [(p.full_tensor() - self.shared["dcp_parameters"][n]).abs().max().item()
                       for n, p in fresh.named_parameters()]
        return {"passed": max(differences) == 0.0, "largest_difference": max(differences), "tensors": len(differences)}

    def anchor_step_lora(self) -> dict:
        import torch

        from anchor_rm.method.stages import load_student
        from anchor_rm.method.training import train_reward_model
        from anchor_rm.model.lora import frozen_base_linears

        config = self.config(strategy="fsdp2", lora_rank=16, lora_alpha=32.0, activation_checkpointing=True,
                             learning_rate=1e-3)
        rm = load_student(self.args.student, config, self.device)
        base_dtypes = sorted({str(layer.weight.dtype) for layer in frozen_base_linears(rm.model)})
        wanted = [str(torch.bfloat16 if self.precision == "bf16" else torch.float32)]
        encoded = self._encoded(rm.encoder, 4, 40)
        logs = []
        train_reward_model(rm.model, encoded, [0.8] * len(encoded), config, pad_token_id=rm.encoder.pad_token_id,
                           on_step=logs.append)
        log = logs[-1]
        rewards_dtype = self._reward_dtype(rm.model, rm.encoder, encoded)
        return {"passed": _finite(log.loss, log.anchor_loss, log.grad_norm) and log.anchor_loss > 0 and base_dtypes == wanted
                and rewards_dtype == "torch.float32", "loss": log.loss, "anchor_loss": log.anchor_loss,
                "grad_norm": log.grad_norm, "frozen_base_dtypes": base_dtypes, "reward_dtype": rewards_dtype}

    def lora_steps(self) -> dict:
        from anchor_rm.method.memory_plan import model_shape, plan_memory
        from anchor_rm.method.stages import load_student
        from anchor_rm.method.training import train_reward_model

        args = self.args
        # one GPU, unsharded (DDP's path at one worker): what a LoRA trial on one GPU runs
        config = self.config(lora_rank=16, lora_alpha=32.0, activation_checkpointing=True, batch_size=args.batch_size,
                             max_length=args.max_length, strategy="ddp")
        rm = load_student(args.student, config, self.device)
        encoded = self._encoded(rm.encoder, args.batch_size * args.steps, args.max_length)
        _reset_peak(self.device)
        times, logs = [], []
        last = [time.perf_counter()]

        def on_step(log):
            if self.device.type == "cuda":
                import torch

                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now
            logs.append(log)

        train_reward_model(rm.model, encoded, [0.8] * len(encoded), config, pad_token_id=rm.encoder.pad_token_id,
                           on_step=on_step)
        peak = _peak_bytes(self.device)
        plan = plan_memory(model_shape(rm.model.config), batch_size=args.batch_size, max_length=args.max_length,
                           lora_rank=16, activation_checkpointing=True, device=self.device.type, precision=self.precision)
        steady = times[1:] or times
        ratio = peak / plan.total
        passed = all(_finite(log.loss, log.grad_norm) for log in logs) and len(logs) == args.steps
        if self.device.type == "cuda":
            passed = passed and ratio <= 1.15  # the plan may err high, not more than 15% low
        return {"passed": passed, "steps": len(logs), "max_length": args.max_length, "batch_size": args.batch_size,
                "seconds_per_step": round(sum(steady) / len(steady), 3), "first_step_seconds": round(times[0], 3),
                "peak_gib": round(peak / 2**30, 3), "plan_gib": round(plan.total / 2**30, 3),
                "peak_over_plan": round(ratio, 3),
                "peak_measure": "torch.cuda.max_memory_allocated" if self.device.type == "cuda" else "process peak RSS"}

    def reference_cache(self) -> dict:
        import torch

        from anchor_rm.method.reference_cache import compute_reference_states
        from anchor_rm.method.stages import frozen_reference
        from anchor_rm.model.encoding import collate
        from anchor_rm.model.precision import autocast
        from anchor_rm.model.reward_model import load_pretrained
        from anchor_rm.model.scoring import capture_hidden_states, reward_forward

        rm = load_pretrained(self.args.student, 64, 0, meta=True)
        encoded = rm.encode(_pairs(4, 40))
        reference = frozen_reference(self.args.student, self.device)
        layers = [reference.config.num_hidden_layers]
        states = compute_reference_states(reference, encoded, layers, rm.encoder.pad_token_id, precision=self.precision)
        indices = list(range(len(encoded)))
        batch = {k: v.to(self.device) for k, v in
                 collate([encoded.chosen[i] for i in indices] + [encoded.rejected[i] for i in indices],
                         rm.encoder.pad_token_id).items()}
        with torch.no_grad(), autocast(self.precision, self.device.type), capture_hidden_states(reference, layers) as live:
            reward_forward(reference, batch)
        mask = batch["anchor_mask"].bool()
        cached = states.batch(indices, layers, batch["anchor_mask"])[0].to(self.device)
        live_rows, cached_rows = live[layers[0]].float()[mask], cached.float()[mask]
        difference = ((live_rows - cached_rows).abs().max() / live_rows.abs().max()).item()
        tolerance = 1e-2 if self.precision == "bf16" else 1e-5  # fp16 storage of bf16 states; fp32 exact but kernels
        return {"passed": difference <= tolerance, "largest_relative_difference": difference, "tolerance": tolerance,
                "storage": states.kind if hasattr(states, "kind") else "ram"}

    def served_dtypes(self) -> dict:
        import numpy as np
        import torch

        from anchor_rm.model.reward_model import load_pretrained, load_saved, save_reward_model
        from anchor_rm.model.scoring import reward_head
        from service.holder import place_for_scoring

        folder = save_reward_model(load_pretrained(self.args.student, 256, 0), self.work / "served")
        served = load_saved(folder)
        precision = place_for_scoring(served.model, "bf16", str(self.device))
        head = reward_head(served.model)
        linears = [m for m in served.model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        dtypes_right = (all(m.weight.dtype == torch.bfloat16 for m in linears) and head.weight.dtype == torch.float32
                        and all(b.dtype == torch.float32 for b in served.model.buffers()))
        exact = load_saved(folder, device=self.device)
        pairs = _pairs(8, 150)
        prompts, responses = [p.prompt for p in pairs], [p.chosen for p in pairs]
        bf16 = served.scorer(8, precision).score(prompts, responses).rewards
        fp32 = exact.scorer(8, "fp32").score(prompts, responses).rewards
        return {"passed": dtypes_right and bool(np.isfinite(bf16).all()), "dtypes_right": dtypes_right,
                "largest_reward_difference_bf16_vs_fp32": float(np.abs(bf16 - fp32).max()),
                "reward_spread_fp32": float(np.std(fp32)), "device": str(next(served.model.parameters()).device)}

    def tune_smoke(self) -> dict:
        if self.device.type != "cuda":
            return {"skipped": "needs a CUDA GPU"}
        out = self.work / "tune"
        command = [sys.executable, str(ROOT / "pipelines" / "tune.py"), "--preset", "smoke", "--student",
                   self.args.student, "--use-gpu", "yes", "--num-samples", "1", "--epochs", "1", "--tracking-uri",
                   f"sqlite:///{out / 'mlflow.db'}", "--storage-path", str(out / "ray"), "--name", "acceptance"]
        out.mkdir(parents=True, exist_ok=True)
        samples: list[dict[int, int]] = []
        with open(out / "tune.log", "w") as log:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            stop = threading.Event()
            sampler = threading.Thread(target=_sample_gpu_memory, args=(samples, stop), daemon=True)
            sampler.start()
            returncode = proc.wait(timeout=540)
            stop.set()
            sampler.join()
        driver = [s.get(proc.pid, 0) for s in samples]
        during_trials = [s.get(proc.pid, 0) for s in samples if any(pid != proc.pid for pid in s)]
        held = max(during_trials, default=0)
        return {"passed": returncode == 0 and bool(during_trials) and held <= DRIVER_GPU_MIB_LIMIT,
                "returncode": returncode, "driver_peak_mib": max(driver, default=0),
                "driver_mib_while_trials_ran": held, "samples": len(samples),
                "samples_with_trials": len(during_trials), "log": str(out / "tune.log")}


def _sample_gpu_memory(samples: list, stop: threading.Event) -> None:
    """GPU memory per process (MiB) every second, from nvidia-smi."""
    while not stop.is_set():
        query = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
        sample = {}
        for line in query.stdout.splitlines():
            pid, _, used = line.partition(",")
            if pid.strip().isdigit() and used.strip().isdigit():
                sample[int(pid)] = sample.get(int(pid), 0) + int(used)
        samples.append(sample)
        stop.wait(1.0)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: torch sees no CUDA GPU here (torch {torch.__version__}); --device cpu runs the checks "
              "that apply on a CPU", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as work:
        acceptance = Acceptance(args, Path(work))
        methods = {"precision": acceptance.precision_check}
        for name in args.checks.split(","):
            check = methods.get(name) or getattr(acceptance, name)
            began = time.perf_counter()
            print(f"[{name}] ...", flush=True)
            try:
                results[name] = check()
            except Exception as exc:  # a check that breaks is a failed check, with its error; the others still run
                results[name] = {"passed": False, "error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()[-3000:]}
            results[name]["seconds"] = round(time.perf_counter() - began, 1)
            print(f"[{name}] {_verdict(results[name])} in {results[name]['seconds']} s", flush=True)
        import torch.distributed as dist

        dist.destroy_process_group()
    ran = [r for r in results.values() if "skipped" not in r]
    summary = {"device": args.device, "machine": _machine(args.device), "torch": torch.__version__,
               "student": args.student, "precision": acceptance.precision, "seconds": round(time.perf_counter() - started, 1),
               "passed": all(r["passed"] for r in ran), "checks": results}
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({name: _verdict(r) for name, r in results.items()}, indent=2))
    print(f"{'all passed' if summary['passed'] else 'FAILED'}; {out}")
    return 0 if summary["passed"] else 1


def _verdict(result: dict) -> str:
    return f"skipped ({result['skipped']})" if "skipped" in result else ("pass" if result["passed"] else "FAIL")


def _machine(device: str) -> str:
    import torch

    from anchor_rm.model.precision import cpu_model

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}; host {cpu_model()}"
    return cpu_model()


if __name__ == "__main__":
    sys.exit(main())
