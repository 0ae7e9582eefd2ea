"""The preference-shift study: both categories, every method, an ANCHOR lambda sweep per layer choice,
three seeds, representation drift; then the tables and plots of docs/results.md.

    python pipelines/study.py                         # the whole study into ./study (hours on 2 CPU cores; resumable)
    python pipelines/study.py --categories helpful --seeds 0 --out study-helpful
    python pipelines/study.py --preset smoke --seeds 0 --lambdas 1e-2 --out smoke   # a few minutes: the whole path
    python pipelines/study.py --categories harmless --seeds 0 --student smollm2-135m --lora-rank 16 \
        --lora-alpha 32 --lora-learning-rate 1e-3 --layers last --lambdas 10,1000 --confidence-alphas "" \
        --teacher-labels calibrated --out study-decoder      # a decoder student with LoRA (hours on 2 CPU cores)

Every run goes to the MLflow experiment `anchor-rm-study` (--experiment). Each student is a run keyed by its
inputs: run the same command again after an interruption and finished students are read back, not trained
again; once all are finished, the same command only rebuilds the tables and plots (a minute). Progress lines
say how many students are done and about how long the rest will take.

Each finished (category, seed) is also recorded in <out>/instances/ with the key of its inputs: a later run
with the same --out reads it back with no MLflow store (another machine, a fresh clone), so a long study can
be finished a few seeds at a time. A folder holding another study's study.json is refused, not written over.
--adopt takes over the instances of an earlier study.json that were made with this command's settings and the
same split sizes (say, seeds 0-4 of a study this one extends to 9).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from anchor_rm.cli.common import SCALE_FIELDS, add_precision_argument, add_scale_arguments, clean_errors, setup_logging

log = logging.getLogger("anchor_rm")


def _floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _budgets(text: str) -> list[tuple[float, int]]:
    try:
        return [(float(lr), int(epochs)) for lr, epochs in (part.split(":") for part in text.split(",") if part.strip())]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated learning_rate:epochs, e.g. 1e-4:2,3e-4:2; "
                                         f"got {text!r}") from None


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--categories", type=_names, default=["helpful", "harmless"], help="helpful,harmless (default both)")
    p.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--lambdas", type=_floats, default=[1e-5, 1e-4, 1e-3, 1e-2, 1e-1],
                   help="ANCHOR lambdas besides 0, which is the naive row (default 1e-5,1e-4,1e-3,1e-2,1e-1)")
    p.add_argument("--layers", type=_names, default=["last", "middle"], help="ANCHOR layer choices (default last,middle)")
    p.add_argument("--confidence-alphas", type=_floats, default=[0.5, 0.75],
                   help="confidence W2S settings tuned on validation (default 0.5,0.75)")
    p.add_argument("--teacher-labels", type=_names, default=[],
                   help="the teacher's labels every method trains on, then others for an extra naive W2S row each: "
                        "raw, calibrated (temperature-scaled on gold teacher_calibration pairs); default: the "
                        "preset's, then the other")
    p.add_argument("--budgets", type=_budgets, default=[],
                   help="learning_rate:epochs budgets searched per seed on naive W2S's validation ID accuracy; the "
                        "chosen one trains every method (default: none, the preset's 1e-4:2)")
    p.add_argument("--preset", choices=["study", "smoke"], default="study",
                   help="study: the sizes of docs/results.md; smoke: tiny, for tests")
    add_precision_argument(p)
    p.add_argument("--student", default="",
                   help="the strong student: short name (smollm2-135m), folder or hub id (default: the preset's, minilm-l6)")
    add_scale_arguments(p)
    p.add_argument("--out", default="study",
                   help="folder for study.json, tables.md, the plots and instances/ (default ./study); one that "
                        "holds another study's study.json is refused")
    p.add_argument("--adopt", action="append", default=[], metavar="STUDY_JSON",
                   help="an earlier study.json whose instances with this command's settings and split sizes are taken "
                        "over instead of computed (repeatable)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)")
    p.add_argument("--experiment", default="anchor-rm-study", help="MLflow experiment name (default anchor-rm-study)")
    p.add_argument("--verbose", action="store_true")
    return p


def _read_study(path: str) -> dict:
    """An earlier study.json for --adopt, or a ValueError naming the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--adopt {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--adopt {path}: not JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict) or not isinstance(data.get("instances"), list):
        raise ValueError(f"--adopt {path}: not a study.json (it needs 'config' and 'instances')")
    return data


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    with clean_errors():
        from anchor_rm.evaluation.report_files import write_atomically
        from anchor_rm.mlflow_edge.store import configure, resolve_tracking_uri
        from anchor_rm.pipeline.study import StudyConfig, check_out_folder, run_study
        from anchor_rm.pipeline.study_report import write_study_report

        study = StudyConfig(categories=args.categories, seeds=args.seeds, lambdas=args.lambdas, layer_choices=args.layers,
                            confidence_alphas=args.confidence_alphas, teacher_labels=args.teacher_labels,
                            budgets=args.budgets, preset=args.preset, precision=args.precision, student=args.student,
                            **{name: getattr(args, name) for name in SCALE_FIELDS if getattr(args, name) is not None})
        adopt = [(path, _read_study(path)) for path in args.adopt]
        out = Path(args.out)
        check_out_folder(out, study)
        out.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        experiment_id = configure(args.tracking_uri, args.experiment)
        instances = run_study(study, experiment_id, print_fn=lambda line: print(line, flush=True), out=out, adopt=adopt)
        # whole or not at all: a kill here must not leave the only record of a long study cut short
        write_atomically(out / "study.json", json.dumps({"config": study.to_dict(), "instances": instances}, indent=1).encode())
        paths = write_study_report(instances, out)
        print(f"\nstudy finished in {time.perf_counter() - started:.0f} s; wrote {', '.join(str(p) for p in paths)}")
        print(f"browse: mlflow ui --backend-store-uri {resolve_tracking_uri(args.tracking_uri)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
