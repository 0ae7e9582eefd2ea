"""One process of tests/test_fsdp.py's runs (not a test): trains the tiny Llama with train_reward_model, under
torchrun (2 workers, FSDP2 over gloo) or alone, and writes every step's log and the trained parameters (gathered
whole on rank 0) to the folder given.

    python tests/fsdp_worker.py OUT_DIR ddp [--lora] [--epochs N]                          # one process, unsharded
    torchrun --nproc_per_node N tests/fsdp_worker.py OUT_DIR fsdp2 [--lora] [--epochs N]   # N workers, sharded
    torchrun --nproc_per_node 2 tests/fsdp_worker.py OUT_DIR ddp --frozen-layers 1         # two DDP workers

It also writes OUT_DIR/first_step.pt: every gradient the first optimiser step applied (after clipping) and every
parameter after that step, gathered whole. With --checkpoint, the run leaves a checkpoint of its first epoch in OUT_DIR/checkpoint as a Tune trial does
(save_reward_model on rank 0, sharded.save_sharded on every worker, the scheduler's state), and the weights it
held then in OUT_DIR/first_epoch.pt, and goes on; with --resume CHECKPOINT it starts from that checkpoint's
second epoch, at whatever number of workers it runs with.
The student starts from a saved tiny Llama (OUT_DIR/../base), so that the checkpoint names a base model to read.
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402

from helpers import tiny_llama  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("strategy")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--frozen-layers", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    from anchor_rm.data.records import PreferencePair
    from anchor_rm.method.training import TrainConfig, train_reward_model
    from anchor_rm.model.encoding import RewardEncoder
    from anchor_rm.model.loading import load_reward_model, load_tokenizer, resolve_model
    from anchor_rm.model.lora import add_adapters
    from anchor_rm.model.reward_model import RewardModel, save_reward_model
    from anchor_rm.model.scoring import encode_pairs
    from anchor_rm.model.sharded import load_pretrained_sharded, save_sharded

    tokenizer = load_tokenizer(resolve_model("minilm-l6"))
    base = args.out.parent / "base"
    if rank == 0 and not (base / "config.json").exists():
        tiny_llama(tokenizer, seed=0).save_pretrained(base)
        tokenizer.save_pretrained(base)
    if distributed:
        dist.barrier()
    torch.manual_seed(0)  # the adapters' initialisation, the same in every run
    if distributed and args.strategy == "fsdp2":  # as a trial loads it: meta, sharded, rank 0's weights broadcast
        model = load_pretrained_sharded(str(base), "cpu", precision="fp32", seed=0, lora_rank=4 if args.lora else 0,
                                        lora_alpha=8.0)
        reference = None if args.lora else load_pretrained_sharded(str(base), "cpu", precision="fp32").eval()
    else:
        model = load_reward_model(resolve_model(str(base)))
        reference = None
        if args.lora:
            model = add_adapters(model, 4, 8.0)
        else:
            reference = load_reward_model(resolve_model(str(base))).eval()
    pairs = [PreferencePair(f"question number {i}", f"good answer {i % 7}", f"bad answer {i % 5} " * (i % 3 + 1), "toy")
             for i in range(16)]
    encoder = RewardEncoder(tokenizer, 32, decoder=True)
    encoded = encode_pairs(encoder, pairs)
    config = TrainConfig(method="anchor", anchor_lambda=1.0, anchor_layers="last", epochs=args.epochs, batch_size=8,
                         learning_rate=1e-2, warmup_fraction=0.0, precision="fp32", strategy=args.strategy,
                         lora_rank=4 if args.lora else 0, length_grouped=False, frozen_layers=args.frozen_layers)
    rm = RewardModel(model, tokenizer, encoder, str(base))

    def checkpoint(epoch, core, state) -> None:
        # As in a Tune trial: each worker writes into a folder of its own, then they are put together (Ray Train
        # uploads every worker's folder into the same checkpoint).
        if epoch != 0:
            return
        weights = gathered(model)  # a collective: every worker takes part
        if rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save(weights, args.out / "first_epoch.pt")
        folder = args.out / f"checkpoint-rank{rank}"
        if "sharded_optimizer" in state:
            save_sharded(folder, core, state.pop("sharded_optimizer"))
        if rank == 0:
            save_reward_model(rm, folder)
            torch.save(state, folder / "training_state.pt")
        if distributed:
            dist.barrier()
        if rank == 0:
            for worker in sorted(args.out.glob("checkpoint-rank*")):
                shutil.copytree(worker, args.out / "checkpoint", dirs_exist_ok=True)

    first_step: dict = {}

    def before_first_step(_optimizer, _args, _kwargs) -> None:
        if "gradients" not in first_step:  # gathering is a collective: every worker steps, so every worker is here
            first_step["gradients"] = {name: whole(p.grad).clone() for name, p in model.named_parameters()
                                       if p.grad is not None}

    def after_first_step(_optimizer, _args, _kwargs) -> None:
        if "parameters" not in first_step:
            first_step["parameters"] = gathered(model)

    register_optimizer_step_pre_hook(before_first_step)
    register_optimizer_step_post_hook(after_first_step)
    start_epoch, optimizer_state = 0, None
    if args.resume is not None:
        start_epoch = 1
        optimizer_state = {**torch.load(args.resume / "training_state.pt", weights_only=False), "sharded": args.resume}
    logs = []
    train_reward_model(model, encoded, [0.1 + 0.05 * i for i in range(len(encoded))], config, reference=reference,
                       pad_token_id=tokenizer.pad_token_id, on_step=logs.append,
                       on_epoch_end=checkpoint if args.checkpoint else None,
                       start_epoch=start_epoch, optimizer_state=optimizer_state)
    state = gathered(model)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.out / "parameters.pt")
        torch.save(first_step, args.out / "first_step.pt")
        (args.out / "steps.json").write_text(json.dumps([log.__dict__ for log in logs]))
    if distributed:
        dist.destroy_process_group()


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whole: a sharded one (DTensor) gathered from all workers (call it on every worker)."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def gathered(model) -> dict:
    """Every parameter whole (call it on every worker)."""
    return {name: whole(p).clone() for name, p in model.named_parameters()}


if __name__ == "__main__":
    main()
