"""One trial's Ray Train run outside Tune, for the give-up test of tests/test_reliability.py: the TorchTrainer
a Tune trial fits (tuning/trainable.py: train_run, workers running train_loop_per_worker), here with a tiny
student on a few made-up pairs, writing to an MLflow run the test created.

    one_train_run.py <ray address> <spec.json>

spec.json: {"student": model folder, "tracking_uri": ..., "run_id": ..., "storage_path": ...}. The fault
hook and the outage limit reach the workers from this process's environment (tuning.search.init_ray). Exits
0 when the run finished, 3 when it failed, with Ray Train's error on stderr. Fitting again with the same
spec continues from the run's last checkpoint, as a restarted trial does."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import ray.train  # noqa: E402  (the head's token: from the test's environment, tests/helpers.py: ray_head)

from anchor_rm.data.records import PreferencePair  # noqa: E402
from anchor_rm.data.splits import ProtocolSplits  # noqa: E402
from anchor_rm.evaluation.scores import SplitScore  # noqa: E402
from anchor_rm.method.training import TrainConfig  # noqa: E402
from anchor_rm.pipeline.config import ProtocolConfig  # noqa: E402
from tuning.search import init_ray  # noqa: E402
from tuning.trainable import SharedPayload, train_run  # noqa: E402

SOURCE, TARGET = "hh-helpful", "ultrafeedback"
STEPS_PER_EPOCH, EPOCHS = 4, 2  # 16 pairs, 4 per step


def _pairs(dataset: str, n: int) -> list[PreferencePair]:
    return [PreferencePair(f"Question {i} about {dataset}?", f"A careful, correct answer number {i}.",
                           f"No idea {i}.", dataset) for i in range(n)]


def main(address: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    cfg = ProtocolConfig(category="helpful", student=spec["student"], targets=[TARGET], min_gap=None,
                         student_train=TrainConfig(method="naive", epochs=EPOCHS, batch_size=4, max_length=32,
                                                   precision="fp32", length_grouped=False),
                         eval_batch_size=8, precision="fp32")
    splits = ProtocolSplits(SOURCE, [], _pairs(SOURCE, 4 * STEPS_PER_EPOCH), _pairs(SOURCE, 6), [],
                            {TARGET: {"val": _pairs(TARGET, 6), "test": []}})
    teacher_val = {name: asdict(SplitScore(accuracy=50.0, n_pairs=6, tie_rate=0.0, identical_after_truncation=0))
                   for name in (SOURCE, TARGET)}
    payload = SharedPayload(cfg=cfg, splits=splits, soft_labels=[0.7] * len(splits.student_train),
                            teacher_val=teacher_val, headline_targets=[TARGET], tracking_uri=spec["tracking_uri"],
                            experiment_id="", parent_run_id="", storage_path=spec["storage_path"], max_failures=0)
    init_ray(address)
    try:
        train_run({"method": "naive"}, payload, spec["run_id"], "train-giveup").fit()
    except ray.train.TrainingFailedError as exc:
        print(f"the Train run failed: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
