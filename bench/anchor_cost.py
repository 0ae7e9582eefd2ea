"""What ANCHOR costs over naive W2S training, per epoch, on the same model, data, batch size and max length
(not a test).

Variants, each trained from the same pretrained weights on the same pairs and batches:

    naive                 lambda = 0: no reference at all
    anchor-last-cached    the frozen reference's last-layer states on response tokens, computed once
                          (reference_cache.compute_reference_states) and read back every step from RAM
    anchor-last-disk      the same states in a memory-mapped file per layer (the disk cache: DiskReferenceStates)
    anchor-middle-cached  the RAM cache at the middle layers (50% and 75% of depth)
    anchor-last-uncached  the reference's forward pass in every training step (live: no cache)
    naive-frozen2         naive, with the embeddings and the lowest 2 layers frozen (TrainConfig.frozen_layers,
                          `--frozen-layers 2`: no backward pass through them, no optimiser state for them)
    anchor-middle-frozen2 anchor-middle-cached with the same 2 layers frozen (the middle layers, 3 and 5 of
                          MiniLM-L6's 6, stay trainable)

Each (variant, repeat) runs in a fresh Python process, so its peak RSS is its own; the variants are
interleaved within each repeat (the order rotates) so that a change in machine load hits all of them. An
ANCHOR variant's first epoch includes loading the reference and, cached, building the cache. Ratios are
taken within a repeat (variant epoch / naive epoch of the same repeat), then the median over repeats.

    .venv/bin/python bench/anchor_cost.py                          # MiniLM-L6, 128 pairs, 3 epochs, 2 repeats
    .venv/bin/python bench/anchor_cost.py --pairs 32 --epochs 2 --repeats 1 --max-length 64   # a quick check
    .venv/bin/python bench/anchor_cost.py --model smollm2-135m --device cuda
    .venv/bin/python bench/anchor_cost.py --variants naive,naive-frozen2,anchor-middle-cached,anchor-middle-frozen2 \
        --pairs 64 --epochs 2 --max-length 128 --repeats 3     # what freezing saves (docs/benchmarks.md)

Prints a Markdown table for docs/benchmarks.md; --out also writes every measurement as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import Disturbance, machine, markdown_table, median, peak_rss_mb, positive_int, source_splits

# variant -> (method, layer choice, where the reference's states live: ram, disk, or live; frozen lower layers)
VARIANTS = {
    "naive": ("naive", None, None, 0),
    "anchor-last-cached": ("anchor", "last", "ram", 0),
    "anchor-last-disk": ("anchor", "last", "disk", 0),
    "anchor-middle-cached": ("anchor", "middle", "ram", 0),
    "anchor-last-uncached": ("anchor", "last", "live", 0),
    "naive-frozen2": ("naive", None, None, 2),
    "anchor-middle-frozen2": ("anchor", "middle", "ram", 2),
}
DEFAULT_VARIANTS = ("naive", "anchor-last-cached", "anchor-middle-cached", "anchor-last-uncached")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minilm-l6", help="student (short name, folder or hub id)")
    parser.add_argument("--source", default="hh-helpful-base", help="training pairs: the source's student-train split")
    parser.add_argument("--pairs", type=positive_int, default=128, help="training pairs (a seeded subsample)")
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--max-length", type=positive_int, default=192, help="tokens per (prompt, response)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="rounds of all variants")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    parser.add_argument("--anchor-lambda", type=float, default=0.1)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="training precision (auto, the trainer's default: bf16 only on native-bf16 hardware)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write every measurement as JSON here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant in this process
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants: unknown {unknown or 'empty'}; choose from {', '.join(VARIANTS)}")
    if "naive" not in variants:
        parser.error("--variants must include naive: every ratio is taken against it")
    if args.anchor_lambda <= 0:
        parser.error(f"--anchor-lambda must be > 0, got {args.anchor_lambda}")
    if args.device not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    args.variant_list = variants
    from anchor_rm.model.precision import resolve_precision

    args.precision = resolve_precision(args.precision, args.device)
    return args


def run_one(args: argparse.Namespace, variant: str) -> dict:
    """One training run of one variant in this process: per-epoch seconds, setup, peak memory."""
    import numpy as np
    import torch

    from anchor_rm.method.losses import resolve_anchor_layers
    from anchor_rm.method.reference_cache import compute_reference_states
    from anchor_rm.method.stages import frozen_reference
    from anchor_rm.method.training import TrainConfig, train_reward_model
    from anchor_rm.model.reward_model import load_pretrained

    method, layer_choice, cache, frozen_layers = VARIANTS[variant]
    device = torch.device(args.device)
    splits = source_splits(args.source, args.seed, {"student_train": args.pairs})
    rm = load_pretrained(args.model, args.max_length, args.seed)
    rm.model.to(device)
    encoded = rm.encode(splits.student_train)
    # Label values do not change the time; seeded soft labels stand in for a teacher's.
    targets = np.random.default_rng(args.seed).uniform(0.3, 0.9, len(encoded)).tolist()
    config = TrainConfig(method=method, anchor_lambda=args.anchor_lambda if method == "anchor" else 0.0,
                         anchor_layers=layer_choice or "last", epochs=args.epochs, batch_size=args.batch_size,
                         learning_rate=1e-4, max_length=args.max_length, seed=args.seed, precision=args.precision,
                         frozen_layers=frozen_layers)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_before = peak_rss_mb()

    started = time.perf_counter()
    reference, cache_mb = None, 0.0
    if config.uses_anchor:
        reference = frozen_reference(args.model).to(device)
        if cache in ("ram", "disk"):
            layers = resolve_anchor_layers(layer_choice, rm.model.config.num_hidden_layers)
            # Replacing the variable drops the reference model: only its states stay (in memory, or on disk).
            scratch = Path(args.json_out).parent if args.json_out else Path(tempfile.mkdtemp(prefix="anchor-cost-"))
            folder = scratch / "reference-cache" if cache == "disk" else None  # removed with the run's temp folder
            reference = compute_reference_states(reference, encoded, layers, rm.encoder.pad_token_id,
                                                 batch_size=32, precision=config.precision, into=folder)
            cache_mb = reference.nbytes() / 2**20
    setup_s = time.perf_counter() - started

    epoch_ends: list[float] = []

    def on_epoch_end(epoch: int, model, optimizer_state: dict) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        epoch_ends.append(time.perf_counter())

    logs = []
    train_reward_model(rm.model, encoded, targets, config, reference=reference, pad_token_id=rm.encoder.pad_token_id,
                       on_step=logs.append, on_epoch_end=on_epoch_end)
    bounds = [started] + epoch_ends
    tokens = sum(len(s.input_ids) for s in encoded.chosen + encoded.rejected)
    return {
        "variant": variant, "pairs": len(encoded), "epoch_seconds": [b - a for a, b in zip(bounds, bounds[1:])],
        "setup_seconds": setup_s, "cache_mb": cache_mb, "rss_before_mb": rss_before, "peak_rss_mb": peak_rss_mb(),
        "peak_vram_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
        "tokens_per_epoch": tokens, "last_anchor_loss": logs[-1].anchor_loss, "last_loss": logs[-1].loss,
    }


def run_in_subprocess(argv: list[str], variant: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        with Disturbance() as d:
            subprocess.run([sys.executable, __file__, *argv, "--one", variant, "--json-out", str(out)], check=True)
        return {**json.loads(out.read_text()), "others": d.fraction, "disturbed": d.disturbed}


def undisturbed(mine: list[dict], naive: list[dict]) -> list[tuple[dict, dict]]:
    """(variant, naive) runs of the same repeat where neither was disturbed (the rule stated beforehand)."""
    return [(m, n) for m, n in zip(mine, naive) if not (m["disturbed"] or n["disturbed"])]


def per_repeat(args: argparse.Namespace, runs: dict[str, list[dict]]) -> str:
    """Every repeat's epochs-2+ ratio against naive, with what other processes took while each ran."""
    rows = []
    for variant in args.variant_list:
        for repeat, (m, n) in enumerate(zip(runs[variant], runs["naive"])):
            later = sum(m["epoch_seconds"][1:]) / sum(n["epoch_seconds"][1:]) if args.epochs > 1 else float("nan")
            flag = " (disturbed: left out)" if m["disturbed"] or n["disturbed"] else ""
            rows.append([variant, str(repeat + 1), " ".join(f"{s:.1f}" for s in m["epoch_seconds"]),
                         f"{later:.3f}{flag}", f"{m['others']:.0%}"])
    return markdown_table(["variant", "repeat", "epoch s", "epochs 2+ over naive", "other processes"], rows)


def summarise(args: argparse.Namespace, runs: dict[str, list[dict]]) -> str:
    epochs = args.epochs
    naive = runs["naive"]
    naive_rss = median([r["peak_rss_mb"] for r in naive])
    header = (["variant"] + [f"epoch {e + 1} s" for e in range(epochs)] + [f"ratio epoch {e + 1}" for e in range(epochs)]
              + ["ratio epochs 2+" if epochs > 1 else "ratio", "setup s", "cache MB", "peak RSS MB", "extra RSS MB"])
    if args.device == "cuda":
        header.append("peak VRAM MB")
    rows = []
    for variant in args.variant_list:
        mine = runs[variant]
        kept = undisturbed(mine, naive)
        seconds = [median([m["epoch_seconds"][e] for m, _ in kept]) for e in range(epochs)]
        ratios = [median([m["epoch_seconds"][e] / n["epoch_seconds"][e] for m, n in kept]) for e in range(epochs)]
        later = median([sum(m["epoch_seconds"][1:]) / sum(n["epoch_seconds"][1:]) for m, n in kept]) if epochs > 1 else ratios[0]
        rss = median([r["peak_rss_mb"] for r in mine])
        row = ([variant] + [f"{s:.1f}" for s in seconds] + [f"{r:.3f}" for r in ratios]
               + [f"{later:.3f}", f"{median([r['setup_seconds'] for r in mine]):.1f}",
                  f"{median([r['cache_mb'] for r in mine]):.1f}", f"{rss:.0f}", f"{rss - naive_rss:+.0f}"])
        if args.device == "cuda":
            row.append(f"{median([r['peak_vram_mb'] for r in mine]):.0f}")
        rows.append(row)
    first = naive[0]
    notes = [
        f"{args.model}, {first['pairs']} pairs of {args.source} student-train, batch {args.batch_size}, max length "
        f"{args.max_length}, {epochs} epochs, {'bf16 autocast' if args.precision == 'bf16' else 'fp32'}, lambda {args.anchor_lambda}, "
        f"{args.repeats} repeats (medians of the undisturbed ones), {first['tokens_per_epoch']} tokens per epoch; {machine()}",
        "last-step anchor loss: " + ", ".join(
            f"{v} {median([r['last_anchor_loss'] for r in runs[v]]):.3g}" for v in args.variant_list if v != "naive"),
    ]
    return markdown_table(header, rows) + "\n\n" + "\n".join(notes)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one:
        if args.one not in VARIANTS:
            raise SystemExit(f"unknown variant {args.one!r}")
        result = run_one(args, args.one)
        Path(args.json_out).write_text(json.dumps(result))
        return 0
    runs: dict[str, list[dict]] = {v: [] for v in args.variant_list}
    for repeat in range(args.repeats):
        order = args.variant_list[repeat % len(args.variant_list):] + args.variant_list[: repeat % len(args.variant_list)]
        for variant in order:
            result = run_in_subprocess(argv, variant)
            runs[variant].append(result)
            print(f"repeat {repeat + 1}/{args.repeats} {variant}: epochs "
                  + " ".join(f"{s:.1f}" for s in result["epoch_seconds"])
                  + f" s (setup {result['setup_seconds']:.1f} s), peak RSS {result['peak_rss_mb']:.0f} MB", flush=True)
    # Ratios pair the runs of one repeat; the lists are in repeat order for every variant.
    table = summarise(args, runs) + "\n\nEvery repeat:\n\n" + per_repeat(args, runs)
    print("\n" + table)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("one", "json_out")},
                                              "runs": runs, "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
