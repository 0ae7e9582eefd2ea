"""One process of tests/test_fsdp.py's runs (not a test): trains the tiny Llama for two steps with
train_reward_model, under torchrun (2 workers, FSDP2 or DDP over gloo) or alone, and writes every step's log and
the trained parameters (gathered whole on rank 0) to the folder given.

    python tests/fsdp_worker.py OUT_DIR STRATEGY [--lora]                                  # one process
    torchrun --nproc_per_node 2 tests/fsdp_worker.py OUT_DIR fsdp2 [--lora]                # two workers
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from helpers import tiny_llama  # noqa: E402


def main() -> None:
    out, strategy, lora = Path(sys.argv[1]), sys.argv[2], "--lora" in sys.argv
    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    from anchor_rm.data import PreferencePair
    from anchor_rm.encoding import RewardEncoder
    from anchor_rm.lora import add_adapters
    from anchor_rm.models import load_tokenizer, resolve_model
    from anchor_rm.scoring import encode_pairs
    from anchor_rm.training import TrainConfig, train_reward_model

    tokenizer = load_tokenizer(resolve_model("minilm-l6"))
    model = tiny_llama(tokenizer, seed=0)
    reference = None
    if lora:
        model = add_adapters(model, 4, 8.0)
    else:
        reference = tiny_llama(tokenizer, seed=0).eval()
    pairs = [PreferencePair(f"question number {i}", f"good answer {i % 7}", f"bad answer {i % 5} " * (i % 3 + 1), "toy")
             for i in range(16)]
    encoded = encode_pairs(RewardEncoder(tokenizer, 32, decoder=True), pairs)
    config = TrainConfig(method="anchor", anchor_lambda=1.0, anchor_layers="last", epochs=1, batch_size=8,
                         learning_rate=1e-2, warmup_fraction=0.0, precision="fp32", strategy=strategy,
                         lora_rank=4 if lora else 0, length_grouped=False)
    logs = []
    train_reward_model(model, encoded, [0.1 + 0.05 * i for i in range(len(encoded))], config, reference=reference,
                       pad_token_id=tokenizer.pad_token_id, on_step=logs.append)
    state = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for name, p in model.named_parameters()}
    rank = dist.get_rank() if distributed else 0
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "parameters.pt")
        (out / "steps.json").write_text(json.dumps([log.__dict__ for log in logs]))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
