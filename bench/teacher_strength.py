"""How strong is a candidate weak teacher? Trains each named model on gold labels of teacher-train with the
default preset's teacher config and prints its ID accuracy (val and test), to compare with the strong
ceiling that pipelines/train.py reports.

    .venv/bin/python bench/teacher_strength.py minilm-l6-first1 minilm-l6-first2
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from anchor_rm.config import preset  # noqa: E402
from anchor_rm.splits import build_protocol_splits  # noqa: E402
from anchor_rm.workflow import evaluate_pairs, load_pretrained, train_on_pairs  # noqa: E402


def main(names: list[str]) -> None:
    cfg = preset("default")
    splits = build_protocol_splits(cfg.source, cfg.targets, cfg.seed, max_pairs=cfg.max_pairs)
    print("| teacher | ID val acc | ID test acc |\n|---|---|---|")
    for name in names:
        rm = load_pretrained(name, cfg.teacher_train.max_length, cfg.teacher_train.seed)
        train_on_pairs(rm, splits.teacher_train, None, cfg.teacher_train)
        val, test = evaluate_pairs(rm, splits.id_val), evaluate_pairs(rm, splits.id_test)
        print(f"| {name} | {val.accuracy:.1f} (n={val.n_pairs}) | {test.accuracy:.1f} (n={test.n_pairs}) |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["minilm-l6-first1", "minilm-l6-first2"])
