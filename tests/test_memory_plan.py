"""The memory plan (anchor_rm/method/memory_plan.py): parameter counts from a config alone, a refusal in one line that
names the estimate, the limit and what to change, and the `paper` preset's dry run (no data read, nothing
trained)."""

import subprocess

import pytest

from anchor_rm.method.memory_plan import MemoryPlanError, check_plan, model_shape, plan_memory
from anchor_rm.model.loading import load_model_config
from anchor_rm.model.lora import add_adapters
from helpers import PYTHON, ROOT, tiny_llama

GB = 10**9


def test_the_shape_counts_what_the_model_and_its_adapters_hold(minilm_tokenizer):
    model = tiny_llama(minilm_tokenizer)
    shape = model_shape(model.config)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert shape.layers == 2 and shape.gated_mlp
    adapted = add_adapters(model, 4, 8.0)
    adapters = sum(p.numel() for n, p in adapted.named_parameters() if ".lora_" in n)
    assert shape.lora_parameters(4) == adapters


def test_an_8b_student_plans_offline_and_a_full_fine_tune_on_one_gpu_is_refused():
    shape = model_shape(load_model_config("meta-llama/Llama-3.1-8B"))  # the recorded architecture: no hub here
    assert 7.4e9 < shape.parameters < 7.6e9  # 8.03B less the LM head a reward model does not have
    common = {"batch_size": 16, "max_length": 1024, "anchor": True, "device": "cuda", "precision": "bf16"}
    full = plan_memory(shape, **common)
    with pytest.raises(MemoryPlanError) as refused:
        check_plan(full, 80 * GB, "one 80 GB GPU")
    line = str(refused.value)
    assert "\n" not in line and f"{full.total / 2**30:.1f} GiB" in line and "one 80 GB GPU" in line
    assert "--lora-rank" in line and "--strategy fsdp2" in line
    lora = plan_memory(shape, lora_rank=16, activation_checkpointing=True, **common)
    check_plan(lora, 80 * GB, "one 80 GB GPU")  # fits: no gradients or optimiser state for the base, no reference
    assert lora.reference == 0 and lora.trainable_parameters < 0.01 * lora.parameters
    sharded = plan_memory(shape, strategy="fsdp2", workers=8, activation_checkpointing=True, **common)
    check_plan(sharded, 80 * GB, "8 x 80 GB GPUs")
    assert sharded.optimizer == full.optimizer // 8


def _tune(cwd, *args):
    return subprocess.run([PYTHON, str(ROOT / "pipelines" / "tune.py"), "--preset", "paper", "--dry-run", "--use-gpu",
                           "yes", "--worker-memory", "80GB", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_paper_presets_dry_run_shows_config_data_and_plan_then_refuses_what_will_not_fit(tmp_path):
    ok = _tune(tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert '"student": "meta-llama/Llama-3.1-8B"' in ok.stdout and '"lora_rank": 16' in ok.stdout
    assert "Anthropic/hh-rlhf (test, data_dir=helpful-base)" in ok.stdout  # the hub originals, by name
    assert "- student: " in ok.stdout and "the plan fits; nothing was trained" in ok.stdout
    assert not any(tmp_path.iterdir())  # no store, no Ray results: nothing started
    refused = _tune(tmp_path, "--lora-rank", "0")  # a full fine-tune of 8B on one 80 GB worker
    assert refused.returncode == 2
    error = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "will not fit" in error[0] and "for the student" in error[0], refused.stderr[-2000:]
    # Sharded over 8 workers the trials fit; the strong ceiling, trained in the driver's one process, does not
    sharded = _tune(tmp_path, "--lora-rank", "0", "--strategy", "fsdp2", "--workers-per-trial", "8")
    assert "- student: 23.72 GiB per worker" in sharded.stdout and "fsdp2 on 8 cuda worker(s)" in sharded.stdout
    error = [line for line in sharded.stderr.splitlines() if line.startswith("error:")]
    assert sharded.returncode == 2 and len(error) == 1, sharded.stderr[-2000:]
    assert "for the ceiling (it trains in the driver's process, unsharded)" in error[0] and "--strategy" not in error[0]
