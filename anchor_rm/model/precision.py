"""The precision of forward passes, picked from the hardware once per process.

bf16 autocast is about 3-4x faster than fp32 where the hardware computes bf16 natively (a CUDA GPU with
bf16, a CPU with AVX512-BF16 or AMX) and about 70x *slower* in a matmul where it does not (an AVX2-only CPU
emulates it; a MiniLM-L6 training step there takes about 10x its fp32 time). So "auto" means: bf16 only
where it is both native and measured faster, fp32 everywhere else. Training, the reference cache, soft
labels, evaluation and the service all take their precision from `resolve_precision` for the device they run
on: the pipelines resolve it once for the device of their own stages (the driver's GPU where it has one, else its
CPU) and pass the concrete value ("fp32" or "bf16") on, so that cache keys, MLflow params and reports carry what
actually ran; Ray Train workers on GPUs resolve the requested value for their own device (a GPU node's host CPU
says nothing about its GPUs).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import warnings
from pathlib import Path

import torch

log = logging.getLogger("anchor_rm")

PRECISIONS = ("auto", "fp32", "bf16")
_NATIVE_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def check_precision(precision: str, where: str = "precision") -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"{where} must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def cpu_bf16_flags() -> list[str] | None:
    """The CPU's native-bf16 instruction flags, or None where /proc/cpuinfo cannot tell (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return [flag for flag in _NATIVE_CPU_FLAGS if flag in flags]


@functools.cache
def bf16_matmul_slowdown(size: int = 256, repeats: int = 10) -> float:
    """bf16 time over fp32 time of one size x size CPU matmul here (best of `repeats` each): below 1 means bf16
    is faster. About 0.25 on a CPU with AVX512-BF16, about 70 on an AVX2-only one (~40 ms per bf16 call).

    The two are timed in alternation and each keeps its fastest call, so that other processes taking the
    CPU meanwhile (a test suite, a study) slow both alike and cannot flip the decision: with 3 calls each,
    timed one dtype after the other, a loaded 2-core machine once read bf16 as slower and `auto` chose fp32
    in one process and bf16 in another."""
    pairs = {dtype: (torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype))
             for dtype in (torch.float32, torch.bfloat16)}
    best = {dtype: float("inf") for dtype in pairs}
    for a, b in pairs.values():
        a @ b  # the first call pays one-off kernel selection
    for _ in range(repeats):
        for dtype, (a, b) in pairs.items():
            started = time.perf_counter()
            a @ b
            best[dtype] = min(best[dtype], time.perf_counter() - started)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def describe_hardware(device_type: str = "cpu") -> str:
    if device_type == "cuda":
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA GPU visible to torch"
    flags = cpu_bf16_flags()
    native = "native bf16 (" + ", ".join(flags) + ")" if flags else ("no native bf16" if flags is not None else "bf16 support unknown")
    # Dispatch limited by the environment (how a CPU without native bf16 is imitated on one with it).
    limited = [f"{name}={os.environ[name]}" for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(name)]
    return f"{cpu_model()}, {native}" + (f", dispatch limited by {' '.join(limited)}" if limited else "")


def native_bf16(device_type: str = "cpu") -> bool:
    """Whether bf16 is computed natively *and* is faster than fp32 here."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type != "cpu":
        return False
    flags = cpu_bf16_flags()
    if flags == []:
        return False  # no native instruction: emulated, never worth it
    return bf16_matmul_slowdown() < 1.0  # native (or unknown): bf16 only where measured faster


@functools.cache
def resolve_precision(requested: str = "auto", device_type: str = "cpu") -> str:
    """"fp32" or "bf16" for `requested` on this device, decided once per process and logged once.

    "auto" picks bf16 only where it is native and faster. An explicit "bf16" on a CPU that would emulate it
    is honoured, with one warning giving the measured slowdown.
    """
    check_precision(requested)
    if requested == "fp32":
        if device_type == "cuda":
            allow_tf32()
        return "fp32"
    if requested == "bf16":
        if device_type == "cpu" and not native_bf16("cpu"):
            message = (f"precision bf16 requested, but this CPU ({describe_hardware('cpu')}) does not compute bf16 "
                       f"natively: a bf16 matmul measured {bf16_matmul_slowdown():.0f}x the time of fp32 here, and "
                       "training will be several times slower; --precision auto would pick fp32")
            warnings.warn(message, stacklevel=2)
            log.warning(message)
        return "bf16"
    chosen = "bf16" if native_bf16(device_type) else "fp32"
    log.info("precision auto -> %s on %s", chosen, describe_hardware(device_type))
    if chosen == "fp32" and device_type == "cuda":
        allow_tf32()
    return chosen


def allow_tf32() -> None:
    """fp32 on a CUDA GPU computes its matmuls in TF32 (a GPU without bf16, or --precision fp32 there): the
    tensor cores, about 8x the fp32 rate of an A100, with fp32's range and a 10-bit mantissa."""
    # The legacy switches: they touch CUDA alone (torch.set_float32_matmul_precision would reach oneDNN's CPU matmuls
    # too), and mixing them with torch's newer per-backend API makes get_float32_matmul_precision raise.
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def driver_device_type() -> str:
    """Where a pipeline's own stages run (the teacher, the ceiling, train.py's and the study's students, the
    reference cache, the final evaluation): its first GPU when torch sees one, else its CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def uses_bf16(precision: str, device_type: str = "cpu") -> bool:
    return resolve_precision(precision, device_type) == "bf16"


def autocast(precision: str, device_type: str):
    """bf16 autocast when `precision` resolves to bf16 on this device, else nothing."""
    if uses_bf16(precision, device_type):
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# The attention implementation every model gets at load time (models.load_reward_model) where transformers would
# use its SDPA attention: the same kernel, computed in fp32 when it runs on a CPU under bf16 autocast. There,
# torch's CPU flash-attention kernel is slower in bf16 than in fp32, its backward pass most (MiniLM-L6's 32 x 12
# heads x 160 tokens x 32 dims: forward 18.8 against 15.9 ms, forward + backward 101 against 55 ms on an AMD EPYC
# with avx512_bf16; `bench/precision.py --parts attention` measures it on any CPU, docs/benchmarks.md), and
# attention was a third of a bf16 training step. In fp32 it is also the more exact of the two. On a GPU, or
# without autocast, it is SDPA.
CPU_FP32_ATTENTION = "sdpa_fp32_on_cpu"


@functools.cache
def _register_cpu_fp32_attention() -> None:
    """Registers CPU_FP32_ATTENTION with transformers' attention *and* mask interfaces, once per process: an
    attention name without a mask function gets no attention mask at all, and padded positions would be
    attended to."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def sdpa_fp32_on_cpu(module, query, key, value, attention_mask, **kwargs):
        if query.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        with torch.autocast("cpu", enabled=False):
            # fp32 out: the projection after it casts its input back to bf16 under autocast
            return sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)

    AttentionInterface.register(CPU_FP32_ATTENTION, sdpa_fp32_on_cpu)
    AttentionMaskInterface.register(CPU_FP32_ATTENTION, sdpa_mask)


def use_cpu_fp32_attention(model) -> None:
    """Switches a transformers model that uses SDPA attention to CPU_FP32_ATTENTION (others keep theirs)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    _register_cpu_fp32_attention()
    model.set_attn_implementation(CPU_FP32_ATTENTION)
