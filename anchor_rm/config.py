"""The protocol's configuration and its presets, apart from the code that runs it (as TRL does)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from anchor_rm.catalog import CATEGORIES
from anchor_rm.precision import check_precision, resolve_precision
from anchor_rm.splits import SOURCE_FRACTIONS
from anchor_rm.training import TrainConfig


@dataclass
class ProtocolConfig:
    """Everything one weak-to-strong experiment depends on, besides the student's method."""

    category: str = "helpful"  # helpful | harmless: picks the source and the OOD targets
    source: str = ""  # defaults to the category's source dataset
    targets: list[str] = field(default_factory=list)  # defaults to the category's OOD targets
    student: str = "minilm-l6"  # short name, local folder or hub id
    teacher: str = "minilm-l6-first2"  # weaker: the first 2 of MiniLM-L6's 6 pretrained layers
    seed: int = 0  # splits, head initialisation and batch order
    # Shares of the source's pairs (by prompt group) for teacher-train, student-train, ID val and ID test.
    source_fractions: dict[str, float] = field(default_factory=lambda: dict(SOURCE_FRACTIONS))
    # Split caps (see splits.build_protocol_splits). Capped for time on 2 CPU cores: a test accuracy on 300
    # pairs has a standard error of about 2.9 points, which the report prints beside every figure.
    max_pairs: dict[str, int] = field(default_factory=lambda: {"ood_val": 150, "ood_test": 300})
    teacher_train: TrainConfig = field(default_factory=lambda: TrainConfig(method="gold", epochs=2, learning_rate=1e-4))
    student_train: TrainConfig = field(default_factory=TrainConfig)
    train_ceiling: bool = True  # the student on gold labels: the upper reference for PGR
    # Points by which the ceiling must beat the teacher on ID validation before any student trains
    # (SharedStages.check_gap); None: no check (the smoke preset, whose tiny splits measure nothing).
    min_gap: float | None = 3.0
    eval_batch_size: int = 32
    # auto | fp32 | bf16, for every forward pass of the experiment: teacher and student training, soft labels,
    # the reference cache and evaluation. auto: bf16 only where the hardware computes it natively and faster
    # (anchor_rm/precision.py). `resolve_precision()` fixes the concrete value before anything runs.
    precision: str = "auto"

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"category must be one of {', '.join(CATEGORIES)}, got {self.category!r}")
        self.source = self.source or CATEGORIES[self.category]["source"]
        self.targets = list(self.targets or CATEGORIES[self.category]["targets"])
        check_precision(self.precision)

    def resolve_precision(self, requested: str | None = None) -> str:
        """Decides the precision once ("fp32" or "bf16") and gives it to every stage, so that cache keys,
        MLflow params, reports and Ray workers carry what actually runs. Returns it."""
        self.precision = resolve_precision(requested or self.precision)
        self.teacher_train.precision = self.student_train.precision = self.precision
        return self.precision

    def to_dict(self) -> dict:
        return asdict(self)

    def data_dict(self) -> dict:
        """What the data preparation depends on."""
        return {"source": self.source, "targets": self.targets, "seed": self.seed, "max_pairs": self.max_pairs,
                "source_fractions": self.source_fractions}


def _smoke() -> ProtocolConfig:
    """About a minute on 2 cores: tiny splits, short sequences, one epoch. For tests, not for figures."""
    return ProtocolConfig(
        targets=["ultrafeedback", "pandalm"],
        teacher="minilm-l6-first1",
        max_pairs={"teacher_train": 48, "student_train": 48, "id_val": 24, "id_test": 32, "ood_val": 24, "ood_test": 32},
        teacher_train=TrainConfig(method="gold", epochs=1, batch_size=8, learning_rate=1e-4, max_length=128),
        student_train=TrainConfig(epochs=1, batch_size=8, max_length=128),
        eval_batch_size=32,
        min_gap=None,
    )


def _study() -> ProtocolConfig:
    """One protocol instance of the preference-shift study (pipelines/study.py), which trains 13 students per
    category and seed: short sequences and small test splits keep a student near half a minute on 2 cores. The teacher is the 1-layer MiniLM, trained for one epoch, so that it is clearly
    weaker than the 6-layer student's gold-label ceiling."""
    return ProtocolConfig(
        teacher="minilm-l6-first1",
        max_pairs={"teacher_train": 800, "student_train": 320, "id_val": 100, "id_test": 300, "ood_val": 60,
                   "ood_test": 150},
        teacher_train=TrainConfig(method="gold", epochs=1, batch_size=16, learning_rate=1e-4, max_length=128),
        student_train=TrainConfig(epochs=2, batch_size=16, learning_rate=1e-4, max_length=128),
        eval_batch_size=64,
    )


PRESETS = {"default": ProtocolConfig, "smoke": _smoke, "study": _study}


def preset(name: str, category: str = "helpful") -> ProtocolConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return _with_category(PRESETS[name](), category)


def _with_category(cfg: ProtocolConfig, category: str) -> ProtocolConfig:
    if category != cfg.category:
        cfg.category = category
        cfg.source, cfg.targets = CATEGORIES[category]["source"], list(CATEGORIES[category]["targets"])
        cfg.__post_init__()
    return cfg


# The main job (pipelines/tune.py) trains one student per trial: 2 baselines + TUNE_SAMPLES[preset] ANCHOR
# configurations. Its default is sized to finish in about 15 minutes on 2 CPU cores.
TUNE_SAMPLES = {"default": 3, "smoke": 2}


def _tune_default() -> ProtocolConfig:
    """Smaller than train.py's default: five trials of two epochs each must fit the 15 minutes. Measured
    here: a trial epoch on 400 pairs at 192 tokens took ~60 s, a third of it validation."""
    cfg = ProtocolConfig()
    cfg.max_pairs = {"student_train": 320, "id_val": 150, "ood_val": 80, "ood_test": 300}
    cfg.teacher_train = TrainConfig(method="gold", epochs=2, learning_rate=1e-4, max_length=192)
    cfg.student_train = TrainConfig(epochs=2, batch_size=16, learning_rate=1e-4, max_length=192)
    return cfg


def _tune_smoke() -> ProtocolConfig:
    cfg = _smoke()
    cfg.student_train.epochs = 2  # two epochs: per-epoch reports, checkpoints and ASHA all get exercised
    return cfg


TUNE_PRESETS = {"default": _tune_default, "smoke": _tune_smoke}


def tune_preset(name: str, category: str = "helpful") -> ProtocolConfig:
    if name not in TUNE_PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(TUNE_PRESETS)}")
    return _with_category(TUNE_PRESETS[name](), category)
