"""Time and peak memory of the data path on a large source (not a test): load, clean, split by prompt and
tokenise the student's training pairs, as `tune.py --source FILE` does before any training. Two loaders:
`streamed` is the project's (splits.build_protocol_splits: two passes over the file, digests in memory, not
texts); `in-memory`, the baseline, is how it worked until session 13: the whole source read into a list, then
splits.clean_pairs, split_by_prompt and subsample on lists. Both give the same splits (tests/test_splits.py).

The source is synthetic, built from the shipped data: HH helpful-base's pairs (2,354) written again and
again as a generic JSONL (`prompt`, `chosen`, `rejected`) until it holds `--pairs` pairs, copy k's prompt
prefixed with "[copy k] " so that every copy is a distinct prompt (the split groups by prompt, and the
cleaning drops exact duplicates). Each size runs in a fresh Python process, so its peak RSS is its own;
the shipped file itself (2,354 pairs) is the baseline.

    .venv/bin/python bench/large_source.py                          # 200,000 pairs, the default protocol's caps
    .venv/bin/python bench/large_source.py --pairs 20000,200000 --out /tmp/large.json
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import machine, markdown_table, positive_int

TARGETS = ["ultrafeedback", "pandalm"]
LOADERS = ("streamed", "in-memory")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="200000", help="comma-separated source sizes (pairs)")
    parser.add_argument("--max-length", type=positive_int, default=128)
    parser.add_argument("--out", help="also write the figures as JSON here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one source file in this process
    parser.add_argument("--loader", choices=LOADERS, help=argparse.SUPPRESS)  # internal, with --one
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(n) for n in args.pairs.split(",") if n]
    except ValueError:
        parser.error(f"--pairs: comma-separated integers, not {args.pairs!r}")
    if not args.sizes or min(args.sizes) < 1:
        parser.error("--pairs: sizes of at least 1")
    return args


def write_synthetic(path: Path, pairs: int) -> int:
    """`pairs` generic JSONL records from the shipped HH helpful-base pairs; returns the file's bytes."""
    from anchor_rm.data.catalog import load_dataset_pairs

    shipped = load_dataset_pairs("hh-helpful-base")
    with open(path, "w") as f:
        for i in range(pairs):
            p = shipped[i % len(shipped)]
            copy = i // len(shipped)
            f.write(json.dumps({"prompt": f"[copy {copy}] {p.prompt}", "chosen": p.chosen, "rejected": p.rejected}) + "\n")
    return path.stat().st_size


def in_memory_splits(source: str, seed: int, caps: dict):
    """The baseline: every dataset read whole into a list, cleaned and split as lists."""
    from anchor_rm.data.catalog import load_dataset_pairs
    from anchor_rm.data.splits import (SOURCE_FRACTIONS, ProtocolSplits, clean_pairs, prompt_group, split_by_prompt,
                                       subsample)

    def capped(pairs, key, name):
        return subsample(pairs, caps[key], seed, f"{name}/{key}") if key in caps else pairs

    kept, counts = clean_pairs(load_dataset_pairs(source))
    groups = {prompt_group(p.prompt) for p in kept}
    parts = {k: capped(v, k, source) for k, v in split_by_prompt(kept, dict(SOURCE_FRACTIONS), seed).items()}
    ood = {}
    for target in TARGETS:
        own = [p for p in clean_pairs(load_dataset_pairs(target))[0] if prompt_group(p.prompt) not in groups]
        ood[target] = {k: capped(v, f"ood_{k}", target) for k, v in split_by_prompt(own, {"val": 0.5, "test": 0.5}, seed).items()}
    return ProtocolSplits(source, parts["teacher_train"], parts["student_train"], parts["id_val"], parts["id_test"], ood,
                          {source: counts.to_dict()}, teacher_calibration=parts["teacher_calibration"])


def measure(source: str, max_length: int, loader: str) -> dict:
    """In this process: the protocol's splits of `source` (the default preset's caps) and the student's
    training pairs tokenised; seconds per stage and peak RSS."""
    from anchor_rm.data.catalog import dataset_digest
    from anchor_rm.data.splits import build_protocol_splits
    from anchor_rm.model.encoding import RewardEncoder
    from anchor_rm.model.loading import load_tokenizer, resolve_model
    from anchor_rm.model.scoring import encode_pairs
    from anchor_rm.pipeline.config import preset

    cfg = preset("default")
    started = time.perf_counter()
    if loader == "streamed":
        splits = build_protocol_splits(source, TARGETS, 0, max_pairs=cfg.max_pairs)
    else:
        splits = in_memory_splits(source, 0, cfg.max_pairs)
    split_s = time.perf_counter() - started
    tokenizer = load_tokenizer(resolve_model("minilm-l6"))
    started = time.perf_counter()
    encoded = encode_pairs(RewardEncoder(tokenizer, max_length, decoder=False), splits.student_train)
    encode_s = time.perf_counter() - started
    every = [splits.teacher_train, splits.teacher_calibration, splits.student_train, splits.id_val, splits.id_test,
             *[v for parts in splits.ood.values() for v in parts.values()]]
    return {"loader": loader, "split_seconds": split_s, "encode_seconds": encode_s, "student_train": len(encoded),
            "counts": splits.counts.get(splits.source, {}),
            "splits_digest": dataset_digest([p for part in every for p in part]),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_in_subprocess(argv: list[str], source: str, loader: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, __file__, *argv, "--one", source, "--loader", loader, "--json-out", str(out)],
                       check=True)
        return json.loads(out.read_text())


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one:
        logging.basicConfig(level=logging.INFO, format="  %(message)s")  # the stages' progress lines
        Path(args.json_out).write_text(json.dumps(measure(args.one, args.max_length, args.loader)))
        return 0
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for size in [None, *args.sizes]:
            if size is None:
                source, label, megabytes = "hh-helpful-base", "shipped hh-helpful-base (2,354)", None
            else:
                source = str(Path(tmp) / f"synthetic-{size}.jsonl")
                megabytes = write_synthetic(Path(source), size) / 1e6
                label = f"synthetic {size:,}"
            for loader in LOADERS:
                result = {"source": label, "file_mb": megabytes, **run_in_subprocess(argv, source, loader)}
                results.append(result)
                print(json.dumps(result), flush=True)
                rows.append([label, loader, "-" if megabytes is None else f"{megabytes:.0f}",
                             f"{result['split_seconds']:.1f}", f"{result['encode_seconds']:.1f}",
                             str(result["student_train"]), f"{result['peak_rss_mb']:.0f}"])
            same = len({r["splits_digest"] for r in results[-len(LOADERS):]}) == 1
            print(f"{label}: both loaders give the same splits: {same}", flush=True)
            if not same:
                raise SystemExit(f"{label}: the loaders' splits differ")
    table = markdown_table(["source", "loader", "file MB", "load + clean + split s", "tokenise student-train s",
                            "student-train pairs", "peak RSS MB"], rows)
    table += f"\n\n{machine()}"
    print("\n" + table)
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results, "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
