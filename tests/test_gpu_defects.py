"""The GPU path's defects that a review found before any GPU ran it (issue 46), each modelled on a CPU: precision
decided for the device a stage runs on, the driver's GPU memory handed back and its heavy work on its GPU, FSDP2
loaded sharded from the meta device (and sharded at one worker), a LoRA student's frozen base in bf16, LoRA
checkpoints of adapters alone, CPUs sized on the GPU nodes, the workers' environment, checkpoints read onto the
CPU, the reward read where the anchor mask marks it, and a container's memory limit. bench/gpu_acceptance.py
checks on a GPU what a CPU cannot."""

from __future__ import annotations

import os
import resource

import pytest
import torch

from anchor_rm.data.records import PreferencePair
from anchor_rm.method.training import TrainConfig, train_reward_model
from anchor_rm.model import precision
from anchor_rm.model.encoding import RewardEncoder
from helpers import ROOT, free_port, tiny_llama

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine whose GPUs compute bf16 natively while its CPU does not (many GPU nodes' host CPUs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a GPU with bf16")
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: [])
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    precision.resolve_precision.cache_clear()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    precision.resolve_precision.cache_clear()


def _pairs(n=16):
    return [PreferencePair(f"question number {i}", f"good answer {i % 7}", f"bad answer {i % 5} " * (i % 3 + 1), "toy")
            for i in range(n)]


@pytest.fixture
def llama_folder(tmp_path, minilm_tokenizer):
    """A tiny Llama saved as a model folder: a name load_reward_model resolves, as a hub id would be."""
    folder = tmp_path / "base"
    tiny_llama(minilm_tokenizer, seed=0).save_pretrained(folder)
    minilm_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def process_group():
    """A one-worker gloo process group in this process (what Ray Train or torchrun give a worker)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# 1. Precision for the device.

def test_auto_is_resolved_for_the_device_a_stage_runs_on_not_the_drivers_cpu(fake_cuda):
    assert precision.resolve_precision("auto", "cpu") == "fp32"
    assert precision.resolve_precision("auto", "cuda") == "bf16"
    from anchor_rm.cli import tune

    cfg = tune.tune_config(tune.build_parser().parse_args(["--preset", "smoke"]))
    assert cfg.precision == cfg.student_train.precision == "bf16"  # the driver's stages run on its GPU


def test_fp32_on_a_gpu_computes_its_matmuls_in_tf32(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert precision.resolve_precision("auto", "cuda") == "fp32"
    assert torch.backends.cuda.matmul.allow_tf32


def test_trials_on_gpus_get_the_requested_precision_and_trials_on_cpus_the_drivers():
    from anchor_rm.pipeline.config import preset
    from tuning.trainable import SharedPayload, _train_config

    cfg = preset("smoke")
    cfg.resolve_precision("auto")
    payload = SharedPayload(cfg=cfg, splits=None, soft_labels=[], teacher_val={}, headline_targets=[], tracking_uri="",
                            experiment_id="", parent_run_id="", storage_path="", use_gpu=True, trial_precision="auto")
    assert _train_config(payload, {"method": "naive"}).precision == "auto"  # resolved in the worker, for its GPU


# 2-3. The driver's device: its heavy work on its GPU, the memory handed back before Ray gives that GPU away.

def test_the_driver_hands_its_gpu_memory_back_after_the_shared_stages(fake_cuda, monkeypatch):
    import tuning.main_job as main_job

    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    monkeypatch.setattr(main_job, "prepare_shared", lambda cfg, experiment_id: calls.append("stages") or "shared")
    assert main_job.shared_stages(None, "0") == "shared"
    assert calls == ["stages", "empty_cache"]


def test_the_final_evaluation_and_the_reference_cache_run_on_the_drivers_gpu(fake_cuda, monkeypatch, minilm_tokenizer,
                                                                             llama_folder):
    """Models are moved to the driver's device (recorded: this CPU has none); a live reference is not loaded at all."""
    import tuning.final as final
    from anchor_rm.method import stages
    from anchor_rm.model import loading, reward_model

    moved = []
    real_to = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(str(a[0] if a else k.get("device")))
                        or (real_to(self, *a, **k) if "cuda" not in str(a[0] if a else k) else self))

    class Stop(Exception):
        pass

    def fake_load_saved(folder, *args, device="cpu", **kwargs):
        moved.append(f"load_saved:{device}")
        raise Stop
    monkeypatch.setattr(final, "load_saved", fake_load_saved)
    with pytest.raises(Stop):
        final.evaluate_outcome(None, None, llama_folder, "s", "t", 8, {}, "fp32")
    assert moved == ["load_saved:cuda"]

    moved.clear()
    rm = reward_model.load_pretrained(str(llama_folder), 32, 0, meta=True)  # encoding and shape: no weights read
    assert next(rm.model.parameters()).is_meta
    loaded = []
    monkeypatch.setattr(stages, "frozen_reference", lambda name, device: loaded.append(device) or
                        loading.load_reward_model(loading.resolve_model(name)).eval())
    assert stages.reference_states(str(llama_folder), rm, _pairs(), ["last"], precision="fp32", cache="live") is None
    assert loaded == []  # live: every trial loads its own; the driver loads nothing
    states = stages.reference_states(str(llama_folder), rm, _pairs(), ["last"], precision="fp32", cache="ram")
    assert loaded == ["cuda"] and states.num_pairs == len(rm.encode(_pairs()))


# 4 and 12. FSDP2: loaded sharded from the meta device, sharded at one worker too.

def test_an_8b_student_is_sharded_on_the_meta_device_before_any_weight_exists_and_the_plan_counts_its_load(process_group):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from anchor_rm.method.memory_plan import model_shape, plan_memory
    from anchor_rm.model.loading import KNOWN_ARCHITECTURES
    from anchor_rm.model.sharded import is_sharded, shard_model

    fields = dict(KNOWN_ARCHITECTURES["meta-llama/Llama-3.1-8B"])
    config = AutoConfig.for_model(fields.pop("model_type"), num_labels=1, **fields)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    shard_model(model, "bf16", "cpu")
    assert is_sharded(model) and all(p.is_meta for p in model.parameters())
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 < 2**30  # 32 GB of fp32 never built
    shape = model_shape(config)
    plan = plan_memory(shape, batch_size=16, max_length=1024, anchor=True, activation_checkpointing=True,
                       strategy="fsdp2", workers=8, device="cuda", precision="bf16")
    shard_bytes = 4 * shape.parameters // 8
    # loading: the student's and the reference's shards and one embedding matrix in transit (twice), not 8B whole
    assert plan.loading == 2 * shard_bytes + 2 * 4 * shape.largest_tensor
    assert plan.loading < 4 * shape.parameters < plan.host_loading and plan.loading <= plan.total - plan.overhead


def test_a_student_loaded_sharded_holds_the_pretrained_weights_and_buffers(process_group, llama_folder):
    from torch.distributed.tensor import DTensor

    from anchor_rm.model.loading import load_reward_model, resolve_model
    from anchor_rm.model.sharded import load_pretrained_sharded

    torch.manual_seed(3)
    whole = load_reward_model(resolve_model(str(llama_folder)))
    sharded = load_pretrained_sharded(str(llama_folder), "cpu", precision="fp32", seed=3)
    for name, parameter in sharded.named_parameters():
        assert isinstance(parameter, DTensor), name
        torch.testing.assert_close(parameter.full_tensor(), whole.get_parameter(name), rtol=0, atol=0)
    for name, buffer in whole.named_buffers():  # rotary inv_freq: computed at construction, in no state dict
        torch.testing.assert_close(sharded.get_buffer(name), buffer, rtol=0, atol=0)


def test_fsdp2_shards_at_one_worker_and_needs_a_process_group(llama_folder, minilm_tokenizer):
    from anchor_rm.model.loading import load_reward_model, resolve_model
    from anchor_rm.model.scoring import encode_pairs
    from anchor_rm.model.sharded import is_sharded

    encoded = encode_pairs(RewardEncoder(minilm_tokenizer, 32, decoder=True), _pairs())
    config = TrainConfig(method="naive", epochs=1, batch_size=8, precision="fp32", strategy="fsdp2")
    model = load_reward_model(resolve_model(str(llama_folder)))
    with pytest.raises(ValueError, match="strategy fsdp2 needs a process group"):
        train_reward_model(model, encoded, [0.7] * len(encoded), config, pad_token_id=minilm_tokenizer.pad_token_id)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        train_reward_model(model, encoded, [0.7] * len(encoded), config, pad_token_id=minilm_tokenizer.pad_token_id)
        assert is_sharded(model)
    finally:
        dist.destroy_process_group()


# 5. A LoRA student's frozen base in bf16.

def test_a_lora_students_frozen_base_is_held_in_bf16_where_it_computes_bf16(llama_folder, minilm_tokenizer):
    from anchor_rm.method.stages import load_student
    from anchor_rm.model.lora import frozen_base_linears
    from anchor_rm.model.scoring import encode_pairs, reward_head

    rm = load_student(str(llama_folder), TrainConfig(lora_rank=4, precision="bf16", max_length=32), "cpu")
    base = {id(layer.weight) for layer in frozen_base_linears(rm.model)}
    assert base and all(layer.weight.dtype == torch.bfloat16 for layer in frozen_base_linears(rm.model))
    for name, parameter in rm.model.named_parameters():  # adapters, head, embeddings, norms: fp32
        assert (parameter.dtype == torch.bfloat16) == (id(parameter) in base), name
    assert reward_head(rm.model).weight.dtype == torch.float32
    assert all(b.dtype == torch.float32 for b in rm.model.buffers())
    encoded = encode_pairs(rm.encoder, _pairs())
    logs = []
    train_reward_model(rm.model, encoded, [0.9] * len(encoded), TrainConfig(
        method="anchor", anchor_lambda=1.0, epochs=1, batch_size=8, precision="bf16", lora_rank=4, max_length=32),
        pad_token_id=rm.encoder.pad_token_id, on_step=logs.append)
    assert all(torch.isfinite(torch.tensor([log.loss, log.grad_norm])).all() for log in logs) and logs[-1].anchor_loss > 0
    fp32 = load_student(str(llama_folder), TrainConfig(lora_rank=4, precision="fp32", max_length=32), "cpu")
    assert all(p.dtype == torch.float32 for p in fp32.model.parameters())


def test_the_plan_holds_a_lora_base_in_bf16():
    from anchor_rm.method.memory_plan import model_shape, plan_memory
    from anchor_rm.model.loading import load_model_config

    shape = model_shape(load_model_config("meta-llama/Llama-3.1-8B"))
    common = dict(batch_size=16, max_length=1024, lora_rank=16, activation_checkpointing=True, device="cuda")
    bf16, fp32 = plan_memory(shape, precision="bf16", **common), plan_memory(shape, precision="fp32", **common)
    assert fp32.weights == 4 * shape.parameters and bf16.weights == 4 * shape.parameters - 2 * shape.linear_parameters
    assert 14 * 2**30 < bf16.weights < 16 * 2**30  # about 15 GiB instead of 28


# 6. LoRA checkpoints: the adapters and the head, merged once when exported.

def test_a_lora_training_checkpoint_holds_adapters_alone_and_exports_merged(tmp_path, llama_folder):
    from anchor_rm.method.stages import load_student
    from anchor_rm.model.reward_model import export_checkpoint, load_saved, save_reward_model

    rm = load_student(str(llama_folder), TrainConfig(lora_rank=4, precision="fp32", max_length=32), "cpu")
    with torch.no_grad():  # trained adapters: not the zeros they start at
        for name, parameter in rm.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    checkpoint = save_reward_model(rm, tmp_path / "checkpoint", {"method": "naive"}, adapters_only=True)
    files = {p.relative_to(checkpoint).as_posix(): p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()}
    assert "model.safetensors" not in files and "adapter/adapter_model.safetensors" in files
    merged = save_reward_model(rm, tmp_path / "merged")
    merged_bytes = sum(p.stat().st_size for p in merged.rglob("*.safetensors") if p.parent == merged)
    assert files["adapter/adapter_model.safetensors"] < merged_bytes / 4
    prompts, responses = ["question number 3", "hello"], ["good answer 3", "bad answer"]
    expected = rm.scorer(precision="fp32").score(prompts, responses).rewards
    assert load_saved(checkpoint).scorer(precision="fp32").score(prompts, responses).rewards == pytest.approx(expected, abs=1e-5)
    resumed = load_saved(checkpoint, adapters=True)
    assert resumed.model.peft_config["default"].r == 4
    export_checkpoint(checkpoint)
    assert (checkpoint / "model.safetensors").exists()
    assert load_saved(checkpoint).scorer(precision="fp32").score(prompts, responses).rewards == pytest.approx(expected, abs=1e-5)


# 7. Frozen layers under DDP.

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ddp_workers_train_with_frozen_layers(tmp_path):
    import subprocess

    from helpers import PYTHON

    out = tmp_path / "ddp"
    proc = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                           "--master_port", str(free_port()), str(ROOT / "tests" / "fsdp_worker.py"), str(out), "ddp",
                           "--frozen-layers", "1", "--epochs", "2"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = __import__("json").loads((out / "steps.json").read_text())
    assert len(steps) == 4 and all(s["grad_norm"] > 0 for s in steps)
    trained = torch.load(out / "parameters.pt")
    first = torch.load(out / "first_step.pt")["parameters"]
    frozen = [n for n in trained if "embed_tokens" in n or ".layers.0." in n]
    assert frozen and all(torch.equal(trained[n], first[n]) for n in frozen)


# 8. CPUs per worker from the nodes that hold the GPUs.

def test_cpus_per_worker_are_sized_on_the_gpu_nodes():
    from tuning.trainable import worker_resources

    # a CPU-only head of 16 CPUs and one 8-GPU node of 32: 8 one-worker trials get 4 CPUs each, on the GPU node
    assert worker_resources([16, 32], 8, 1, node_gpus=[0, 8]) == (4.0, 4)
    assert worker_resources([16, 32], 8, 1)[0] > 4.0  # what sizing over every node's CPUs asked: more than fits
    assert worker_resources([8, 8], 2, 2, node_gpus=[2, 2]) == (4.0, 4)
    with pytest.raises(ValueError, match="GPUs cannot hold 3 concurrent trials"):
        worker_resources([16, 32], 3, 4, node_gpus=[0, 8])


# 10. The driver's environment for the workers.

def test_workers_get_the_hub_token_and_caches_and_nccls_settings_but_not_the_drivers_gpus():
    from tuning.search import worker_env

    environ = {"HF_TOKEN": "t", "HF_HOME": "/h", "HF_HUB_CACHE": "/c", "HUGGING_FACE_HUB_TOKEN": "t2",
               "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
               "CUDA_VISIBLE_DEVICES": "0", "HOME": "/root", "MLFLOW_TRACKING_URI": "http://m"}
    assert worker_env(environ) == {k: v for k, v in environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "HOME")}


# 11. A checkpoint's training state read onto the CPU.

def test_a_checkpoints_training_state_is_read_onto_the_cpu(tmp_path, monkeypatch):
    from tuning import trainable

    torch.save({"epoch": 0, "optimizer_state": {"state": {0: {"exp_avg": torch.ones(2)}}}}, tmp_path / trainable.TRAINING_STATE)
    seen = {}
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.update(k) or real_load(*a, **k))
    state = trainable.read_training_state(tmp_path)
    assert seen["map_location"] == "cpu" and state["optimizer_state"]["state"][0]["exp_avg"].device.type == "cpu"


# 13. The reward is read where the anchor mask marks it, with pad = EOS.

def test_a_decoder_whose_last_token_is_the_pad_token_is_read_at_that_token(minilm_tokenizer):
    from anchor_rm.model.encoding import collate
    from anchor_rm.model.scoring import reward_forward

    model = tiny_llama(minilm_tokenizer).eval()
    pad = minilm_tokenizer.pad_token_id
    encoder = RewardEncoder(minilm_tokenizer, 32, decoder=True)
    # a sequence ending in the pad id (an Instruct model's end-of-turn token, when pad = EOS), and a shorter one
    first, second = encoder.encode("a question", "an answer"), encoder.encode("q", "a")
    first = type(first)(first.input_ids + [pad], None, first.anchor_mask[:-1] + [0, 1], 0, 0)
    batch = collate([first, second], pad)
    with torch.no_grad():
        rewards = reward_forward(model, batch).logits[:, 0]
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        transformers_own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    for row, e in enumerate([first, second]):
        read = len(e.input_ids) - 1
        assert e.anchor_mask[read] == 1
        assert rewards[row].item() == pytest.approx(model.score(hidden[row, read]).item(), abs=1e-6)
    assert transformers_own[0].item() != pytest.approx(rewards[0].item(), abs=1e-6)  # it read one token early


# 14. A container's memory limit; gated MLPs found by their modules.

def test_the_memory_limit_is_the_containers_where_it_is_lower(tmp_path):
    from anchor_rm.method.memory_plan import cgroup_memory_limit

    (tmp_path / "v2" / "pod").mkdir(parents=True)
    (tmp_path / "v2" / "memory.max").write_text("max\n")
    (tmp_path / "v2" / "pod" / "memory.max").write_text(f"{8 * 2**30}\n")
    (tmp_path / "cgroup").write_text("0::/pod\n")
    assert cgroup_memory_limit(str(tmp_path / "v2"), str(tmp_path / "cgroup")) == 8 * 2**30
    (tmp_path / "v1" / "memory").mkdir(parents=True)
    (tmp_path / "v1" / "memory" / "memory.limit_in_bytes").write_text(f"{4 * 2**30}\n")
    assert cgroup_memory_limit(str(tmp_path / "v1"), str(tmp_path / "none")) == 4 * 2**30
    (tmp_path / "v1" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    assert cgroup_memory_limit(str(tmp_path / "v1"), str(tmp_path / "none")) is None


@pytest.mark.parametrize("model_type, gated", [("llama", True), ("gemma2", True), ("gemma3_text", True), ("phi3", True),
                                              ("mixtral", True), ("gpt2", False), ("bert", False)])
def test_gated_mlps_are_found_by_their_gate_projection(model_type, gated):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from anchor_rm.method.memory_plan import has_gated_mlp

    config = AutoConfig.for_model(model_type, num_hidden_layers=1, hidden_size=64, intermediate_size=128, n_embd=64,
                                  n_layer=1, n_head=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                  num_labels=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    assert has_gated_mlp(model) is gated
