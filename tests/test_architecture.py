"""The library's core runs without the frameworks, and MLflow is imported in one place only."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EDGE = ROOT / "anchor_rm" / "mlflow_edge"

# Imports the core with mlflow, ray and bentoml made unimportable, then uses it: metric keys, a report,
# the study tables, one student run trained through a sink on a tiny model.
CORE_WITHOUT_FRAMEWORKS = r'''
import importlib.abc, importlib.machinery, sys

class Blocked(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    NAMES = ("mlflow", "ray", "bentoml")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.NAMES:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        raise ImportError(f"{spec.name} is blocked: the core must not import it")

    def exec_module(self, module):
        raise ImportError(f"{module.__name__} is blocked")

sys.meta_path.insert(0, Blocked())

import anchor_rm.data, anchor_rm.catalog, anchor_rm.splits, anchor_rm.losses, anchor_rm.metrics
import anchor_rm.training, anchor_rm.scoring, anchor_rm.encoding, anchor_rm.models, anchor_rm.precision
import anchor_rm.report, anchor_rm.report_files, anchor_rm.report_summary, anchor_rm.study_report
import anchor_rm.drift, anchor_rm.workflow, anchor_rm.student, anchor_rm.batching, anchor_rm.config
from anchor_rm.mlflow_edge import keys
from anchor_rm.workflow import SplitScore

teacher = {"src": SplitScore(60.0, 100, 0.0, 0), "ood": SplitScore(50.0, 100, 0.0, 0)}
student = {"src": SplitScore(65.0, 100, 0.0, 0), "ood": SplitScore(55.0, 100, 0.0, 0)}
metrics = keys.validation_metrics("src", teacher, student)
assert metrics["val/wrg"] == 5.0 and metrics["val/mean_nts"] == metrics["val/nts/ood"], metrics

import torch
from transformers import BertConfig, BertForSequenceClassification
from anchor_rm.data import PreferencePair
from anchor_rm.encoding import RewardEncoder
from anchor_rm.models import load_tokenizer, resolve_model
from anchor_rm.student import train_student
from anchor_rm.training import TrainConfig
from anchor_rm.workflow import RewardModel

class ListSink:
    def __init__(self):
        self.rows = []
    def log(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

tokenizer = load_tokenizer(resolve_model("minilm-l6"))  # the shipped MiniLM's vocabulary
config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id)
torch.manual_seed(0)
rm = RewardModel(BertForSequenceClassification(config), tokenizer, RewardEncoder(tokenizer, 32, False), "tiny")
pairs = [PreferencePair(f"question {i}", f"a good answer {i}", f"bad {i}", "toy") for i in range(8)]
sink = ListSink()
run = train_student(rm, pairs, [0.8] * 8, TrainConfig(method="naive", epochs=1, batch_size=4, precision="fp32"), sink)
assert run.pairs == 8 and run.result.steps == 2, run
assert [step for step, _ in sink.rows[:2]] == [0, 1] and "train/loss" in sink.rows[0][1], sink.rows
assert "train/pairs_per_second" in sink.rows[-1][1], sink.rows[-1]
print("core ok without mlflow, ray, bentoml:", sorted(m for m in sys.modules if m.split(".")[0] in ("mlflow", "ray", "bentoml")))
'''


@pytest.mark.timeout(300)
def test_the_core_imports_and_trains_with_mlflow_ray_and_bentoml_unimportable():
    done = subprocess.run([sys.executable, "-c", CORE_WITHOUT_FRAMEWORKS], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "core ok without mlflow, ray, bentoml: []" in done.stdout, done.stdout


@pytest.mark.timeout(30)
def test_only_the_mlflow_edge_imports_mlflow():
    importers = []
    for folder in ("anchor_rm", "tuning", "service", "pipelines"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if EDGE in path.parents:
                continue
            if re.search(r"^\s*(import mlflow|from mlflow[ .])", path.read_text(), flags=re.M):
                importers.append(str(path.relative_to(ROOT)))
    assert importers == [], f"mlflow imported outside anchor_rm/mlflow_edge/: {importers}"


@pytest.mark.timeout(120)
def test_promotion_and_the_registry_load_without_torch_or_transformers():
    """promote.py (and any registry client) reads reports and moves aliases: importing torch and transformers
    for that cost about 10 s per command (docs/benchmarks.md, Test suite, session 10)."""
    check = ("import sys, anchor_rm.promotion, anchor_rm.mlflow_edge.registry; "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "[]", done.stdout
