"""Layer 2, model: a reward model and the one scoring path. Imports the data layer only.

loading.py       model names -> sources (shipped, hub, folders), loading a checkpoint with a scalar head
encoding.py      the one tokenisation and truncation policy (RewardEncoder), batches (collate)
scoring.py       RewardScorer: evaluation, the registered model and the service all score through it
reward_model.py  RewardModel (model, tokenizer, encoder, OOD density): load pretrained or saved, save, export
precision.py     fp32 or bf16 by hardware
lora.py, sharded.py  LoRA adapters and their frozen-base reference; FSDP2 sharding and sharded checkpoints
ood_flag.py      the OOD flag's density on the model's representation, its threshold and measurement
"""
