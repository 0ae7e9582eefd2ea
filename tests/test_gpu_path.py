"""bench/gpu_path.py builds its steps from the project's own commands: each step's arguments must still parse
with that command's own parser (the script is run where a GPU is, rarely; a renamed flag must fail here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import PYTHON, ROOT

sys.path.insert(0, str(ROOT / "bench"))


@pytest.mark.parametrize("flags", [[], ["--device", "cpu", "--student", "minilm-l6", "--quick"]])
def test_every_step_parses_with_its_commands_parser(tmp_path, flags):
    import anchor_cost
    import bench_service
    import gpu_path
    import fsdp2_step

    from anchor_rm.cli import tune

    commands = gpu_path.steps(gpu_path.parse_args(flags), tmp_path)
    assert set(commands) == {"tune", "anchor_cost", "service", "plan_lora", "tune_lora", "fsdp2", "fsdp2_lora"}
    tune_args = tune.build_parser().parse_args(commands["tune"][2:])
    assert tune_args.preset == "smoke" and tune_args.use_gpu == ("no" if "cpu" in flags else "yes")
    lora_args = tune.build_parser().parse_args(commands["tune_lora"][2:])
    assert lora_args.lora_rank == 16 and lora_args.name == "gpu-path-lora" and lora_args.use_gpu == tune_args.use_gpu
    assert tune.build_parser().parse_args(commands["plan_lora"][2:]).dry_run
    script = commands["fsdp2"].index(str(ROOT / "bench" / "fsdp2_step.py"))
    assert commands["fsdp2"][2] == "torch.distributed.run"
    fsdp2_args = fsdp2_step.parse_args(commands["fsdp2"][script + 1:])
    assert fsdp2_args.device == ("cpu" if "cpu" in flags else "cuda") and fsdp2_args.out.endswith("fsdp2.json")
    assert fsdp2_args.lora_rank == 0
    lora_fsdp2 = fsdp2_step.parse_args(commands["fsdp2_lora"][script + 1:])
    assert lora_fsdp2.lora_rank == 16 and lora_fsdp2.out.endswith("fsdp2_lora.json")
    assert lora_fsdp2.device == fsdp2_args.device and lora_fsdp2.pairs == fsdp2_args.pairs
    cost_argv = commands["anchor_cost"][2:]
    device = cost_argv[cost_argv.index("--device") + 1]
    assert device == ("cpu" if "cpu" in flags else "cuda")
    # anchor_cost refuses a device torch does not have: parse the rest as on a CPU
    cost_args = anchor_cost.parse_args([a if a != "cuda" else "cpu" for a in cost_argv])
    assert {"naive", "anchor-last-cached", "anchor-last-disk", "anchor-last-uncached"} == set(cost_args.variants.split(","))
    service_args = bench_service.parse_args(commands["service"][2:])
    assert service_args.concurrency == "1,32" and service_args.skip == "no-batching"


def test_dry_run_prints_the_steps_and_a_missing_gpu_is_one_line(tmp_path):
    dry = subprocess.run([PYTHON, str(ROOT / "bench" / "gpu_path.py"), "--dry-run", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and [line.split("]")[0] for line in dry.stdout.splitlines()] == \
        ["[tune", "[anchor_cost", "[service", "[plan_lora", "[tune_lora", "[fsdp2", "[fsdp2_lora"], dry.stdout
    import torch

    if not torch.cuda.is_available():
        missing = subprocess.run([PYTHON, str(ROOT / "bench" / "gpu_path.py"), "--out", str(tmp_path / "x")],
                                 capture_output=True, text=True, timeout=120)
        assert missing.returncode == 2 and "torch sees no CUDA GPU here" in missing.stderr, missing.stderr
        assert "Traceback" not in missing.stderr and not (tmp_path / "x").exists()


def test_the_summary_prints_what_a_gpu_run_must_report_for_fsdp2():
    """Peak memory per device beside the plan's, pairs/s and ANCHOR over naive, for the full and the LoRA run."""
    import gpu_path

    def run(lora_rank, anchor_seconds):
        variants = {m: {"seconds": s, "pairs_per_s": round(256 / s, 2), "peak_memory_gib_per_device": [21.5, 21.7],
                        "plan_gib_per_device": 23.7} for m, s in (("naive", 10.0), ("anchor", anchor_seconds))}
        return {"student": "x", "device": "cuda", "workers": 2, "precision": "bf16", "pairs": 256, "batch_size": 16,
                "max_length": 512, "lora_rank": lora_rank, "variants": variants,
                "anchor_over_naive": round(anchor_seconds / 10.0, 3)}

    result = {"machine": "m", "student": "x", "device": "cuda", "precision": "bf16", "quick": False, "steps": {},
              "trials": [], "fsdp2": {"fsdp2": run(0, 11.0), "fsdp2_lora": run(16, 10.4)}}
    text = gpu_path.summary_markdown(result)
    assert "FSDP2 (fsdp2: 2 workers on cuda, bf16, LoRA rank - (full fine-tune)" in text
    assert "FSDP2 (fsdp2_lora: 2 workers on cuda, bf16, LoRA rank 16" in text
    assert "ANCHOR over naive per epoch 1.1" in text and "ANCHOR over naive per epoch 1.04" in text
    assert "| anchor | 11.0 | 23.27 | 21.5, 21.7 | 23.7 |" in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_gpu_acceptance_script_passes_every_check_that_applies_on_a_cpu(tmp_path):
    """bench/gpu_acceptance.py --device cpu: the script a GPU will run, run here at small sizes, so that it is known to
    work before a GPU exists (each check's pass/fail in one JSON; the GPU-only one says it was skipped)."""
    import json

    from anchor_rm.model.loading import load_tokenizer, resolve_model
    from helpers import tiny_llama

    # A tiny Llama with SmolLM2's tokenizer and chat template: the script's code paths at a fraction of SmolLM2's
    # CPU time in the suite (`--device cpu` with the default student runs the same checks on SmolLM2-135M)
    student = tmp_path / "tiny-llama"
    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    tiny_llama(tokenizer).save_pretrained(student)
    tokenizer.save_pretrained(student)
    out = tmp_path / "acceptance.json"
    proc = subprocess.run([PYTHON, str(ROOT / "bench" / "gpu_acceptance.py"), "--device", "cpu", "--student", str(student),
                           "--out", str(out)], capture_output=True, text=True, timeout=560, cwd=tmp_path)
    result = json.loads(out.read_text())
    failed = {name: check.get("error", check) for name, check in result["checks"].items() if not check.get("passed", True)}
    assert proc.returncode == 0 and result["passed"], failed or proc.stderr[-3000:]
    import gpu_acceptance

    assert set(result["checks"]) == set(gpu_acceptance.CHECKS)
    assert result["checks"]["tune_smoke"] == {"skipped": "needs a CUDA GPU", "seconds": 0.0}
    assert result["checks"]["fsdp2_world1"]["dtensor_parameters"]
    assert result["checks"]["dcp_roundtrip"]["largest_difference"] == 0.0
    assert result["checks"]["anchor_step_full"]["anchor_loss"] > 0 and result["checks"]["anchor_step_lora"]["anchor_loss"] > 0
    assert result["checks"]["lora_steps"]["steps"] == 2 and result["checks"]["lora_steps"]["seconds_per_step"] > 0
    missing = subprocess.run([PYTHON, str(ROOT / "bench" / "gpu_acceptance.py"), "--out", str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=120)
    import torch

    if not torch.cuda.is_available():
        assert missing.returncode == 2 and "torch sees no CUDA GPU here" in missing.stderr
        assert "Traceback" not in missing.stderr and not (tmp_path / "x.json").exists()
