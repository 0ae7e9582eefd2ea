"""Naive W2S training: our trainer against TRL's RewardTrainer, side by side (not a test).

Both start from the same pretrained weights and the same fresh reward head, train on the same pairs with
the same batch size, max length, epochs, learning rate, schedule (linear, 10% warm-up), weight decay,
gradient clipping, dropout (off) and precision (`--precision`, default auto: bf16 autocast on hardware with
native bf16, else fp32), and are scored by the same scorer, in fp32, on the same ID test split. What differs is the
training loop, and the attention kernel's precision on a CPU under bf16 autocast: ours computes SDPA attention in
fp32 there (anchor_rm.model.precision.use_cpu_fp32_attention, for every model the project loads), TRL gets the model
with transformers' own SDPA attention, as `from_pretrained` gives it (bf16 under autocast):

    ours-soft     our trainer on the teacher's soft labels q (the project's naive W2S)
    ours-hard     our trainer on the teacher's hard labels (q > 0.5 -> 1, else 0): TRL's exact loss
    ours-bf16-attention  ours-hard with transformers' SDPA attention, in bf16 under autocast as TRL's (the trainer
                  before attention moved to fp32 on CPU); the same as ours-hard in fp32 or on a GPU
    ours-random   ours-hard with random batches instead of length-grouped ones
    ours-unfused  ours-hard with the unfused AdamW the trainer used before issue 5 (torch's CPU default)
    ours-soft-fp32  ours-soft in fp32 whatever --precision says: does bf16 cost accuracy? (not in the default set)
    trl           TRL RewardTrainer on the hard labels (each pair oriented by the teacher), its default sampler
    trl-grouped   the same with train_sampling_strategy="group_by_length"

TRL is given the hard labels: its margin option computes -log sigmoid(r_c - r_r - m), which keeps pushing
the margin up and has no minimum at sigmoid(r_c - r_r) = q, so it cannot carry soft labels. TRL gets the
very token sequences our encoder makes (prompt cut from the left, text pair with token type ids) as
`chosen_ids`/`rejected_ids`: its own max_length would drop long pairs instead of truncating them.

    .venv/bin/python bench/bench_trl.py                    # MiniLM-L6, 320 pairs, 2 epochs, batch 16, 192 tokens
    .venv/bin/python bench/bench_trl.py --trainers ours-hard,trl --seeds 0,1,2   # speed and accuracy over 3 seeds

A seed fixes the splits, the teacher, the fresh head and the batch order. Every (seed, repeat, trainer) is
shown; one during which other processes took more than 10% of the CPU (bench/bench_common.Disturbance, a rule
fixed before the run) is marked and left out of the pairs/s medians; accuracies are kept (they do not
depend on load).
    .venv/bin/python bench/bench_trl.py --train-pairs 32 --test-pairs 32 --epochs 1 --max-length 64 --labels gold

Needs the benchmark extra: `.venv/bin/pip install -e '.[bench]'` (trl).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench_common import Disturbance, machine, markdown_table, positive_int, source_splits

TRAINERS = ("ours-soft", "ours-hard", "ours-bf16-attention", "ours-random", "ours-unfused", "trl", "trl-grouped",
            "ours-soft-fp32")
DEFAULT_TRAINERS = TRAINERS[:-1]
TRANSFORMERS_ATTENTION = "sdpa"  # what transformers' from_pretrained picks for these models, and TRL trains with


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minilm-l6", help="student (short name, folder or hub id)")
    parser.add_argument("--teacher", default="minilm-l6-first2", help="weak teacher that labels the training pairs")
    parser.add_argument("--labels", choices=["teacher", "gold"], default="teacher",
                        help="teacher: weak labels (W2S); gold: the dataset's own labels (no teacher to train)")
    parser.add_argument("--source", default="hh-helpful-base")
    parser.add_argument("--teacher-pairs", type=positive_int, default=320)
    parser.add_argument("--train-pairs", type=positive_int, default=320)
    parser.add_argument("--test-pairs", type=positive_int, default=10_000, help="cap on the ID test split")
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--max-length", type=positive_int, default=192)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="training precision of both trainers (auto: bf16 autocast only on native-bf16 hardware)")
    parser.add_argument("--trainers", default=",".join(DEFAULT_TRAINERS), help="comma-separated subset of " + ", ".join(TRAINERS))
    parser.add_argument("--repeats", type=positive_int, default=1, help="rounds of all trainers (order rotates)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--out", help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    args.trainer_list = [t for t in args.trainers.split(",") if t]
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.seed_list:
        parser.error("--seeds is empty")
    unknown = [t for t in args.trainer_list if t not in TRAINERS]
    if unknown or not args.trainer_list:
        parser.error(f"--trainers: unknown {unknown or 'empty'}; choose from {', '.join(TRAINERS)}")
    if args.learning_rate <= 0:
        parser.error(f"--learning-rate must be > 0, got {args.learning_rate}")
    from anchor_rm.model.precision import resolve_precision

    args.precision = resolve_precision(args.precision)  # once, here: both trainers get the same
    return args


def train_config(args: argparse.Namespace, **overrides):
    from anchor_rm.method.training import TrainConfig

    return TrainConfig(**{"method": "naive", "epochs": args.epochs, "batch_size": args.batch_size,
                          "learning_rate": args.learning_rate, "max_length": args.max_length, "seed": args.seed,
                          "precision": args.precision, **overrides})


def weak_labels(args: argparse.Namespace, splits) -> list[float]:
    """q per student-train pair: the teacher's P(chosen preferred), or 1.0 with --labels gold."""
    from anchor_rm.method.stages import soft_labels, train_on_pairs
    from anchor_rm.model.reward_model import load_pretrained

    if args.labels == "gold":
        return [1.0] * len(splits.student_train)
    started = time.perf_counter()
    teacher = load_pretrained(args.teacher, args.max_length, args.seed)
    train_on_pairs(teacher, splits.teacher_train, None, train_config(args, method="gold", epochs=2))
    q = soft_labels(teacher, splits.student_train).tolist()
    print(f"teacher {args.teacher} trained on {len(splits.teacher_train)} gold pairs in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return q


def train_ours(args: argparse.Namespace, trainer: str, rm, encoded, q: list[float]) -> float:
    import torch

    from anchor_rm.method.training import train_reward_model

    targets = q if trainer.startswith("ours-soft") else [1.0 if p >= 0.5 else 0.0 for p in q]
    overrides = {"length_grouped": trainer != "ours-random"}
    if trainer == "ours-soft-fp32":
        overrides["precision"] = "fp32"
    config = train_config(args, **overrides)
    adamw = torch.optim.AdamW
    if trainer == "ours-unfused":  # the trainer as it was before it asked for the fused kernel
        torch.optim.AdamW = lambda params, **kwargs: adamw(params, **{**kwargs, "fused": False})
    try:
        started = time.perf_counter()
        train_reward_model(rm.model, encoded, targets, config, pad_token_id=rm.encoder.pad_token_id)
        return time.perf_counter() - started
    finally:
        torch.optim.AdamW = adamw


def train_trl(args: argparse.Namespace, trainer: str, rm, encoded, q: list[float]) -> float:
    import torch
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference
    from trl.trainer.utils import pad

    class PairCollator(DataCollatorForPreference):
        """TRL's collator, plus the token type ids our encoder gives a text pair (zeros for decoders)."""

        def torch_call(self, examples):
            out = super().torch_call(examples)
            types = [torch.tensor(e["chosen_types"]) for e in examples] + [torch.tensor(e["rejected_types"]) for e in examples]
            out["token_type_ids"] = pad(types, padding_value=0, padding_side="right")
            return out

    rows = {"chosen_ids": [], "rejected_ids": [], "chosen_types": [], "rejected_types": [], "length": []}
    for c, r, p in zip(encoded.chosen, encoded.rejected, q):
        first, second = (c, r) if p >= 0.5 else (r, c)  # the teacher's hard label orients the pair
        rows["chosen_ids"].append(first.input_ids)
        rows["rejected_ids"].append(second.input_ids)
        rows["chosen_types"].append(first.token_type_ids or [0] * len(first.input_ids))
        rows["rejected_types"].append(second.token_type_ids or [0] * len(second.input_ids))
        rows["length"].append(max(len(first.input_ids), len(second.input_ids)))
    with tempfile.TemporaryDirectory() as tmp:
        config = RewardConfig(
            output_dir=tmp, per_device_train_batch_size=args.batch_size, num_train_epochs=args.epochs,
            learning_rate=args.learning_rate, lr_scheduler_type="linear", warmup_steps=0.1, weight_decay=0.01,
            max_grad_norm=1.0, bf16=args.precision == "bf16", activation_checkpointing=False, disable_dropout=True,
            max_length=None,  # the sequences are already truncated as ours are
            train_sampling_strategy="group_by_length" if trainer == "trl-grouped" else "random",
            remove_unused_columns=False, save_strategy="no", eval_strategy="no", report_to="none",
            logging_steps=10_000, disable_tqdm=True, use_cpu=not torch.cuda.is_available(), seed=args.seed,
            dataloader_num_workers=0,
        )
        trl_trainer = RewardTrainer(model=rm.model, args=config, train_dataset=Dataset.from_dict(rows),
                                    processing_class=rm.tokenizer,
                                    data_collator=PairCollator(pad_token_id=rm.encoder.pad_token_id))
        print(f"{trainer}: accelerate mixed precision {trl_trainer.accelerator.mixed_precision}, optimiser "
              f"{config.optim}, sampler {config.train_sampling_strategy}", flush=True)
        started = time.perf_counter()
        trl_trainer.train()
        seconds = time.perf_counter() - started
        # accelerate wrapped the model's forward in bf16 autocast for training; score it in fp32 as ours is.
        rm.model = trl_trainer.accelerator.unwrap_model(trl_trainer.model, keep_fp32_wrapper=False)
    return seconds


def run_trainer(args: argparse.Namespace, trainer: str, splits, q: list[float]) -> dict:
    from anchor_rm.evaluation.metrics import pairwise_accuracy, tie_rate
    from anchor_rm.model.reward_model import load_pretrained

    rm = load_pretrained(args.model, args.max_length, args.seed)  # the same weights and head for every trainer
    if trainer.startswith("trl") or trainer == "ours-bf16-attention":
        rm.model.set_attn_implementation(TRANSFORMERS_ATTENTION)
    encoded = rm.encode(splits.student_train)
    kept_q = [q[i] for i in encoded.kept]
    seconds = (train_trl if trainer.startswith("trl") else train_ours)(args, trainer, rm, encoded, kept_q)
    test = rm.encode(splits.id_test)
    started = time.perf_counter()
    chosen, rejected = rm.scorer(precision="fp32").score_pairs(test)
    return {"trainer": trainer, "pairs": len(encoded), "seconds": seconds,
            "pairs_per_second": len(encoded) * args.epochs / seconds,
            "id_test_accuracy": pairwise_accuracy(chosen, rejected), "id_test_ties": tie_rate(chosen, rejected),
            "id_test_pairs": len(test), "eval_seconds": time.perf_counter() - started,
            "hard_label_agreement": 100.0 * sum(p >= 0.5 for p in kept_q) / len(kept_q)}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import trl
    except ImportError:
        raise SystemExit("bench_trl.py needs TRL: .venv/bin/pip install -e '.[bench]'") from None
    import statistics

    results: dict[str, list[dict]] = {t: [] for t in args.trainer_list}
    for seed in args.seed_list:
        args.seed = seed
        splits = source_splits(args.source, seed, {"teacher_train": args.teacher_pairs, "student_train": args.train_pairs,
                                                   "id_test": args.test_pairs})
        q = weak_labels(args, splits)
        for repeat in range(args.repeats):
            k = repeat % len(args.trainer_list)
            for trainer in args.trainer_list[k:] + args.trainer_list[:k]:
                with Disturbance() as d:
                    result = run_trainer(args, trainer, splits, q)
                result.update(seed=seed, repeat=repeat + 1, others=d.fraction, disturbed=d.disturbed)
                results[trainer].append(result)
                print(json.dumps(result), flush=True)

    def med(trainer: str, key: str) -> float:
        kept = [r[key] for r in results[trainer] if not (key == "pairs_per_second" and r["disturbed"])]
        return statistics.median(kept) if kept else float("nan")

    def mean_accuracy(trainer: str) -> float:
        return statistics.mean(r["id_test_accuracy"] for r in results[trainer])

    base = "trl" if "trl" in results else args.trainer_list[0]
    rows = [[t, f"{med(t, 'pairs_per_second'):.2f}", f"{med(t, 'pairs_per_second') / med(base, 'pairs_per_second'):.2f}",
             f"{med(t, 'seconds'):.0f}", f"{mean_accuracy(t):.1f}", f"{mean_accuracy(t) - mean_accuracy(base):+.1f}",
             f"{med(t, 'id_test_ties'):.1f}"]
            for t in args.trainer_list]
    table = markdown_table(["trainer", "pairs/s (median)", f"vs {base}", "train s", "ID test acc (mean)",
                            f"acc - {base}", "ties %"], rows)
    every = [[str(r["seed"]), str(r["repeat"]), t, f"{r['pairs_per_second']:.2f}", f"{r['id_test_accuracy']:.1f}",
              f"{r['others']:.0%}" + (" disturbed" if r["disturbed"] else "")]
             for t in args.trainer_list for r in results[t]]
    table += "\n\nEvery run:\n\n" + markdown_table(["seed", "repeat", "trainer", "pairs/s", "ID test acc",
                                                       "other processes"], sorted(every))
    first = next(iter(results.values()))[0]
    note = (f"{args.model}, {first['pairs']} {args.source} student-train pairs x {args.epochs} epochs, batch "
            f"{args.batch_size}, max length {args.max_length}, lr {args.learning_rate}, "
            f"{'bf16 autocast' if args.precision == 'bf16' else 'fp32'} training, labels: {args.labels}"
            + (f" ({args.teacher} on {len(splits.teacher_train)} gold pairs)" if args.labels == "teacher" else "")
            + f"; ID test {first['id_test_pairs']} pairs; seeds {args.seeds}, {args.repeats} repeat(s) each; "
            f"trl {trl.__version__}; {machine()}")
    print("\n" + table + "\n\n" + note)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results, "table": table, "note": note}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
