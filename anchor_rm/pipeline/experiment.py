"""One weak-to-strong experiment, recorded in MLflow: data -> teacher -> (ceiling) -> student -> report.

Data preparation, the teacher and the strong ceiling are stage runs of their own, reused when their inputs
are unchanged (mlflow_edge.runs.stage_run); each student is a run linked to them by tags. train.py runs one
student; Ray Tune (tuning/) runs many against the same shared stages.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np

from anchor_rm.data.catalog import COUNTER_TARGETS, dataset_digest, iter_dataset_pairs
from anchor_rm.data.splits import ProtocolSplits, build_protocol_splits
from anchor_rm.evaluation import keys
from anchor_rm.evaluation.keys import cache_key
from anchor_rm.evaluation.metrics import (HeadlineChoice, apply_temperature, calibration, choose_headline_targets,
                                          fit_temperature, label_information)
from anchor_rm.evaluation.premise import SetCorrectness, jsonable, not_measured, premise_check
from anchor_rm.evaluation.report import EvaluationReport, build_report
from anchor_rm.evaluation.scores import (evaluate_model, evaluate_pairs_with_ood, evaluation_sets, fit_ood_flag,
                                         flagged_set, scores_from_dict, scores_to_dict, split_results)
from anchor_rm.method.stages import load_student, reference_states, soft_labels
from anchor_rm.method.student import Validation, train_student
from anchor_rm.method.training import TrainConfig
from anchor_rm.mlflow_edge import runs
from anchor_rm.mlflow_edge.runs import ActiveRunSink, StageRun, stage_run
from anchor_rm.model.ood_flag import measure_sets
from anchor_rm.model.reward_model import RewardModel
from anchor_rm.pipeline.config import ProtocolConfig

log = logging.getLogger("anchor_rm")

# Bump when a stage's code changes what it computes, so that cached stage runs are not reused.
STAGE_VERSION = "1"


@dataclass
class SharedStages:
    """What every student of one experiment reuses."""

    splits: ProtocolSplits
    data: StageRun
    teacher: StageRun
    ceiling: StageRun | None

    def teacher_scores(self, split: str):
        return scores_from_dict(self.teacher.outputs["scores"][split])

    def ceiling_scores(self, split: str):
        """The ceiling's scores on `split`; None without a ceiling or without scores on that split."""
        if self.ceiling is None or split not in self.ceiling.outputs["scores"]:
            return None
        return scores_from_dict(self.ceiling.outputs["scores"][split])

    def soft_labels(self, which: str = "raw") -> list[float]:
        """The teacher's soft labels on student-train, "raw" or "calibrated" (TrainConfig.teacher_labels): scaled
        by the temperature the teacher stage fitted on the gold teacher_calibration split."""
        raw = self.teacher.outputs["soft_labels"]
        if which == "raw":
            return raw
        if which != "calibrated":
            raise ValueError(f"teacher labels must be raw or calibrated, got {which!r}")
        return apply_temperature(raw, self.temperature).tolist()

    @property
    def temperature(self) -> float:
        fitted = (self.teacher_calibration or {}).get("temperature_fit")
        if fitted is None:
            raise ValueError(f"teacher run {self.teacher.run_id} has no fitted temperature: its stage ran before "
                             "calibration existed; use teacher labels 'raw' or a new MLflow experiment")
        return fitted["temperature"]

    @property
    def teacher_calibration(self) -> dict | None:
        """The teacher's soft labels against gold on ID validation (metrics.calibration), with the split; the
        temperature fitted on teacher_calibration and the calibrated labels' figures on ID validation."""
        return self.teacher.outputs.get("calibration")

    @functools.cached_property
    def headline(self) -> HeadlineChoice:
        """Which OOD targets the mean NTS averages, in validation and in the test report alike, and why each
        other one is flagged (metrics.choose_headline_targets: split sizes, and the strong ceiling's accuracy
        on *validation*; without a ceiling, sizes alone)."""
        sizes = {name: {split: len(pairs) for split, pairs in by_split.items()} for name, by_split in self.splits.ood.items()}
        scores = self.ceiling_scores("val")
        ceiling_val = None if scores is None else {name: s.accuracy for name, s in scores.items()}
        choice = choose_headline_targets(sizes, ceiling_val, list(self.splits.ood), COUNTER_TARGETS)
        for name, why in choice.flags.items():
            log.info("OOD target %s: %s", name, why)
        if choice.note:
            log.warning("headline mean NTS: %s", choice.note)
        log.info("headline mean NTS over: %s", ", ".join(choice.targets))
        return choice

    @property
    def headline_targets(self) -> list[str]:
        return self.headline.targets

    def gap(self, split: str = "val") -> float | None:
        """Strong ceiling minus weak teacher on the ID split, in points (None without a ceiling)."""
        if self.ceiling_scores(split) is None:
            return None
        source = self.splits.source
        return self.ceiling_scores(split)[source].accuracy - self.teacher_scores(split)[source].accuracy

    def check_gap(self, min_gap: float) -> None:
        """Stops the experiment, before any student trains, when the strong ceiling does not beat the weak
        teacher on ID validation by `min_gap` points: there is then no weak-to-strong setting to study."""
        gap = self.gap("val")
        if gap is None or gap >= min_gap:
            return
        source = self.splits.source
        teacher, ceiling = self.teacher_scores("val")[source], self.ceiling_scores("val")[source]
        raise ValueError(
            f"no weak-to-strong gap: on {source} ID validation ({teacher.n_pairs} pairs) the strong ceiling scores "
            f"{ceiling.accuracy:.1f} and the weak teacher {teacher.accuracy:.1f}, a gap of {gap:+.1f} points, under "
            f"--min-gap {min_gap:g}. Make the teacher weaker (--teacher with fewer layers, fewer teacher-train "
            f"pairs) or the ceiling stronger (more student-train pairs, --max-length, --epochs), or lower --min-gap")

    def tags(self) -> dict[str, str]:
        tags = {keys.DATA_RUN_TAG: self.data.run_id, keys.TEACHER_RUN_TAG: self.teacher.run_id}
        if self.ceiling:
            tags[keys.CEILING_RUN_TAG] = self.ceiling.run_id
        return tags

    def validation(self, eval_batch_size: int, precision: str) -> Validation:
        """How every student of this experiment is measured on the validation splits."""
        return Validation(self.splits, self.teacher_scores("val"), self.headline_targets, eval_batch_size, precision)


def split_digests(splits: ProtocolSplits) -> dict[str, str]:
    digests = {
        f"{splits.source}/{name}": dataset_digest(getattr(splits, name))
        for name in ("teacher_train", "teacher_calibration", "student_train", "id_val", "id_test")
    }
    for target, parts in splits.ood.items():
        for split, pairs in parts.items():
            digests[f"{target}/{split}"] = dataset_digest(pairs)
    return digests


def build_splits(cfg: ProtocolConfig) -> ProtocolSplits:
    """The protocol's seeded splits of its source and targets (no MLflow)."""
    loader = functools.partial(iter_dataset_pairs, from_hub=True) if cfg.from_hub else iter_dataset_pairs
    return build_protocol_splits(cfg.source, cfg.targets, cfg.seed, max_pairs=cfg.max_pairs,
                                 source_fractions=tuple(cfg.source_fractions.items()), loader=loader)


def prepare_data(cfg: ProtocolConfig, experiment_id: str,
                 splits: ProtocolSplits | None = None) -> tuple[ProtocolSplits, StageRun]:
    """The data stage: `splits` (built from `cfg` when not given) logged as a run keyed by their digests."""
    splits = splits if splits is not None else build_splits(cfg)
    digests = split_digests(splits)
    for name, counts in splits.counts.items():
        log.info("data %s: %s", name, counts)

    def compute() -> dict:
        runs.log_metrics(keys.data_count_metrics(splits.counts))
        return {"digests": digests, "counts": splits.counts}

    run = stage_run(experiment_id, "data", cache_key(STAGE_VERSION, digests), compute, params=cfg.data_dict())
    return splits, run


def _gold_stage(stage: str, model_name: str, train_cfg: TrainConfig, cfg: ProtocolConfig, splits: ProtocolSplits,
                data: StageRun, experiment_id: str, train_pairs, label_pairs=None,
                eval_splits: tuple[str, ...] = ("val", "test")) -> StageRun:
    """Trains `model_name` on gold labels and scores it on `eval_splits`: validation for the tuning objective,
    the gap gate and the headline targets, test for the report."""
    # The teacher (label_pairs given) also fits the temperature of its labels on the gold teacher_calibration
    # split and measures its calibration on ID validation, raw and scaled: part of its key, so that a teacher
    # stage cached before it did is computed again once.
    calibrated = () if label_pairs is None else ("calibration:id_val", "temperature:teacher_calibration",
                                                 "labels:student_train")
    key = cache_key(STAGE_VERSION, stage, data.outputs["digests"], model_name, train_cfg.key_dict(), cfg.eval_batch_size,
                    eval_splits, cfg.precision, *calibrated)

    def compute() -> dict:
        log.info("%s: training %s on %d gold pairs", stage, model_name, len(train_pairs))
        rm = load_student(model_name, train_cfg)
        train_student(rm, train_pairs, None, train_cfg, ActiveRunSink())
        outputs = {"model": model_name, "scores": {}}
        for split in eval_splits:
            scores = evaluate_model(rm, splits, split, cfg.eval_batch_size, precision=cfg.precision)
            runs.log_metrics(keys.score_metrics(split, scores))
            outputs["scores"][split] = scores_to_dict(scores)
        if label_pairs is not None:
            labels = soft_labels(rm, label_pairs, cfg.eval_batch_size, cfg.precision)
            outputs["soft_labels"] = labels.tolist()
            runs.log_metrics({"soft_labels/mean": float(np.mean(labels)),
                              "soft_labels/agree_with_gold": float(np.mean(labels > 0.5) * 100)})
            outputs["calibration"] = teacher_calibration(rm, splits, cfg.eval_batch_size, cfg.precision)
            c = outputs["calibration"]
            c["student_train_labels"] = label_summary(labels, c["temperature_fit"]["temperature"])
            log.info("teacher labels on student-train: %.4f nats per pair raw, %.4f calibrated (ln 2 = 0.693: hard "
                     "labels), %.1f%% right", c["student_train_labels"]["information_nats"],
                     c["student_train_labels"]["calibrated_information_nats"], c["student_train_labels"]["accuracy"])
            runs.log_metrics({"soft_labels/information_nats": c["student_train_labels"]["information_nats"],
                              "soft_labels/calibrated_information_nats": c["student_train_labels"]["calibrated_information_nats"],
                              "calibration/ece": c["ece"], "calibration/mean_margin": c["mean_margin"],
                              "calibration/temperature": c["temperature_fit"]["temperature"],
                              "calibration/calibrated_ece": c["calibrated"]["ece"],
                              "calibration/calibrated_mean_margin": c["calibrated"]["mean_margin"]})
        runs.log_reward_model(rm, {"stage": stage})
        return outputs

    params = {"model": model_name, "train": train_cfg.to_dict(), "n_train_pairs": len(train_pairs)}
    run = stage_run(experiment_id, stage, key, compute, params=params, tags={keys.DATA_RUN_TAG: data.run_id})
    if run.reused:
        log.info("%s: reusing run %s (same inputs)", stage, run.run_id)
    return run


def label_summary(q, temperature: float) -> dict:
    """The teacher's soft labels on student-train (gold pairs: chosen is the better) as the students read them: what
    they say, raw and scaled (metrics.label_information), and how often they are right."""
    q = np.asarray(q, dtype=float)
    return {"n_pairs": int(q.size), "information_nats": label_information(q),
            "calibrated_information_nats": label_information(apply_temperature(q, temperature)),
            "accuracy": float(100 * np.mean(q > 0.5))}


def teacher_calibration(rm: RewardModel, splits: ProtocolSplits, batch_size: int, precision: str) -> dict:
    """The teacher's labels against gold: the temperature fitted on teacher_calibration (metrics.fit_temperature),
    then calibration on ID validation of the raw labels (top level) and of the scaled ones (`calibrated`)."""
    if not splits.teacher_calibration:
        raise ValueError(f"{splits.source}: the teacher_calibration split is empty; give it a share of the source "
                         "(source_fractions) and no cap of 0")
    fitted = fit_temperature(soft_labels(rm, splits.teacher_calibration, batch_size, precision))
    q_val = soft_labels(rm, splits.id_val, batch_size, precision)
    log.info("teacher temperature %.3g on %d gold teacher_calibration pairs (NLL %.4f -> %.4f)", fitted["temperature"],
             fitted["n_pairs"], fitted["nll_raw"], fitted["nll_calibrated"])
    return {"dataset": splits.source, "split": "val", **calibration(q_val),
            "temperature_fit": {"split": "teacher_calibration", **fitted},
            "calibrated": calibration(apply_temperature(q_val, fitted["temperature"]))}


def prepare_shared(cfg: ProtocolConfig, experiment_id: str, splits: ProtocolSplits | None = None) -> SharedStages:
    """Data, teacher (with its soft labels on student-train) and the strong ceiling, each once; `splits`: built
    already from `cfg` (build_splits), or None to build them here."""
    splits, data = prepare_data(cfg, experiment_id, splits)
    teacher = _gold_stage("teacher", cfg.teacher, cfg.teacher_train, cfg, splits, data, experiment_id,
                          splits.teacher_train, label_pairs=splits.student_train)
    ceiling = None
    if cfg.train_ceiling:
        # Gold training reads no teacher labels: their mode is left at the default so that it keys no ceiling. The
        # ceiling trains here, in one process: unsharded, whatever the trials' strategy (memory_plan plans it so).
        gold = TrainConfig(**{**cfg.student_train.to_dict(), "method": "gold", "teacher_labels": "raw", "strategy": "ddp"})
        ceiling = _gold_stage("ceiling", cfg.student, gold, cfg, splits, data, experiment_id, splits.student_train)
    return SharedStages(splits, data, teacher, ceiling)


def premise_of(shared: SharedStages, naive_test: dict | None) -> dict:
    """Whether this experiment's naive W2S shows the failure ANCHOR targets (premise.premise_check), from its test
    scores per set (scores.SplitScore) beside the teacher's and the ceiling's on the same pairs; "not measured",
    saying why, where it cannot be read (no naive W2S in the run, scores without per-pair results)."""
    if naive_test is None:
        return not_measured("no naive W2S student was trained in this run (tune.py trains one; train.py trains one "
                            "unless --no-premise)")
    source, headline = shared.splits.source, shared.headline_targets
    teacher, ceiling = shared.teacher_scores("test"), shared.ceiling_scores("test")
    try:
        sets = [SetCorrectness.from_strings(name, "id" if name == source else "ood", teacher[name].correct,
                                            naive_test[name].correct, None if ceiling is None else ceiling[name].correct)
                for name in [source, *headline]]
        return jsonable(premise_check(sets, headline))
    except (ValueError, KeyError) as exc:
        return not_measured(str(exc))


def final_report(shared: SharedStages, rm: RewardModel, model_info: dict, eval_batch_size: int, precision: str,
                 selection_splits: str = "none", selection: dict | None = None,
                 validation_scores: dict | None = None, ood_flag: bool = False) -> tuple[EvaluationReport, dict]:
    """The student on every test split, beside the teacher (and ceiling), as a report; `precision` is the
    experiment's resolved precision (the teacher's test scores were taken in it too). The same on every
    validation split goes into the report's validation block: what promotion compares. `validation_scores`: this
    model's scores per validation set as its training measured them after its last epoch (StudentRun), taken
    instead of scoring it on them again. `ood_flag`: fit the OOD flag's density on student-train and its
    threshold on ID validation (scores.fit_ood_flag; set on `rm`, saved with it from then on) and measure it
    on the test splits in the same pass that scores them. Returns the report and the model's test scores per set
    (what premise_of reads of naive W2S)."""
    model_info = {**model_info, "precision": precision}
    splits = shared.splits
    if ood_flag:
        fit_ood_flag(rm, splits.student_train, splits.id_val, fit_split="student_train",
                     threshold_split=f"{splits.source}/val", batch_size=eval_batch_size, precision=precision)
    rows, flagged = {}, []
    for split in ("val", "test"):
        if split == "val" and validation_scores is not None:
            expected = {name for name, _, _ in evaluation_sets(splits, "val")}
            if set(validation_scores) != expected:
                raise ValueError(f"validation scores for {sorted(validation_scores)}, but the validation sets are "
                                 f"{sorted(expected)}")
            student = validation_scores
        elif split == "test" and ood_flag:
            student = {}
            for name, role, pairs in evaluation_sets(splits, "test"):
                student[name], ood = evaluate_pairs_with_ood(rm, pairs, eval_batch_size, precision=precision,
                                                             label=f"scoring {name} (test)")
                flagged.append(flagged_set(name, role, student[name], ood))
        else:
            student = evaluate_model(rm, splits, split, eval_batch_size, precision=precision)
        rows[split] = split_results(splits, split, student, shared.teacher_scores(split), shared.ceiling_scores(split))
    digests = {k: v for k, v in shared.data.outputs["digests"].items()}
    report = build_report(model_info, rows["test"], selection_splits=selection_splits, figure_splits="test",
                        data_digests=digests, headline_targets=shared.headline_targets,
                        target_flags=shared.headline.flags, headline_note=shared.headline.note,
                        teacher_calibration=shared.teacher_calibration,
                        validation_results=rows["val"], selection=selection,
                        ood_flag=(measure_sets(rm.density, flagged, reference=next(f for f in flagged if f.role == "id"))
                                  if ood_flag else None))
    return report, student


NAIVE_STAGE = "naive"


def naive_test_scores(cfg: ProtocolConfig, shared: SharedStages, train_cfg: TrainConfig, experiment_id: str) -> dict:
    """Naive W2S with `train_cfg`'s settings (method naive, lambda 0), trained once per inputs (a stage run keyed by
    the data, the teacher run and the settings; read back after): its test scores per set (scores.SplitScore).
    What the premise check reads where the run's own student is another method."""
    naive = TrainConfig(**{**train_cfg.to_dict(), "method": "naive", "anchor_lambda": 0.0})
    key = cache_key(STAGE_VERSION, NAIVE_STAGE, shared.data.outputs["digests"], shared.teacher.run_id, cfg.student,
                    naive.key_dict(), cfg.eval_batch_size, cfg.precision)

    def compute() -> dict:
        log.info("premise: training naive W2S with the same settings, to check against (once per inputs)")
        rm = load_student(cfg.student, naive)
        train_student(rm, shared.splits.student_train, shared.soft_labels(naive.teacher_labels), naive, ActiveRunSink())
        scores = evaluate_model(rm, shared.splits, "test", cfg.eval_batch_size, precision=cfg.precision)
        runs.log_metrics(keys.score_metrics("test", scores))
        return {"test": scores_to_dict(scores)}

    run = stage_run(experiment_id, NAIVE_STAGE, key, compute, params={"student": cfg.student, "train": naive.to_dict()},
                    tags={keys.METHOD_TAG: "naive", **shared.tags()})
    if run.reused:
        log.info("premise: reusing naive W2S run %s (same inputs)", run.run_id)
    return scores_from_dict(run.outputs["test"])


def run_student(cfg: ProtocolConfig, shared: SharedStages, train_cfg: TrainConfig, run_name: str | None = None, *,
                experiment_id: str | None = None) -> tuple[str, EvaluationReport]:
    """A full student run in its own MLflow run: train (validation after each epoch), report on test, log the
    model and the report. Returns (run id, report). The report's premise check reads naive W2S: this student when
    it is naive W2S, else (with `experiment_id`) naive W2S trained with the same settings beside it, once per inputs
    (naive_test_scores); without `experiment_id`, the premise is not measured."""
    naive_test = None
    if train_cfg.method != "naive" and experiment_id is not None:
        naive_test = naive_test_scores(cfg, shared, train_cfg, experiment_id)
    with runs.start_run(run_name=run_name or train_cfg.method) as run_id:
        runs.set_tags({keys.STAGE_TAG: "student", keys.METHOD_TAG: train_cfg.method, **shared.tags()})
        runs.log_params({"student": cfg.student, "teacher": cfg.teacher, "source": cfg.source,
                         "targets": ",".join(cfg.targets), **{f"train.{k}": v for k, v in train_cfg.to_dict().items()}})
        runs.log_json(shared.data.outputs["digests"], keys.DATA_DIGESTS_FILE)
        rm = load_student(cfg.student, train_cfg)
        reference = None  # a LoRA student's reference is itself with its adapters off
        if train_cfg.uses_anchor and not train_cfg.lora_rank:
            reference = reference_states(cfg.student, rm, shared.splits.student_train, [train_cfg.anchor_layers],
                                         precision=train_cfg.precision, batch_size=cfg.eval_batch_size)
            runs.log_metrics({"reference_cache/megabytes": reference.nbytes() / 1e6})

        def after_epoch(epoch: int, metrics: dict, _optimizer_state: dict, _scores: dict | None) -> None:
            log.info("epoch %d: val mean NTS %.2f, val ID acc %.1f", epoch, metrics["val/mean_nts"],
                     metrics[f"val/acc/{keys.metric_name(shared.splits.source)}"])

        trained = train_student(rm, shared.splits.student_train, shared.soft_labels(train_cfg.teacher_labels), train_cfg,
                                ActiveRunSink(), validation=shared.validation(cfg.eval_batch_size, cfg.precision),
                                reference=reference, after_epoch=after_epoch)
        info = {"name": f"{cfg.student} ({train_cfg.method})", "student": cfg.student, "teacher": cfg.teacher,
                "method": train_cfg.method, "hyperparameters": train_cfg.to_dict(), "run_id": run_id}
        report, test_scores = final_report(shared, rm, info, cfg.eval_batch_size, cfg.precision,
                                           validation_scores=trained.validation_scores, ood_flag=True)
        report.premise = premise_of(shared, test_scores if train_cfg.method == "naive" else naive_test)
        log.info("premise: %s", report.premise["summary"])
        runs.log_report(report)
        runs.log_reward_model(rm, {"method": train_cfg.method, "teacher": cfg.teacher})
    return run_id, report
