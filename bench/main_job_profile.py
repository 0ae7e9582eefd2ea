"""Where the main job's wall time goes, by stage, read from the log `pipelines/tune.py` writes to stderr.

    cd $(mktemp -d) && HOME=$(mktemp -d) /usr/bin/time -v <repo>/.venv/bin/python <repo>/pipelines/tune.py \
        --tracking-uri sqlite:///$PWD/mlflow.db 2> tune.log
    .venv/bin/python bench/main_job_profile.py tune.log

Every line of the log starts with its time (HH:MM:SS); the stages are the spans between the lines that open
them: data, the weak teacher (training, its soft labels, calibration and its validation and test scores), the
strong ceiling (training, validation and test scores), Ray's start and the reference states, each trial (from
Tune starting it to its first epoch's report: worker start, model load, the first epoch's training and
validation; then each further epoch; then its end), and the final evaluation with registration. Prints a
Markdown table; seconds are whole (the log's resolution).

With the job's MLflow store (`--tracking-uri`, the one tune.py wrote to) it also splits each trial by its run's
own millisecond timestamps, which the Ray Train worker writes: start-up (from the run's creation by the trial's
Tune function to the end of the first training step: the Train controller, the worker process, the student's
loading, the frozen reference's states, one step), each epoch's training (its remaining steps) and the validation
after it (the validation passes, until its metrics are logged), and the end (checkpoint, reports, the run's end):

    .venv/bin/python bench/main_job_profile.py tune.log --tracking-uri sqlite:///$PWD/mlflow.db
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TIME = re.compile(r"^(\d\d):(\d\d):(\d\d) (.*)$")
# (pattern, the stage the line starts); the first match wins
MARKERS = [
    (re.compile(r"^experiment "), "start-up (arguments, memory plan, MLflow store)"),
    (re.compile(r"^data "), "data"),
    (re.compile(r"^teacher: training"), "teacher: train, soft labels, calibration, val + test scores"),
    (re.compile(r"^ceiling: training"), "ceiling: train, val + test scores"),
    (re.compile(r"^shared stages .* ready"), "Ray start, headline, reference states"),
    (re.compile(r"^trial (\S+) started"), "trial {0}: start to first epoch (workers, load, epoch 0 train + val)"),
    (re.compile(r"^trial (\S+) epoch (\d+):"), "trial {0}: epoch {1} reported -> next"),
    (re.compile(r"^trial (\S+) finished"), "between trials"),
    (re.compile(r"^selected "), "final evaluation of the selected model and baselines (test), registration"),
]


def timed_lines(text: str) -> list[tuple[int, str]]:
    """(seconds since the first timed line, message) for every line that starts with HH:MM:SS; a time earlier
    than the one before is taken as past midnight."""
    out, last, offset = [], None, 0
    for line in text.splitlines():
        match = TIME.match(line)
        if not match:
            continue
        seconds = int(match[1]) * 3600 + int(match[2]) * 60 + int(match[3]) + offset
        if last is not None and seconds < last:
            offset += 86400
            seconds += 86400
        last = seconds
        out.append((seconds, match[4]))
    if not out:
        raise SystemExit("no line of the log starts with a time (HH:MM:SS): is it tune.py's stderr?")
    start = out[0][0]
    return [(s - start, m) for s, m in out]


def stages(lines: list[tuple[int, str]]) -> list[tuple[str, int]]:
    """Consecutive stages and their seconds: a stage runs from its opening line to the next stage's."""
    opened: list[tuple[str, int]] = []
    for seconds, message in lines:
        for pattern, label in MARKERS:
            match = pattern.match(message)
            if match:
                name = label.format(*match.groups())
                if not opened or opened[-1][0] != name:
                    opened.append((name, seconds))
                break
    end = lines[-1][0]
    return [(name, (opened[i + 1][1] if i + 1 < len(opened) else end) - start) for i, (name, start) in enumerate(opened)]


def trial_splits(tracking_uri: str) -> str:
    """A Markdown table of every trial run in the store: its start-up, training and validation seconds."""
    from mlflow.tracking import MlflowClient

    from anchor_rm.evaluation import keys

    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri[len("sqlite:///"):]).is_file():
        raise SystemExit(f"--tracking-uri {tracking_uri}: no such SQLite file (MLflow would create an empty store)")
    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=f"tags.`{keys.STAGE_TAG}` = 'trial'",
                              order_by=["attributes.start_time ASC"], max_results=1000)
    rows = []
    for run in runs:
        steps = [m.timestamp / 1000 for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"),
                                                     key=lambda m: m.step)]
        validations = [m.timestamp / 1000 for m in sorted(client.get_metric_history(run.info.run_id, "val/mean_nts"),
                                                           key=lambda m: m.step)]
        if not steps or not validations or len(steps) % len(validations):
            continue  # a trial that failed or stopped inside an epoch: no whole epochs to split
        per_epoch = len(steps) // len(validations)
        training, validating, previous = [], [], steps[0]
        for epoch, validated in enumerate(validations):
            last_step = steps[(epoch + 1) * per_epoch - 1]
            training.append(last_step - previous)
            validating.append(validated - last_step)
            previous = validated
        gaps = sorted(b - a for a, b in zip(steps, steps[1:]) if b - a < min(validating))
        end = (run.info.end_time / 1000 - validations[-1]) if run.info.end_time else float("nan")
        rows.append([run.data.tags.get(keys.RUN_NAME_TAG, run.info.run_id), run.data.tags.get(keys.METHOD_TAG, "?"),
                     f"{steps[0] - run.info.start_time / 1000:.1f}", " / ".join(f"{t:.1f}" for t in training),
                     " / ".join(f"{v:.1f}" for v in validating), f"{gaps[len(gaps) // 2]:.3f}" if gaps else "-",
                     f"{end:.1f}"])
    if not rows:
        raise SystemExit(f"no trial run with training steps and validations in {tracking_uri}")
    header = ["trial run", "method", "start-up to first step's end s", "training s per epoch (the first without its first step)",
              "validation s per epoch", "s per step (median)", "last validation to run end s"]
    return "\n".join(["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
                     + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="tune.py's stderr")
    parser.add_argument("--tracking-uri", help="the job's MLflow store: also split each trial by its run's timestamps")
    args = parser.parse_args(argv)
    if not args.log.is_file():
        parser.error(f"{args.log}: no such file (tune.py's stderr, e.g. `2> tune.log`)")
    rows = stages(timed_lines(args.log.read_text(errors="replace")))
    total = sum(seconds for _, seconds in rows)
    print("| stage | s | share |")
    print("|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds} | {100 * seconds / max(total, 1):.0f}% |")
    print(f"| **from the first log line to the last** | **{total}** | |")
    groups: dict[str, int] = {}
    for name, seconds in rows:
        key = ("trials" if name.startswith("trial ") or name == "between trials" else name)
        groups[key] = groups.get(key, 0) + seconds
    print()
    print("By kind: " + "; ".join(f"{k} {v} s ({100 * v / max(total, 1):.0f}%)" for k, v in groups.items()))
    if args.tracking_uri:
        print("\n" + trial_splits(args.tracking_uri))
    return 0


if __name__ == "__main__":
    sys.exit(main())
