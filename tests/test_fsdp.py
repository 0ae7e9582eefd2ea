"""FSDP2 on CPU (gloo): two workers that shard the tiny Llama train it exactly as one process does (the sharded
gradients are averaged, not summed: pytorch#162338), for full fine-tuning with a sharded frozen reference and for
a LoRA student whose reference is itself with its adapters off; and their checkpoint (torch.distributed.checkpoint)
continues at another number of workers and exports to an ordinary Hugging Face folder."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import PYTHON, ROOT, free_port, stop_process_group, wait_http

WORKER = ROOT / "tests" / "fsdp_worker.py"


def _run(out, strategy, workers, lora, *options):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    extra = (["--lora"] if lora else []) + list(options)
    if workers == 1 and strategy != "fsdp2":  # one process, no process group: the unsharded reference run
        cmd = [PYTHON, str(WORKER), str(out), strategy, *extra]
    else:
        cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(workers), "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(WORKER), str(out), strategy, *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "steps.json").read_text()), torch.load(out / "parameters.pt")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_fsdp2_workers_train_as_one_process_does_and_their_checkpoint_continues_on_one_and_exports(tmp_path, lora):
    """Two epochs of 2 steps: two workers against one process (every gradient of the first step and the parameters
    after it; the gradient norm of every step; the parameters at the end); the workers' checkpoint of their first epoch then
    continued by one process, read whole, and exported to an ordinary folder."""
    from anchor_rm.model.reward_model import export_checkpoint, load_saved

    alone_steps, alone = _run(tmp_path / "alone", "ddp", 1, lora, "--epochs", "2")
    sharded_steps, sharded = _run(tmp_path / "sharded", "fsdp2", 2, lora, "--epochs", "2", "--checkpoint")
    assert len(alone_steps) == len(sharded_steps) == 4
    # The first step, parameter by parameter: the gradients it applied (averaged over the two workers' halves of
    # the batch, after clipping) equal the one process's within fp32 rounding (measured: 3e-8 at most, the
    # largest 0.13), and so do the parameters after it. Adam's first update is lr * g / (|g| + eps): a gradient
    # near eps turns fp32 rounding into up to about 4e-6 at learning rate 1e-2 (measured), hence that tolerance.
    alone_first = torch.load(tmp_path / "alone" / "first_step.pt")
    sharded_first = torch.load(tmp_path / "sharded" / "first_step.pt")
    assert alone_first["gradients"].keys() == sharded_first["gradients"].keys() and alone_first["gradients"]
    for name, gradient in alone_first["gradients"].items():
        torch.testing.assert_close(sharded_first["gradients"][name], gradient, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")
    for name, value in alone_first["parameters"].items():
        torch.testing.assert_close(sharded_first["parameters"][name], value, rtol=0, atol=2e-5,
                                   msg=lambda m, name=name: f"{name} after one step: {m}")
    for one, two in zip(alone_steps[:2], sharded_steps[:2]):
        # the whole batch's gradient norm: a sum over workers instead of a mean would double it
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    for one, two in zip(alone_steps[2:], sharded_steps[2:]):  # after steps that differ by fp32 rounding
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-3)
    assert sharded_steps[1]["anchor_loss"] > 0
    assert alone.keys() == sharded.keys()
    # Adam's first steps divide each gradient by its own magnitude, which turns fp32 rounding in the tiniest
    # gradients into differences up to about 1e-5 at learning rate 1e-2 (measured: 6e-6 after one epoch). The
    # gradient norms above are what tells an average from a sum; this says the sharded run trained the same model.
    for name, value in alone.items():
        torch.testing.assert_close(sharded[name], value, rtol=0, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}")

    checkpoint = tmp_path / "sharded" / "checkpoint"
    # every worker's shard, and rank 0's index of them; no gathered weights
    assert sorted(p.name for p in (checkpoint / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not list(checkpoint.glob("*.safetensors"))
    resumed_steps, resumed = _run(tmp_path / "resumed", "fsdp2", 1, lora, "--epochs", "2", "--resume", str(checkpoint))
    assert [s["step"] for s in resumed_steps] == [2, 3] and resumed_steps[0]["learning_rate"] > 0
    assert resumed.keys() == alone.keys()
    for name, value in alone.items():  # the sharded optimizer state came back too: Adam's second epoch is the same
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}")

    # Read whole in this process (no process group): the weights the two workers held after the first epoch.
    after_first = torch.load(tmp_path / "sharded" / "first_epoch.pt")
    as_trained = load_saved(checkpoint, adapters=lora)
    for name, parameter in as_trained.model.named_parameters():
        torch.testing.assert_close(parameter.detach(), after_first[name], rtol=0, atol=0, msg=name)
    prompts, responses = ["question number 3", "hello"], ["good answer 3", "bad answer"]
    expected = load_saved(checkpoint).scorer().score(prompts, responses).rewards
    export_checkpoint(checkpoint)
    assert not (checkpoint / "sharded").exists() and (checkpoint / "model.safetensors").exists()
    assert "sharded" not in json.loads((checkpoint / "anchor_rm.json").read_text())
    assert (checkpoint / "adapter" / "adapter_model.safetensors").exists() == lora
    torch.testing.assert_close(torch.as_tensor(load_saved(checkpoint).scorer().score(prompts, responses).rewards),
                               torch.as_tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_lora_tune_run_sharded_over_two_workers_resumes_and_registers_a_version_the_service_scores(tmp_path):
    """tune.py --lora-rank 8 --strategy fsdp2 --workers-per-trial 2 on a decoder: each trial's LoRA student
    (reference: adapters off) is sharded over two Ray Train workers, its checkpoints are both workers' shards in
    one folder; one worker killed after the first epoch's checkpoint makes Ray Train restart the trial from those
    shards; the selected model is registered as one ordinary folder (merged weights plus adapter/) that the
    service's loader and a `bentoml serve` process score as the library does. The student is a tiny Llama with
    SmolLM2's tokenizer and chat template: SmolLM2-135M itself took about an hour beside another job
    (docs/scaling.md), too long for the suite. (The full fine-tune's shards, resume and export: the test above.)"""
    import numpy as np
    from mlflow.tracking import MlflowClient

    from anchor_rm.evaluation import keys
    from anchor_rm.model.loading import load_tokenizer, resolve_model
    from anchor_rm.model.reward_model import load_saved
    from helpers import assert_history_explained, run_pipeline, sqlite_store, tiny_llama
    import httpx

    from service.config import serve_command
    from service.holder import load_served_model
    from tuning.trainable import STEP_HOOK_ENV

    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    student = tmp_path / "tiny-llama"
    tiny_llama(tokenizer).save_pretrained(student)
    tokenizer.save_pretrained(student)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    killed = tmp_path / "killed"
    # 48 pairs in batches of 8: 6 steps an epoch; step 8 is in the second, after the first epoch's checkpoint
    hook = f"{ROOT / 'tests' / 'fault_hooks.py'}:kill_once_at:8:{killed}"
    proc = run_pipeline("tune.py", "--preset", "smoke", "--student", str(student), "--lora-rank", "8",
                        "--lora-learning-rate", "1e-3", "--strategy", "fsdp2",
                        "--workers-per-trial", "2", "--concurrency", "1", "--num-samples", "1", "--tracking-uri", uri,
                        "--storage-path", str(tmp_path / "ray"), "--num-cpus", "2", cwd=tmp_path,
                        env={STEP_HOOK_ENV: hook}, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "memory plan of the student" in proc.stderr and "adapters off" in proc.stderr
    assert killed.exists()
    checkpoints = [p.parent.parent for p in (tmp_path / "ray").rglob("sharded/.metadata")]
    assert checkpoints and all(sorted(f.name for f in (c / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
                               for c in checkpoints)
    with sqlite_store(tmp_path, "anchor-rm-helpful"):
        client = MlflowClient()
        trials = [r for r in client.search_runs([client.get_experiment_by_name("anchor-rm-helpful").experiment_id])
                  if r.data.params.get("train.method") in ("naive", "confidence", "anchor")]
        assert len(trials) == 3 and all(r.data.params["train.strategy"] == "fsdp2" for r in trials)
        assert all(r.data.params["train.lora_rank"] == "8" for r in trials)
        assert all(r.data.tags[keys.PROCESS_GROUP_TAG] == "gloo" for r in trials)
        resumed = [r for r in trials if keys.RESUMED_FROM_EPOCH_TAG in r.data.tags]
        assert len(resumed) == 1 and resumed[0].data.tags[keys.RESUMED_FROM_EPOCH_TAG] == "0"
        assert assert_history_explained(client, resumed[0].info.run_id, steps_per_epoch=6, epochs=2) == [6]
        served = load_served_model("models:/anchor-rm-helpful/1", tmp_path / "dl")
        folder = next((tmp_path / "dl").rglob("anchor_rm.json")).parent
        assert "sharded" not in json.loads((folder / "anchor_rm.json").read_text())
        assert (folder / "model.safetensors").exists() and not (folder / "sharded").exists()
        assert json.loads((folder / "anchor_rm.json").read_text())["lora"]["rank"] == 8
        assert (folder / "adapter" / "adapter_model.safetensors").exists()  # the adapters beside the merged model
        prompts, responses = ["How do I boil an egg?", "Hi"], ["Boil it for eight minutes.", "Hello, how can I help?"]
        got = served.score(prompts, responses).rewards
        expected = load_saved(folder).scorer().score(prompts, responses).rewards
        assert np.all(np.isfinite(got)) and got[0] != got[1]
        np.testing.assert_allclose(got, expected, atol=1e-5)

    # ... and `bentoml serve` serves that version over HTTP with the same rewards (fp32, as the library scored)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANCHOR_RM_", "BENTOML_", "MLFLOW_"))}
    env.update({"MLFLOW_TRACKING_URI": uri, "ANCHOR_RM_MODEL_URI": "models:/anchor-rm-helpful/1", "ANCHOR_RM_PRECISION": "fp32",
                "ANCHOR_RM_POLL_SECONDS": "0", "ANCHOR_RM_DOWNLOAD_DIR": str(tmp_path / "served"),
                "BENTOML_HOME": str(tmp_path / "bentoml"), "BENTOML_DO_NOT_TRACK": "true", "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(serve_command(port), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=180, proc=server)
        answer = httpx.post(f"http://127.0.0.1:{port}/score", timeout=60,
                            json={"items": [{"prompt": p, "response": r} for p, r in zip(prompts, responses)]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"]["version"] == "1"
        in_fp32 = load_saved(folder).scorer(precision="fp32").score(prompts, responses).rewards
        np.testing.assert_allclose(answer.json()["rewards"], in_fp32, atol=1e-5)
    finally:
        stop_process_group(server)
