"""The preference-shift study: every method on both categories, an ANCHOR lambda sweep per layer choice,
several seeds, and the representation drift of every student.

Each (category, seed) is one protocol instance: its own seeded splits, teacher and strong ceiling (the
shared stage runs of experiment.py), then one student per method setting. Every student is a stage run
of its own ("study-student", keyed by its inputs), so an interrupted study resumes where it stopped: a
finished student is read back from MLflow, never trained again. Tables and plots are study_report's job.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from anchor_rm.data.catalog import CATEGORIES
from anchor_rm.evaluation import keys
from anchor_rm.evaluation.keys import cache_key, metric_name
from anchor_rm.evaluation.metrics import transfer_metrics
from anchor_rm.evaluation.report_files import write_atomically
from anchor_rm.evaluation.scores import evaluation_sets, scores_to_dict
from anchor_rm.method.drift import evaluate_with_drift, evaluation_reference
from anchor_rm.method.losses import resolve_anchor_layers
from anchor_rm.method.reference_cache import ReferenceStates
from anchor_rm.method.stages import frozen_reference, load_student, reference_states
from anchor_rm.method.student import train_student
from anchor_rm.method.training import TEACHER_LABELS, TrainConfig
from anchor_rm.mlflow_edge import runs
from anchor_rm.mlflow_edge.runs import ActiveRunSink, stage_run
from anchor_rm.model.precision import cpu_model, driver_device_type, resolve_precision
from anchor_rm.model.reward_model import training_device
from anchor_rm.pipeline.config import ProtocolConfig, preset
from anchor_rm.pipeline.experiment import STAGE_VERSION, SharedStages, build_splits, prepare_shared, split_digests

log = logging.getLogger("anchor_rm")

STUDENT_STAGE = "study-student"
INSTANCE_STAGE = "study-instance"
INSTANCES_DIR = "instances"  # under the study's --out folder
DRIFT_LAYERS = ("last", "middle")  # drift is measured at both layer choices for every method
# The study's OOD targets: the protocol's (catalog.CATEGORIES).
STUDY_TARGETS = {category: list(spec["targets"]) for category, spec in CATEGORIES.items()}


# StudyConfig's student options and their defaults: a setting at its default is not one of the study's settings.
STUDENT_DEFAULTS = {"student": "", "lora_rank": 0, "lora_alpha": 16.0, "lora_learning_rate": None,
                    "activation_checkpointing": False}


@dataclass
class StudyConfig:
    categories: list[str] = field(default_factory=lambda: ["helpful", "harmless"])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    lambdas: list[float] = field(default_factory=lambda: [1e-5, 1e-4, 1e-3, 1e-2, 1e-1])  # lambda 0 is naive W2S
    layer_choices: list[str] = field(default_factory=lambda: ["last", "middle"])
    confidence_alphas: list[float] = field(default_factory=lambda: [0.5, 0.75])
    # The teacher's labels (TrainConfig.teacher_labels): every method trains on the first; each further one adds
    # a naive W2S student trained on it, the comparison of raw against temperature-scaled labels.
    # Empty: the preset's labels, then the other kind.
    teacher_labels: list[str] = field(default_factory=list)
    # (learning rate, epochs) budgets for the W2S students. With budgets, naive W2S trains per seed on every kind
    # of teacher labels at every budget, and the (labels, budget) with the highest validation ID accuracy trains
    # every method of that seed. Empty: no search; the first labels and the preset's budget.
    budgets: list[tuple[float, int]] = field(default_factory=list)
    preset: str = "study"
    precision: str = "auto"  # resolved once per process (anchor_rm/model/precision.py); every instance uses it
    # The strong student and how it trains, where not the preset's: a decoder with LoRA adapters (its ANCHOR
    # reference its adapters off) puts the paper's claim to a student with a prior to protect. At their defaults
    # these are left out of settings(), so that studies recorded before they existed still compare equal.
    student: str = ""  # "": the preset's (MiniLM-L6)
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_learning_rate: float | None = None
    activation_checkpointing: bool = False

    def __post_init__(self):
        unknown = [c for c in self.categories if c not in STUDY_TARGETS]
        if unknown or not self.categories:
            raise ValueError(f"categories must be among {', '.join(STUDY_TARGETS)}, got {self.categories}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"seeds must be distinct whole numbers >= 0, at least one, got {self.seeds}")
        # As floats, as the command line gives them: 10 and 10.0 are one setting, and one key (instance_key).
        self.lambdas = [float(lam) for lam in self.lambdas]
        self.confidence_alphas = [float(alpha) for alpha in self.confidence_alphas]
        if any(lam <= 0 for lam in self.lambdas):
            raise ValueError(f"lambdas must be > 0 (lambda 0 is the naive row), got {self.lambdas}")
        for choice in self.layer_choices:
            resolve_anchor_layers(choice, 6)  # raises a ValueError naming a bad choice
        for alpha in self.confidence_alphas:
            if not 0 <= alpha <= 1:
                raise ValueError(f"confidence alphas must lie in [0, 1], got {alpha}")
        if not self.teacher_labels:
            default = preset(self.preset).student_train.teacher_labels
            self.teacher_labels = [default] + [mode for mode in TEACHER_LABELS if mode != default]
        if len(set(self.teacher_labels)) != len(self.teacher_labels) \
                or any(mode not in TEACHER_LABELS for mode in self.teacher_labels):
            raise ValueError(f"teacher labels must be distinct, at least one, among {', '.join(TEACHER_LABELS)}; "
                             f"got {self.teacher_labels}")
        self.budgets = [(float(lr), int(epochs)) for lr, epochs in self.budgets]
        if len(set(self.budgets)) != len(self.budgets) or any(lr <= 0 or epochs < 1 for lr, epochs in self.budgets):
            raise ValueError(f"budgets must be distinct (learning rate > 0, epochs >= 1), got {self.budgets}")
        self.precision = resolve_precision(self.precision, driver_device_type())  # study.json records what ran

    def to_dict(self) -> dict:
        return asdict(self)

    def settings(self) -> dict:
        """What every instance of this study shares: all but the categories and seeds (and the student's options
        at their defaults: STUDENT_DEFAULTS)."""
        return {k: v for k, v in self.to_dict().items()
                if k not in ("categories", "seeds") and not (k in STUDENT_DEFAULTS and v == STUDENT_DEFAULTS[k])}


def protocol_for(study: StudyConfig, category: str, seed: int) -> ProtocolConfig:
    cfg = preset(study.preset, category)
    cfg.targets = list(STUDY_TARGETS[category]) if study.preset == "study" else cfg.targets
    cfg.seed = seed
    cfg.teacher_train.seed = seed
    cfg.student_train.seed = seed
    if study.student:
        cfg.student = study.student
    for name in ("lora_rank", "lora_alpha", "lora_learning_rate", "activation_checkpointing"):
        setattr(cfg.student_train, name, getattr(study, name))
    cfg.student_train.__post_init__()
    cfg.resolve_precision(study.precision, driver_device_type())
    return cfg


def _naive(study: StudyConfig, base: TrainConfig, labels: str | None = None) -> TrainConfig:
    return TrainConfig(**{**base.to_dict(), "method": "naive", "anchor_lambda": 0.0,
                          "teacher_labels": labels or study.teacher_labels[0]})


def student_settings(study: StudyConfig, base: TrainConfig, labels: str | None = None,
                     naive_budgets: dict[str, TrainConfig] | None = None) -> list[TrainConfig]:
    """Naive on each kind of teacher labels, confidence at each alpha, ANCHOR at each lambda and layer choice:
    one student each, all on `labels` (default: the study's first) and `base`'s budget, except naive W2S on other
    labels, which trains at its own best budget when a search found one (`naive_budgets`)."""
    main = labels or study.teacher_labels[0]
    common = {**base.to_dict(), "teacher_labels": main}
    settings = [TrainConfig(**common | {"method": "naive", "anchor_lambda": 0.0})]
    settings += [(naive_budgets or {}).get(other) or _naive(study, base, other)
                 for other in study.teacher_labels if other != main]
    settings += [TrainConfig(**{**common, "method": "confidence", "confidence_alpha": a, "anchor_lambda": 0.0})
                 for a in study.confidence_alphas]
    settings += [TrainConfig(**{**common, "method": "anchor", "anchor_lambda": lam, "anchor_layers": layers})
                 for layers in study.layer_choices for lam in study.lambdas]
    return settings


def budget_settings(study: StudyConfig, base: TrainConfig) -> list[TrainConfig]:
    """Naive W2S on each kind of teacher labels at each (learning rate, epochs) budget of the search; none
    without a search."""
    return [TrainConfig(**{**_naive(study, base, labels).to_dict(), "learning_rate": lr, "epochs": epochs})
            for labels in study.teacher_labels for lr, epochs in study.budgets]


def setting_label(tc: TrainConfig, main_labels: str = "raw") -> str:
    if tc.method == "confidence":
        return f"confidence alpha={tc.confidence_alpha:g}"
    if tc.method == "anchor":
        return f"anchor {tc.anchor_layers} lambda={tc.anchor_lambda:g}"
    if tc.teacher_labels != main_labels:
        return f"{tc.method}, {tc.teacher_labels} teacher labels"
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
            reference = frozen_reference(self.cfg.student, training_device())
            for name, _, pairs in evaluation_sets(self.shared.splits, "test"):
                self._eval[name] = evaluation_reference(reference, rm, pairs, layers, batch_size=self.cfg.eval_batch_size,
                                                        precision=self.cfg.precision)
        return self._eval


def _train_and_measure(cfg: ProtocolConfig, shared: SharedStages, tc: TrainConfig, refs: _References) -> dict:
    rm = load_student(cfg.student, tc)
    depth = rm.model.config.num_hidden_layers
    layer_sets = {choice: resolve_anchor_layers(choice, depth) for choice in DRIFT_LAYERS}
    reference = refs.train(rm) if tc.uses_anchor and not tc.lora_rank else None  # LoRA: adapters off
    trained = train_student(rm, shared.splits.student_train, shared.soft_labels(tc.teacher_labels), tc, ActiveRunSink(),
                            reference=reference)
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

    def skip(self, students: int, line: str) -> None:
        """A whole instance's `students` done without training (read back or adopted)."""
        self.done += students
        self.print_fn(f"[{self.done}/{self.total}] {line}")


def _student(cfg: ProtocolConfig, shared: SharedStages, refs: _References, tc: TrainConfig,
             category: str, seed: int, experiment_id: str, label: str):
    """One student as a stage run keyed by its inputs: trained, or read back when an earlier run finished it."""
    key = cache_key(STAGE_VERSION, STUDENT_STAGE, shared.data.outputs["digests"], shared.teacher.run_id,
                    cfg.teacher_train.key_dict(), tc.key_dict(), cfg.eval_batch_size, cfg.precision, DRIFT_LAYERS)
    tags = {keys.CATEGORY_TAG: category, keys.SEED_TAG: str(seed), keys.METHOD_TAG: tc.method,
            keys.SETTING_TAG: label, **shared.tags()}
    return stage_run(experiment_id, STUDENT_STAGE, key, lambda: _train_and_measure(cfg, shared, tc, refs),
                     params={"category": category, "seed": seed, "student": cfg.student, "teacher": cfg.teacher,
                             "train": tc.to_dict()}, tags=tags)


def _id_val_accuracy(run, source: str) -> float:
    return run.outputs["val"][source]["accuracy"]


def instance_key(study: StudyConfig, cfg: ProtocolConfig, digests: dict[str, str]) -> str:
    """What one instance's records depend on: its data (the split digests, which stand for the source, targets,
    seed, fractions and caps), the models and their training (as the stage keys take them: TrainConfig.key_dict,
    so that an option added later keys nothing until it is set), the evaluation, and the study's settings."""
    return cache_key(STAGE_VERSION, INSTANCE_STAGE, digests, cfg.student, cfg.teacher, cfg.teacher_train.key_dict(),
                     cfg.student_train.key_dict(), cfg.train_ceiling, cfg.eval_batch_size, cfg.precision,
                     study.settings(), DRIFT_LAYERS)


def instance_path(out: Path, category: str, seed: int) -> Path:
    return Path(out) / INSTANCES_DIR / f"{category}-seed{seed}.json"


def read_instance(path: Path, key: str) -> dict | None:
    """The finished instance recorded at `path` when its key is `key`; None when there is none or its inputs
    differ (it is then computed again and replaced once finished)."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a study instance record (line {e.lineno}: {e.msg}); move it away and the "
                         "instance is computed again") from None
    if not isinstance(record, dict) or not isinstance(record.get("instance"), dict) or "key" not in record:
        raise ValueError(f"{path}: not a study instance record (no 'key' and 'instance'); move it away and the "
                         "instance is computed again")
    if record["key"] != key:
        log.warning("%s: recorded for other inputs (data, protocol or study settings); computed again", path)
        return None
    return record["instance"]


def write_instance(path: Path, key: str, instance: dict) -> None:
    """Writes the record whole or not at all (report_files.write_atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"key": key, "instance": instance}, indent=1).encode())


def recorded_settings(config: dict) -> dict:
    """The settings of a study.json's `config`, as StudyConfig.settings() gives them (the student's options at their
    defaults left out, whether recorded or not)."""
    return {k: v for k, v in config.items()
            if k not in ("categories", "seeds") and not (k in STUDENT_DEFAULTS and v == STUDENT_DEFAULTS[k])}


def adoptable(earlier: dict, study: StudyConfig, category: str, seed: int,
              split_sizes: dict) -> tuple[dict | None, str]:
    """The instance (category, seed) of an earlier study.json (`earlier`, parsed) when it was made with this
    study's settings and the same split sizes, else None; and why."""
    theirs = recorded_settings(earlier.get("config") or {})
    ours = json.loads(json.dumps(study.settings()))  # as study.json holds them: budgets as lists
    if theirs != ours:
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        return None, f"other study settings ({', '.join(differ)})"
    for instance in earlier.get("instances") or []:
        if instance.get("category") == category and instance.get("seed") == seed:
            if instance.get("split_sizes") != split_sizes:
                return None, "other split sizes"
            return instance, "same settings and split sizes"
    return None, f"no {category} seed {seed}"


def check_out_folder(out: Path, study: StudyConfig) -> None:
    """A folder whose study.json another study wrote is not written over (results kept in git, or the only copy):
    the same study again, or one that extends its categories and seeds with the same settings, may write there;
    anything else is a ValueError naming the folder and what differs."""
    path = out / "study.json"
    if not path.exists():
        return
    try:
        config = json.loads(path.read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        config = None
    if not isinstance(config, dict):
        raise ValueError(f"--out {out}: {path} is not a study.json this command wrote; pass another --out")
    theirs = recorded_settings(config)
    ours = json.loads(json.dumps(study.settings()))  # as study.json holds them: budgets as lists
    differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    for key in ("categories", "seeds"):
        if not set(config.get(key) or []) <= set(getattr(study, key)):
            differ.append(f"{key} {config.get(key)} not all in this study's {getattr(study, key)}")
    if differ:
        raise ValueError(f"--out {out}: its study.json holds another study's results (it differs in "
                         f"{', '.join(differ)}), which this run would write over; pass another --out "
                         f"(--adopt {path} takes over its matching instances)")


def _computed_here() -> dict:
    """Where and when an instance was computed (its record's `provenance`)."""
    return {"how": "computed", "machine": cpu_model(), "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def run_instance(study: StudyConfig, category: str, seed: int, experiment_id: str, progress: Progress,
                 out: Path | None = None, adopt: list[tuple[str, dict]] = ()) -> dict:
    """One protocol instance: shared stages, the budget search (when asked), then every student setting.
    Returns its records. With `out`, a finished instance recorded under it with the same inputs is read back,
    else one of `adopt` (an earlier study.json's path and contents) with the same settings and split sizes,
    else it is computed; either way it is recorded there."""
    cfg = protocol_for(study, category, seed)
    splits = build_splits(cfg)
    per_instance = len(student_settings(study, TrainConfig())) + len(budget_settings(study, TrainConfig()))
    if out is not None:
        path, key = instance_path(out, category, seed), instance_key(study, cfg, split_digests(splits))
        instance = read_instance(path, key)
        if instance is not None:
            progress.skip(per_instance, f"{category} seed {seed}: reused the finished instance {path}")
            return instance
        sizes = {name: counts["splits"] for name, counts in splits.counts.items()}
        for source, earlier in adopt:
            instance, why = adoptable(earlier, study, category, seed, sizes)
            if instance is not None:
                before = {"earlier": instance["provenance"]} if "provenance" in instance else {}
                instance = {**instance, "provenance": {"how": f"adopted from {source} ({why})", **before}}
                write_instance(path, key, instance)
                progress.skip(per_instance, f"{category} seed {seed}: adopted from {source} ({why}); recorded in {path}")
                return instance
            log.info("%s seed %s: not adopted from %s: %s", category, seed, source, why)
        instance = _compute_instance(study, cfg, splits, category, seed, experiment_id, progress)
        instance["provenance"] = _computed_here()
        write_instance(path, key, instance)
        return instance
    return _compute_instance(study, cfg, splits, category, seed, experiment_id, progress)


def _compute_instance(study: StudyConfig, cfg: ProtocolConfig, splits, category: str, seed: int, experiment_id: str,
                      progress: Progress) -> dict:
    shared = prepare_shared(cfg, experiment_id, splits)
    refs = _References(cfg, shared, study.layer_choices)
    main_labels, base, searched, naive_best = study.teacher_labels[0], cfg.student_train, [], {}
    for tc in budget_settings(study, cfg.student_train):
        label = f"naive {tc.teacher_labels} labels lr={tc.learning_rate:g} epochs={tc.epochs}"
        started = time.time()
        run = _student(cfg, shared, refs, tc, category, seed, experiment_id, f"budget: {label}")
        progress.step(f"{category} seed {seed} budget: {label}", time.time() - started, run.reused)
        searched.append({"teacher_labels": tc.teacher_labels, "learning_rate": tc.learning_rate, "epochs": tc.epochs,
                         "run_id": run.run_id, "val_id_acc": _id_val_accuracy(run, cfg.source)})
        best = naive_best.get(tc.teacher_labels)
        if best is None or searched[-1]["val_id_acc"] > best[1]:  # a tie goes to the budget listed first
            naive_best[tc.teacher_labels] = (tc, searched[-1]["val_id_acc"])
    if searched:  # the highest validation ID accuracy; a tie goes to the labels listed first
        chosen, accuracy = max(naive_best.values(), key=lambda b: (b[1], -study.teacher_labels.index(b[0].teacher_labels)))
        main_labels = chosen.teacher_labels
        base = TrainConfig(**{**cfg.student_train.to_dict(), "learning_rate": chosen.learning_rate, "epochs": chosen.epochs})
        progress.print_fn(f"{category} seed {seed}: {main_labels} teacher labels, lr={chosen.learning_rate:g}, "
                          f"epochs={chosen.epochs} (naive W2S validation ID accuracy {accuracy:.1f}) train every method")
    students = []
    for tc in student_settings(study, base, main_labels, {k: tc for k, (tc, _) in naive_best.items()}):
        setting = setting_label(tc, main_labels)
        started = time.time()
        run = _student(cfg, shared, refs, tc, category, seed, experiment_id, setting)
        progress.step(f"{category} seed {seed} {setting}", time.time() - started, run.reused)
        students.append({"setting": setting, "method": tc.method, "anchor_lambda": tc.anchor_lambda,
                         "anchor_layers": tc.anchor_layers if tc.method == "anchor" else None,
                         "confidence_alpha": tc.confidence_alpha if tc.method == "confidence" else None,
                         "teacher_labels": tc.teacher_labels, "run_id": run.run_id, **run.outputs})
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
        "teacher_labels": main_labels,
        "budget": {"learning_rate": base.learning_rate, "epochs": base.epochs, "searched": searched},
        "students": students,
    }


def run_study(study: StudyConfig, experiment_id: str, print_fn: Callable[[str], None] = print,
              out: Path | None = None, adopt: list[tuple[str, dict]] = ()) -> list[dict]:
    """Every instance of `study`, in order. `out`: the folder whose instance records are read back and written
    (run_instance); `adopt`: earlier study.json files (path, contents) whose matching instances are taken over."""
    per_instance = len(student_settings(study, TrainConfig())) + len(budget_settings(study, TrainConfig()))
    progress = Progress(len(study.categories) * len(study.seeds) * per_instance, print_fn=print_fn)
    instances = []
    for category in study.categories:
        for seed in study.seeds:
            print_fn(f"== {category}, seed {seed}: data, teacher and ceiling (reused when unchanged)")
            instances.append(run_instance(study, category, seed, experiment_id, progress, out, adopt))
    return instances
