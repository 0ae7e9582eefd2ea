"""The preference-shift study: every method on both categories, an ANCHOR lambda sweep per layer choice,
several seeds, and the representation drift of every student.

Each (category, seed) is one protocol instance: its own seeded splits, teacher and strong ceiling (the
shared stage runs of experiment.py), then one student per method setting. Every student is a stage run
of its own ("study-student", keyed by its inputs), so an interrupted study resumes where it stopped: a
finished student is read back from MLflow, never trained again. Tables and plots are study_report's job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from anchor_rm.catalog import CATEGORIES
from anchor_rm.config import ProtocolConfig, preset
from anchor_rm.drift import evaluate_with_drift, evaluation_reference
from anchor_rm.experiment import STAGE_VERSION, SharedStages, prepare_shared
from anchor_rm.losses import resolve_anchor_layers
from anchor_rm.metrics import transfer_metrics
from anchor_rm.precision import resolve_precision
from anchor_rm.mlflow_edge import keys, runs
from anchor_rm.mlflow_edge.keys import cache_key, metric_name
from anchor_rm.mlflow_edge.runs import ActiveRunSink, stage_run
from anchor_rm.reference_cache import ReferenceStates
from anchor_rm.student import train_student
from anchor_rm.training import TrainConfig
from anchor_rm.workflow import evaluation_sets, frozen_reference, load_pretrained, reference_states, scores_to_dict

log = logging.getLogger("anchor_rm")

STUDENT_STAGE = "study-student"
DRIFT_LAYERS = ("last", "middle")  # drift is measured at both layer choices for every method
# The study's OOD targets: the protocol's (catalog.CATEGORIES).
STUDY_TARGETS = {category: list(spec["targets"]) for category, spec in CATEGORIES.items()}


@dataclass
class StudyConfig:
    categories: list[str] = field(default_factory=lambda: ["helpful", "harmless"])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    lambdas: list[float] = field(default_factory=lambda: [1e-5, 1e-4, 1e-3, 1e-2, 1e-1])  # lambda 0 is naive W2S
    layer_choices: list[str] = field(default_factory=lambda: ["last", "middle"])
    confidence_alphas: list[float] = field(default_factory=lambda: [0.5, 0.75])
    preset: str = "study"
    precision: str = "auto"  # resolved once per process (anchor_rm/precision.py); every instance uses it

    def __post_init__(self):
        unknown = [c for c in self.categories if c not in STUDY_TARGETS]
        if unknown or not self.categories:
            raise ValueError(f"categories must be among {', '.join(STUDY_TARGETS)}, got {self.categories}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {self.seeds}")
        if any(lam <= 0 for lam in self.lambdas):
            raise ValueError(f"lambdas must be > 0 (lambda 0 is the naive row), got {self.lambdas}")
        for choice in self.layer_choices:
            resolve_anchor_layers(choice, 6)  # raises a ValueError naming a bad choice
        for alpha in self.confidence_alphas:
            if not 0 <= alpha <= 1:
                raise ValueError(f"confidence alphas must lie in [0, 1], got {alpha}")
        self.precision = resolve_precision(self.precision)  # study.json records what ran, not "auto"

    def to_dict(self) -> dict:
        return asdict(self)


def protocol_for(study: StudyConfig, category: str, seed: int) -> ProtocolConfig:
    cfg = preset(study.preset, category)
    cfg.targets = list(STUDY_TARGETS[category]) if study.preset == "study" else cfg.targets
    cfg.seed = seed
    cfg.teacher_train.seed = seed
    cfg.student_train.seed = seed
    cfg.resolve_precision(study.precision)
    return cfg


def student_settings(study: StudyConfig, base: TrainConfig) -> list[TrainConfig]:
    """Naive, confidence at each alpha, ANCHOR at each lambda and layer choice: one student each."""
    settings = [TrainConfig(**{**base.to_dict(), "method": "naive", "anchor_lambda": 0.0})]
    settings += [TrainConfig(**{**base.to_dict(), "method": "confidence", "confidence_alpha": a, "anchor_lambda": 0.0})
                 for a in study.confidence_alphas]
    settings += [TrainConfig(**{**base.to_dict(), "method": "anchor", "anchor_lambda": lam, "anchor_layers": layers})
                 for layers in study.layer_choices for lam in study.lambdas]
    return settings


def setting_label(tc: TrainConfig) -> str:
    if tc.method == "confidence":
        return f"confidence alpha={tc.confidence_alpha:g}"
    if tc.method == "anchor":
        return f"anchor {tc.anchor_layers} lambda={tc.anchor_lambda:g}"
    return tc.method


class _References:
    """The frozen reference's states for one protocol instance, computed when a student first needs them:
    on student-train at the anchored layers (training), and on each test set at the drift layers."""

    def __init__(self, cfg: ProtocolConfig, shared: SharedStages, layer_choices: list[str]):
        self.cfg, self.shared, self.layer_choices = cfg, shared, layer_choices
        self._train: ReferenceStates | None = None
        self._eval: dict[str, ReferenceStates] = {}

    def train(self, rm) -> ReferenceStates:
        if self._train is None:
            self._train = reference_states(self.cfg.student, rm, self.shared.splits.student_train, self.layer_choices,
                                           precision=self.cfg.student_train.precision, batch_size=self.cfg.eval_batch_size)
        return self._train

    def evaluation(self, rm, layers: list[int]) -> dict[str, ReferenceStates]:
        if not self._eval:
            reference = frozen_reference(self.cfg.student)
            for name, _, pairs in evaluation_sets(self.shared.splits, "test"):
                self._eval[name] = evaluation_reference(reference, rm, pairs, layers, batch_size=self.cfg.eval_batch_size,
                                                        precision=self.cfg.precision)
        return self._eval


def _train_and_measure(cfg: ProtocolConfig, shared: SharedStages, tc: TrainConfig, refs: _References) -> dict:
    rm = load_pretrained(cfg.student, tc.max_length, tc.seed)
    depth = rm.model.config.num_hidden_layers
    layer_sets = {choice: resolve_anchor_layers(choice, depth) for choice in DRIFT_LAYERS}
    reference = refs.train(rm) if tc.uses_anchor else None
    trained = train_student(rm, shared.splits.student_train, shared.soft_labels, tc, ActiveRunSink(), reference=reference)
    val, val_metrics = shared.validation(cfg.eval_batch_size, cfg.precision).measure(rm)  # once, after training
    runs.log_metrics(val_metrics)
    eval_refs = refs.evaluation(rm, sorted({layer for layers in layer_sets.values() for layer in layers}))
    test, drift = {}, {}
    for name, _, pairs in evaluation_sets(shared.splits, "test"):
        test[name], by_layers = evaluate_with_drift(rm, pairs, eval_refs[name], layer_sets,
                                                    batch_size=cfg.eval_batch_size, precision=cfg.precision)
        drift[name] = {choice: asdict(d) for choice, d in by_layers.items()}
        runs.log_metrics({f"test/acc/{metric_name(name)}": test[name].accuracy,
                            **{f"drift/{choice}/msd/{metric_name(name)}": d.msd for choice, d in by_layers.items()},
                            **{f"drift/{choice}/cosine/{metric_name(name)}": d.cosine for choice, d in by_layers.items()}})
    teacher_test = shared.teacher_scores("test")
    tm = transfer_metrics({k: v.accuracy for k, v in teacher_test.items()}, {k: v.accuracy for k, v in test.items()},
                          shared.splits.source, headline_targets=shared.headline_targets)
    runs.log_metrics({"test/wrg": tm.wrg, "test/mean_nts": tm.mean_nts})
    return {"val": scores_to_dict(val), "test": scores_to_dict(test), "drift": drift,
            "train_seconds": trained.result.seconds}


@dataclass
class Progress:
    """Counts finished students and estimates the time left from the ones trained in this process."""

    total: int
    done: int = 0
    trained: int = 0
    seconds: float = 0.0
    print_fn: Callable[[str], None] = print

    def step(self, label: str, seconds: float, reused: bool) -> None:
        self.done += 1
        if not reused:
            self.trained += 1
            self.seconds += seconds
        left = self.total - self.done
        eta = f", about {left * self.seconds / self.trained / 60:.0f} min left" if self.trained and left else ""
        how = "reused a finished run" if reused else f"{seconds:.0f} s"
        self.print_fn(f"[{self.done}/{self.total}] {label}: {how}{eta}")


def run_instance(study: StudyConfig, category: str, seed: int, experiment_id: str, progress: Progress) -> dict:
    """One protocol instance: shared stages, then every student setting. Returns its records."""
    cfg = protocol_for(study, category, seed)
    shared = prepare_shared(cfg, experiment_id)
    refs = _References(cfg, shared, study.layer_choices)
    students = []
    for tc in student_settings(study, cfg.student_train):
        label = f"{category} seed {seed} {setting_label(tc)}"
        key = cache_key(STAGE_VERSION, STUDENT_STAGE, shared.data.outputs["digests"], shared.teacher.run_id,
                        cfg.teacher_train.to_dict(), tc.to_dict(), cfg.eval_batch_size, cfg.precision, DRIFT_LAYERS)
        tags = {keys.CATEGORY_TAG: category, keys.SEED_TAG: str(seed), keys.METHOD_TAG: tc.method,
                keys.SETTING_TAG: setting_label(tc), **shared.tags()}
        started = time.time()
        run = stage_run(experiment_id, STUDENT_STAGE, key, lambda: _train_and_measure(cfg, shared, tc, refs),
                        params={"category": category, "seed": seed, "student": cfg.student, "teacher": cfg.teacher,
                                "train": tc.to_dict()}, tags=tags)
        progress.step(label, time.time() - started, run.reused)
        students.append({"setting": setting_label(tc), "method": tc.method, "anchor_lambda": tc.anchor_lambda,
                         "anchor_layers": tc.anchor_layers if tc.method == "anchor" else None,
                         "confidence_alpha": tc.confidence_alpha if tc.method == "confidence" else None,
                         "run_id": run.run_id, **run.outputs})
    return {
        "category": category, "seed": seed, "source": cfg.source, "targets": cfg.targets,
        "student": cfg.student, "teacher": cfg.teacher,
        "split_sizes": {name: counts["splits"] for name, counts in shared.splits.counts.items()},
        "teacher_scores": shared.teacher.outputs["scores"], "teacher_run_id": shared.teacher.run_id,
        "ceiling_scores": shared.ceiling.outputs["scores"] if shared.ceiling else None,
        "ceiling_run_id": shared.ceiling.run_id if shared.ceiling else None,
        "headline_targets": shared.headline_targets,
        "target_flags": shared.headline.flags, "headline_note": shared.headline.note,
        "teacher_calibration": shared.teacher_calibration,
        "students": students,
    }


def run_study(study: StudyConfig, experiment_id: str, print_fn: Callable[[str], None] = print) -> list[dict]:
    per_instance = len(student_settings(study, TrainConfig()))
    progress = Progress(len(study.categories) * len(study.seeds) * per_instance, print_fn=print_fn)
    instances = []
    for category in study.categories:
        for seed in study.seeds:
            print_fn(f"== {category}, seed {seed}: data, teacher and ceiling (reused when unchanged)")
            instances.append(run_instance(study, category, seed, experiment_id, progress))
    return instances
