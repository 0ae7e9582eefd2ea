"""The protocol's configuration and its presets, apart from the code that runs it (as TRL does)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from anchor_rm.data.catalog import CATEGORIES, hub_originals
from anchor_rm.data.splits import SOURCE_FRACTIONS
from anchor_rm.method.training import TrainConfig
from anchor_rm.model.precision import check_precision, resolve_precision


@dataclass
class ProtocolConfig:
    """Everything one weak-to-strong experiment depends on, besides the student's method."""

    category: str = "helpful"  # helpful | harmless: picks the source and the OOD targets
    source: str = ""  # defaults to the category's source dataset
    targets: list[str] = field(default_factory=list)  # defaults to the category's OOD targets
    student: str = "minilm-l6"  # short name, local folder or hub id
    teacher: str = "minilm-l6-first1"  # weaker: the first of MiniLM-L6's 6 pretrained layers
    seed: int = 0  # splits, head initialisation and batch order
    # Shares of the source's pairs (by prompt group) for teacher-train, student-train, ID val and ID test.
    source_fractions: dict[str, float] = field(default_factory=lambda: dict(SOURCE_FRACTIONS))
    # Split caps (see splits.build_protocol_splits), taken after splitting: the presets cap for CPU time.
    max_pairs: dict[str, int] = field(default_factory=dict)
    teacher_train: TrainConfig = field(default_factory=lambda: TrainConfig(method="gold", epochs=1, learning_rate=1e-4))
    student_train: TrainConfig = field(default_factory=TrainConfig)
    train_ceiling: bool = True  # the student on gold labels: the upper reference for PGR
    # Points by which the ceiling must beat the teacher on ID validation before any student trains
    # (SharedStages.check_gap); None: no check (the smoke preset, whose tiny splits measure nothing). Low:
    # one accuracy on 300 validation pairs has a standard error near 3 points.
    min_gap: float | None = 1.0
    eval_batch_size: int = 32
    # auto | fp32 | bf16, for every forward pass of the experiment: teacher and student training, soft labels,
    # the reference cache and evaluation. auto: bf16 only where the hardware computes it natively and faster
    # (anchor_rm/model/precision.py). `resolve_precision()` fixes the concrete value before anything runs.
    precision: str = "auto"
    # Read every catalog dataset from its hub original (catalog.hub_originals) instead of the shipped copy: the
    # `paper` preset's full datasets, where the hub can be reached.
    from_hub: bool = False

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"category must be one of {', '.join(CATEGORIES)}, got {self.category!r}")
        self.source = self.source or CATEGORIES[self.category]["source"]
        self.targets = list(self.targets or CATEGORIES[self.category]["targets"])
        check_precision(self.precision)

    def resolve_precision(self, requested: str | None = None, device_type: str = "cpu") -> str:
        """Decides the precision once ("fp32" or "bf16") for the device the experiment's own stages run on (the
        driver's: reward_model.training_device) and gives it to every stage, so that cache keys, MLflow params and
        reports carry what actually runs. Returns it. (Ray Train workers on GPUs resolve the requested value for
        their own device: tuning/trainable.py.)"""
        self.precision = resolve_precision(requested or self.precision, device_type)
        self.teacher_train.precision = self.student_train.precision = self.precision
        return self.precision

    def to_dict(self) -> dict:
        return asdict(self)

    def data_dict(self) -> dict:
        """What the data preparation depends on."""
        data = {"source": self.source, "targets": self.targets, "seed": self.seed, "max_pairs": self.max_pairs,
                "source_fractions": self.source_fractions}
        return {**data, "from_hub": True} if self.from_hub else data


# The weak-to-strong protocol of the default presets, as measured by bench/protocol_gap.py (docs/results.md,
# "The protocol"): a 1-layer MiniLM teacher trained on all of teacher-train (about 500 gold pairs on harmless), the
# 6-layer student on 640 pairs at 128 tokens. The teacher trains 2 epochs at learning rate 5e-4: on 150 pairs (the
# protocol until session 30) its calibrated labels carried 0.015-0.034 nats per pair and were right on 56-59% of
# student-train, against 0.058-0.070 nats and 61-63% on all of teacher-train, which left the ceiling 2.0-6.0 points
# above it on ID validation (harmless seeds 0-2, M7; docs/results.md, Teacher labels worth learning from). At 1 epoch
# and 1e-4 it ranked pairs as well but its soft labels sat within 0.001 of 0.5, and a student learns nothing from those. Harmless takes
# PKU-SafeRLHF as its source: with HH harmless-base the ceiling beat the teacher by only 1-3 points. The students
# train on the teacher's labels scaled by its temperature (fitted on gold teacher_calibration pairs): on 5 harmless
# seeds naive W2S's validation ID accuracy preferred them, by 0.3 points, to raw labels, each at its best of 3
# learning-rate/epoch budgets, and 1e-4 x 2 epochs tied with 3e-4 x 2 (docs/results.md, Teacher labels).
# Validation at least 200 pairs per set, test at least 600 ID and 400 per OOD target where the data has them
# (HHH harmless has 58 pairs in all, PandaLM 762, LLMBar 419).
# The teacher's temperature is fitted on up to 1,000 gold pairs of teacher_calibration (PKU-SafeRLHF has about 500).
PROTOCOL_CAPS = {"teacher_calibration": 1000, "student_train": 640, "id_val": 300, "id_test": 1000, "ood_val": 200,
                 "ood_test": 400}


def _protocol(category: str) -> ProtocolConfig:
    return ProtocolConfig(
        category=category,
        teacher="minilm-l6-first1",
        max_pairs=dict(PROTOCOL_CAPS),  # teacher-train uncapped: the teacher trains on all of it
        teacher_train=TrainConfig(method="gold", epochs=2, batch_size=16, learning_rate=5e-4, max_length=128),
        student_train=TrainConfig(epochs=2, batch_size=16, learning_rate=1e-4, max_length=128,
                                  teacher_labels="calibrated"),
        eval_batch_size=64,
    )


def _smoke(category: str) -> ProtocolConfig:
    """About a minute on 2 cores (README, Precision and speed): tiny splits, 64-token sequences, one epoch. For
    tests, not for figures: the test suite runs it many times (docs/benchmarks.md, Test suite)."""
    cfg = ProtocolConfig(
        category=category,
        teacher="minilm-l6-first1",
        max_pairs={"teacher_train": 48, "teacher_calibration": 48, "student_train": 48, "id_val": 24, "id_test": 32,
                   "ood_val": 24, "ood_test": 32},
        teacher_train=TrainConfig(method="gold", epochs=1, batch_size=8, learning_rate=1e-4, max_length=64),
        student_train=TrainConfig(epochs=1, batch_size=8, max_length=64),
        eval_batch_size=32,
        min_gap=None,
    )
    if category == "helpful":  # one HH file and two small targets: the quickest whole path
        cfg.source, cfg.targets = "hh-helpful-base", ["ultrafeedback", "pandalm"]
    return cfg


def _study(category: str) -> ProtocolConfig:
    """One protocol instance of the preference-shift study (pipelines/study.py), which trains every method's
    students per category and seed on the default protocol."""
    return _protocol(category)


# The paper's helpful setting: HelpSteer3 (nvidia/HelpSteer3, preference subset) as the source, HH helpful and
# UltraFeedback as the shifted targets.
PAPER_HELPFUL_SOURCE = "helpsteer3"
PAPER_HELPFUL_TARGETS = ("hh-helpful", "ultrafeedback")


def _paper(category: str) -> ProtocolConfig:
    """The paper's kind of setting (docs/scaling.md): a Llama-3.1-8B student with LoRA adapters (rank 16 on every
    linear layer, ANCHOR's reference the student with its adapters off) and activation checkpointing, a Llama-3.2-1B
    teacher fully fine-tuned, 1,024-token pairs in bf16 where the GPU has it. It runs where a GPU and the hub exist
    (the weights come from the hub, gated by Meta's licence); here, `--dry-run` shows its config, data and memory
    plan. The datasets are read from the hub, uncapped but for the validation and test sizes: on helpful, the
    paper's own source, HelpSteer3's preference subset, with HH helpful and UltraFeedback as targets; on harmless,
    the category's datasets that have a hub original (catalog.hub_originals)."""
    cfg = _protocol(category)
    cfg.student, cfg.teacher = "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.2-1B"
    cfg.from_hub = True
    if category == "helpful":
        cfg.source, cfg.targets = PAPER_HELPFUL_SOURCE, list(PAPER_HELPFUL_TARGETS)
    cfg.targets = [t for t in cfg.targets if hub_originals(t)]
    cfg.max_pairs = {"teacher_train": 2000, "id_val": 1000, "id_test": 2000, "ood_val": 500, "ood_test": 1000}
    cfg.teacher_train = TrainConfig(method="gold", epochs=1, batch_size=16, learning_rate=1e-5, max_length=1024,
                                    activation_checkpointing=True)
    cfg.student_train = TrainConfig(epochs=1, batch_size=16, learning_rate=1e-5, max_length=1024, lora_rank=16,
                                    lora_alpha=32.0, lora_learning_rate=2e-4, activation_checkpointing=True,
                                    teacher_labels="calibrated")
    cfg.eval_batch_size = 16
    return cfg


PRESETS = {"default": _protocol, "smoke": _smoke, "study": _study, "paper": _paper}


def _from(presets: dict, name: str, category: str) -> ProtocolConfig:
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(presets)}")
    if category not in CATEGORIES:
        raise ValueError(f"category must be one of {', '.join(CATEGORIES)}, got {category!r}")
    return presets[name](category)


def preset(name: str, category: str = "helpful") -> ProtocolConfig:
    return _from(PRESETS, name, category)


# The main job (pipelines/tune.py) trains one student per trial: 2 baselines + TUNE_SAMPLES[preset] ANCHOR
# configurations, on the default protocol (docs/benchmarks.md has its wall time per CPU).
TUNE_SAMPLES = {"default": 3, "smoke": 2, "paper": 8}


def _tune_smoke(category: str) -> ProtocolConfig:
    cfg = _smoke(category)
    cfg.student_train.epochs = 2  # two epochs: per-epoch reports, checkpoints and ASHA all get exercised
    return cfg


TUNE_PRESETS = {"default": _protocol, "smoke": _tune_smoke, "paper": _paper}


def tune_preset(name: str, category: str = "helpful") -> ProtocolConfig:
    return _from(TUNE_PRESETS, name, category)
