"""Any reward model on any preference data: the library side of pipelines/evaluate.py.

A model comes from the MLflow registry (models:/NAME@ALIAS, models:/NAME/VERSION), from a run
(runs:/RUN_ID/PATH) or from a local folder. Its teacher is known when the run that logged the model has the
tag anchor_rm.teacher_run (set by experiment.run_student) naming the teacher's stage run, which logged the
teacher as model/; or when the caller names one. A known teacher is scored on the same data, so the report
has teacher columns and AOG (and WRG and NTS when one data set is marked in-distribution).

Resolving a model talks to MLflow (mlflow_edge.model_package), because that is where versions live; loading data,
scoring and building the report are plain functions of their inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from anchor_rm.data.catalog import dataset_digest, load_dataset_pairs
from anchor_rm.data.records import DataError, PreferencePair, ReadStats
from anchor_rm.data.splits import CleanCounts, clean_pairs, subsample
from anchor_rm.evaluation.keys import EVALUATED_RUN_TAG, METHOD_TAG, MODEL_URI_TAG, STAGE_TAG, TEACHER_RUN_TAG
from anchor_rm.evaluation.report import EvaluationReport, SplitResult, build_report
from anchor_rm.evaluation.report_checks import EVALUATION
from anchor_rm.evaluation.scores import evaluate_pairs, evaluate_pairs_with_ood, flagged_set
from anchor_rm.mlflow_edge.model_package import ResolvedModel, resolve_model_uri
from anchor_rm.model.loading import ModelError
from anchor_rm.model.ood_flag import FlaggedSet, measure_sets
from anchor_rm.model.reward_model import RewardModel

EVALUATION_EXPERIMENT = "anchor-rm-evaluations"
WHOLE_SET = "all"  # the report's split for a data set scored as given, not a protocol split


# ---------------------------------------------------------------------------------------------------
# Data.

@dataclass
class EvaluationSet:
    """One data set as scored: cleaned pairs, what cleaning dropped, and a digest of exactly these pairs."""

    name: str
    pairs: list[PreferencePair]
    counts: CleanCounts
    skipped_invalid: int = 0  # records --skip-invalid passed over
    subsampled_from: int | None = None  # pairs before --max-pairs, when it cut
    digest: str = ""

    def summary(self) -> str:
        c = self.counts
        dropped = {"ties": c.ties, "empty": c.empty, "identical": c.identical, "conflicting": c.conflicting,
                   "duplicates": c.duplicates}
        text = f"data {self.name}: {c.total} pairs read, {c.kept} kept"
        reasons = ", ".join(f"{n} {reason}" for reason, n in dropped.items() if n)
        text += f" (dropped: {reasons})" if reasons else ""
        if self.skipped_invalid:
            text += f"; {self.skipped_invalid} invalid records skipped"
        if self.subsampled_from is not None:
            text += f"; {len(self.pairs)} of the {self.subsampled_from} sampled (--max-pairs)"
        return text


def load_evaluation_set(name: str, *, prompt_column: str = "prompt", chosen_column: str = "chosen",
                        rejected_column: str = "rejected", hub_split: str = "train", skip_invalid: bool = False,
                        max_pairs: int | None = None, seed: int = 0) -> EvaluationSet:
    """A catalog name, a file or a hub name (catalog.load_dataset_pairs), cleaned (splits.clean_pairs) and
    optionally cut to a seeded sample of max_pairs."""
    stats = ReadStats()
    raw = load_dataset_pairs(name, prompt_column=prompt_column, chosen_column=chosen_column,
                             rejected_column=rejected_column, split=hub_split, skip_invalid=skip_invalid, stats=stats)
    kept, counts = clean_pairs(raw)
    if not kept:
        raise DataError(f"dataset {name!r}: no pair left after cleaning ({counts.to_dict()})")
    before = None
    if max_pairs is not None and len(kept) > max_pairs:
        before, kept = len(kept), subsample(kept, max_pairs, seed, name)
    return EvaluationSet(name, kept, counts, stats.skipped, before, dataset_digest(kept))


# ---------------------------------------------------------------------------------------------------
# Scoring and the report.

def score_sets(student: RewardModel, sets: Sequence[EvaluationSet], *, teacher: RewardModel | None = None,
               id_name: str | None = None, batch_size: int = 32,
               precision: str = "auto") -> tuple[list[SplitResult], list[FlaggedSet], dict[str, tuple]]:
    """One report row per data set: the student's accuracy, the teacher's beside it when there is one.
    `id_name` marks the in-distribution set (role "id"); every other set is "ood". And where the student has an
    OOD flag (anchor_rm/model/ood_flag.py), each set as the flag saw it, from the same pass (else an empty list). Last,
    per set, which pairs the student and the teacher (None without one) rank right (SplitScore.correct)."""
    names = [s.name for s in sets]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"data sets must be distinct, repeated: {repeated}")
    if id_name is not None and id_name not in names:
        raise ValueError(f"the ID data set {id_name!r} is not among the data sets {names}")
    rows, flagged, correct = [], [], {}
    for s in sets:
        try:
            scored, ood = evaluate_pairs_with_ood(student, s.pairs, batch_size, precision=precision,
                                                  label=f"scoring {s.name} (model)")
            teacher_scored = (evaluate_pairs(teacher, s.pairs, batch_size, precision=precision,
                                             label=f"scoring {s.name} (teacher)")
                              if teacher is not None else None)
        except ValueError as exc:
            raise ValueError(f"dataset {s.name!r}: {exc}") from None
        rows.append(SplitResult(
            dataset=s.name, role="id" if s.name == id_name else "ood", split=WHOLE_SET, n_pairs=scored.n_pairs,
            teacher_accuracy=None if teacher_scored is None else teacher_scored.accuracy,
            student_accuracy=scored.accuracy, ceiling_accuracy=None, student_tie_rate=scored.tie_rate,
        ))
        if ood is not None:
            flagged.append(flagged_set(s.name, rows[-1].role, scored, ood))
        correct[s.name] = (scored.correct, None if teacher_scored is None else teacher_scored.correct)
    return rows, flagged, correct


def evaluation_premise(rows: list[SplitResult], correct: dict[str, tuple], method: str | None) -> dict:
    """The premise check (anchor_rm/evaluation/premise.py) of the evaluated model on these sets: does it gain on the ID set
    over its teacher while losing on the OOD sets (the absolute form; without a ceiling, the relative form is not
    measured)? Over-refusal sets (catalog.COUNTER_TARGETS) stay out of the OOD mean. Needs a teacher and --id."""
    from anchor_rm.data.catalog import COUNTER_TARGETS
    from anchor_rm.evaluation.premise import SetCorrectness, jsonable, not_measured, premise_check

    if not any(row.role == "id" for row in rows):
        return not_measured("no ID set (--id names one)")
    if any(teacher is None for _, teacher in correct.values()):
        return not_measured("no teacher to compare with (--teacher names one)")
    ood = [row.dataset for row in rows if row.role == "ood" and row.dataset not in COUNTER_TARGETS]
    if not ood:
        return not_measured("no OOD set beside the ID set")
    sets = [SetCorrectness.from_strings(row.dataset, row.role, correct[row.dataset][1], correct[row.dataset][0])
            for row in rows if row.role == "id" or row.dataset in ood]
    subject = "the evaluated model" + (f" ({method})" if method else "")
    return jsonable(premise_check(sets, ood, subject=subject))


def evaluation_report(model_info: dict[str, Any], rows: list[SplitResult], sets: Sequence[EvaluationSet],
                      created_at: str | None = None, ood_flag: dict[str, Any] | None = None) -> EvaluationReport:
    """An "evaluation" report: whole data sets (split "all"), selection unknown, a digest per set; `ood_flag`:
    the student's OOD flag on them (ood_flag.measure_sets)."""
    return build_report(model_info, rows, selection_splits="unknown", figure_splits=WHOLE_SET,
                        data_digests={s.name: s.digest for s in sets}, created_at=created_at, kind=EVALUATION,
                        ood_flag=ood_flag)


# ---------------------------------------------------------------------------------------------------
# Models: where a URI or folder leads, and who taught it.

def find_teacher(model: ResolvedModel, download_dir: str | Path) -> tuple[ResolvedModel | None, str]:
    """The teacher of a model an anchor-rm run logged, downloaded, and a line saying where it came from
    or why there is none (the evaluation then has no teacher columns)."""
    if model.run_id is None:
        return None, "no teacher: the model was not logged in an MLflow run (--teacher names one)"
    teacher_run = model.run_tags.get(TEACHER_RUN_TAG)
    if not teacher_run:
        return None, f"no teacher: run {model.run_id} has no {TEACHER_RUN_TAG} tag (--teacher names one)"
    uri = f"runs:/{teacher_run}/model"
    try:
        teacher = resolve_model_uri(uri, Path(download_dir) / "teacher")
    except ModelError as exc:
        return None, f"no teacher: the teacher run named by {TEACHER_RUN_TAG} has no usable model/ artifact ({exc})"
    return teacher, f"teacher: {uri} (tag {TEACHER_RUN_TAG} of run {model.run_id})"


def model_info(model: ResolvedModel, teacher: ResolvedModel | None, run_id: str | None,
               precision: str | None = None) -> dict[str, Any]:
    """The report's `model` section: what was evaluated, from anchor_rm.json and the logging run."""
    saved, params = model.saved_info, model.run_params
    return {
        "name": model.name,
        "student": saved.get("base_model") or params.get("student") or model.name,
        # The teacher that was scored; else the teacher's name as recorded (its accuracies stay null).
        "teacher": teacher.name if teacher else saved.get("teacher") or params.get("teacher"),
        "method": saved.get("method") or model.run_tags.get(METHOD_TAG) or "unknown",
        "hyperparameters": {k.removeprefix("train."): v for k, v in sorted(params.items()) if k.startswith("train.")},
        "run_id": run_id,
        **({"precision": precision} if precision else {}),
    }


def training_source(model: ResolvedModel) -> str | None:
    """The data set the model was trained on, when its run recorded one (train.py logs `source`)."""
    return model.run_params.get("source")


# ---------------------------------------------------------------------------------------------------
# What an evaluation run records.

def run_params(model: ResolvedModel, teacher: ResolvedModel | None, sets: Sequence[EvaluationSet],
               id_name: str | None) -> dict[str, str]:
    params = {"model_uri": model.uri, "model": model.name, "registered_model": model.registered_name or "",
              "model_version": model.version or "", "model_run": model.run_id or "",
              "teacher": teacher.name if teacher else "", "id_data": id_name or "",
              "data": ",".join(s.name for s in sets)}
    for index, s in enumerate(sets, 1):
        params.update({f"data.{index}.name": s.name, f"data.{index}.digest": s.digest,
                       f"data.{index}.pairs": str(len(s.pairs))})
    return {k: v[:6000] for k, v in params.items()}


def run_tags(model: ResolvedModel, teacher: ResolvedModel | None) -> dict[str, str]:
    tags = {STAGE_TAG: "evaluation", MODEL_URI_TAG: model.name}
    if model.run_id:
        tags[EVALUATED_RUN_TAG] = model.run_id
    if teacher is not None and teacher.run_id:
        tags[TEACHER_RUN_TAG] = teacher.run_id
    return tags


# ---------------------------------------------------------------------------------------------------
# The whole evaluation, as pipelines/evaluate.py runs it.

def evaluate_and_record(sets: Sequence[EvaluationSet], model_uri: str, *, teacher_uri: str | None,
                        look_for_teacher: bool, id_name: str | None, max_length: int | None, batch_size: int,
                        precision: str, tracking_uri: str, log_run: bool, connect: bool,
                        out: Path) -> tuple[EvaluationReport, str | None]:
    """Resolve the model (and its teacher: `teacher_uri`, else the one its training run names when
    `look_for_teacher`), score every set, write the report into `out`, and (with `log_run`) record it all as
    a run of the evaluations experiment. Returns (report, run id or None). MLflow errors become one
    ValueError naming the store."""
    import logging
    import tempfile
    from contextlib import nullcontext

    from anchor_rm.evaluation import keys
    from anchor_rm.evaluation.report_files import write_report
    from anchor_rm.mlflow_edge import runs, store
    from anchor_rm.model.reward_model import load_saved, training_device

    log = logging.getLogger("anchor_rm")
    try:
        experiment_id = None
        if log_run:
            experiment_id = store.configure(tracking_uri, EVALUATION_EXPERIMENT)
        elif connect:
            store.connect(tracking_uri)  # a models:/ or runs:/ URI, without creating an experiment
        with tempfile.TemporaryDirectory(prefix="anchor-rm-evaluate-") as tmp:
            model = resolve_model_uri(model_uri, Path(tmp) / "student")
            log.info("model: %s (%s)", model.name, model.folder)
            teacher, why = None, "no teacher: --no-teacher"
            if teacher_uri:
                teacher, why = resolve_model_uri(teacher_uri, Path(tmp) / "teacher"), f"teacher: {teacher_uri}"
            elif look_for_teacher:
                teacher, why = find_teacher(model, tmp)
            log.info("%s", why)
            source = training_source(model)
            if id_name is None and source in [s.name for s in sets]:
                log.info("hint: the model was trained on %s; --id %s adds WRG and NTS", source, source)
            device = training_device()  # this process's first GPU where it has one, else its CPU
            student_rm = load_saved(model.folder, max_length, device=device)
            teacher_rm = load_saved(teacher.folder, max_length, device=device) if teacher else None
            rows, flagged, correct = score_sets(student_rm, sets, teacher=teacher_rm, id_name=id_name,
                                                batch_size=batch_size, precision=precision)
            # Against the ID validation responses stored with the fit: any set's AUROC, with or without --id.
            flag_block = measure_sets(student_rm.density, flagged) if flagged else None

        run_context = runs.start_run(experiment_id=experiment_id, run_name=f"evaluate {model.name}") if log_run \
            else nullcontext()
        with run_context as run_id:
            info = model_info(model, teacher, run_id, precision)
            report = evaluation_report(info, rows, sets, ood_flag=flag_block)
            report.premise = evaluation_premise(rows, correct, info.get("method"))
            log.info("premise: %s", report.premise["summary"])
            paths = write_report(report, out)
            if run_id is not None:
                runs.set_tags(run_tags(model, teacher))
                runs.log_params({**run_params(model, teacher, sets, id_name), "precision": precision})
                runs.log_metrics(keys.evaluation_metrics(report))
                runs.log_files(paths.values(), keys.REPORT_ARTIFACT)  # only the report: out may hold other files
    except store.TrackingError as exc:
        raise ValueError(f"MLflow at {tracking_uri}: {store.message(exc)}") from None
    return report, run_id
