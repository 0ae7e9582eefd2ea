"""The protocol's configuration and its presets, apart from the code that runs it (as TRL does)."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

from anchor_rm.catalog import CATEGORIES
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
    # Split caps (see splits.build_protocol_splits); test splits are left whole: their size sets the noise.
    max_pairs: dict[str, int] = field(default_factory=lambda: {"ood_val": 200})
    teacher_train: TrainConfig = field(default_factory=lambda: TrainConfig(method="gold", epochs=2, learning_rate=1e-4))
    student_train: TrainConfig = field(default_factory=TrainConfig)
    train_ceiling: bool = True  # the student on gold labels: the upper reference for PGR
    eval_batch_size: int = 32

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"category must be one of {', '.join(CATEGORIES)}, got {self.category!r}")
        self.source = self.source or CATEGORIES[self.category]["source"]
        self.targets = list(self.targets or CATEGORIES[self.category]["targets"])

    def to_dict(self) -> dict:
        return asdict(self)

    def data_dict(self) -> dict:
        """What the data preparation depends on."""
        return {"source": self.source, "targets": self.targets, "seed": self.seed, "max_pairs": self.max_pairs}


def _smoke() -> ProtocolConfig:
    """About a minute on 2 cores: tiny splits, short sequences, one epoch. For tests, not for figures."""
    return ProtocolConfig(
        targets=["ultrafeedback", "pandalm"],
        teacher="minilm-l6-first1",
        max_pairs={"teacher_train": 48, "student_train": 48, "id_val": 24, "id_test": 32, "ood_val": 24, "ood_test": 32},
        teacher_train=TrainConfig(method="gold", epochs=1, batch_size=8, learning_rate=1e-4, max_length=128),
        student_train=TrainConfig(epochs=1, batch_size=8, max_length=128),
        eval_batch_size=32,
    )


PRESETS = {"default": ProtocolConfig, "smoke": _smoke}


def preset(name: str, category: str = "helpful") -> ProtocolConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    cfg = copy.deepcopy(PRESETS[name]())
    if category != cfg.category:
        cfg.category = category
        cfg.source, cfg.targets = CATEGORIES[category]["source"], list(CATEGORIES[category]["targets"])
        cfg.__post_init__()
    return cfg
