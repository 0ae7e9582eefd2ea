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

import anchor_rm.data.records, anchor_rm.data.readers, anchor_rm.data.catalog, anchor_rm.data.splits
import anchor_rm.model.loading, anchor_rm.model.encoding, anchor_rm.model.scoring, anchor_rm.model.precision
import anchor_rm.model.reward_model, anchor_rm.evaluation.metrics, anchor_rm.evaluation.scores
import anchor_rm.evaluation.report, anchor_rm.evaluation.report_files, anchor_rm.evaluation.report_summary
import anchor_rm.method.losses, anchor_rm.method.training, anchor_rm.method.drift, anchor_rm.method.student
import anchor_rm.pipeline.study_tables, anchor_rm.pipeline.study_report, anchor_rm.pipeline.config
import service.batching
from anchor_rm.evaluation import keys
from anchor_rm.evaluation.scores import SplitScore

teacher = {"src": SplitScore(60.0, 100, 0.0, 0), "ood": SplitScore(50.0, 100, 0.0, 0)}
student = {"src": SplitScore(65.0, 100, 0.0, 0), "ood": SplitScore(55.0, 100, 0.0, 0)}
metrics = keys.validation_metrics("src", teacher, student)
assert metrics["val/wrg"] == 5.0 and metrics["val/mean_nts"] == metrics["val/nts/ood"], metrics

import torch
from transformers import BertConfig, BertForSequenceClassification
from anchor_rm.data.records import PreferencePair
from anchor_rm.model.encoding import RewardEncoder
from anchor_rm.model.loading import load_tokenizer, resolve_model
from anchor_rm.method.student import train_student
from anchor_rm.method.training import TrainConfig
from anchor_rm.model.reward_model import RewardModel

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
    check = ("import sys, anchor_rm.pipeline.promotion, anchor_rm.mlflow_edge.registry; "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "[]", done.stdout


# ---------------------------------------------------------------------------------------------------
# The layers: anchor_rm's folders, each importing only its own layer and those below (anchor_rm/__init__.py).

LAYERS = {"data": 1, "model": 2, "evaluation": 3, "method": 4, "mlflow_edge": 5, "pipeline": 6, "cli": 7}
# Modules beside the layers: the service's client uses the model layer's text helpers; the shim that keeps old
# registered versions loading sits with the MLflow edge it re-exports.
TOP_LEVEL = {"anchor_rm.client": 2, "anchor_rm.registry": 5, "anchor_rm": 0}


def layer_of(module: str) -> int | None:
    """The layer of an anchor_rm module; None outside anchor_rm. tuning/ (the Ray edge) sits with the command line,
    service/ above everything."""
    parts = module.split(".")
    if parts[0] == "tuning":  # the Ray edge, which the command line starts
        return 7
    if parts[0] == "service":
        return 8
    if parts[0] != "anchor_rm":
        return None
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS[parts[1]]
    raise AssertionError(f"{module}: not in a layer; put it in one of anchor_rm/{{{','.join(LAYERS)}}}/")


def climbing_imports(module: str, source: str) -> list[str]:
    """Every import in `source` (module level or inside a function) of a layer above `module`'s own."""
    import ast

    own = layer_of(module)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            package = (ROOT / node.module.replace(".", "/")).is_dir()  # then the names may be its modules
            targets = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if package else [])
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            try:
                layer = layer_of(target)
            except AssertionError:
                continue  # an attribute imported from a module, not a module of its own
            if layer is not None and layer > own:
                found.append(f"{module} (layer {own}) imports {target} (layer {layer}), line {node.lineno}")
    return sorted(set(found))


@pytest.mark.timeout(60)
def test_the_library_imports_down_its_layers_only():
    climbs = []
    for path in sorted((ROOT / "anchor_rm").rglob("*.py")):
        if "shipped_data" in path.parts:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        climbs += climbing_imports(module, path.read_text())
    assert climbs == [], "imports that climb a layer:\n" + "\n".join(climbs)


def test_the_layer_check_fails_on_an_import_that_climbs():
    assert climbing_imports("anchor_rm.model.scoring", "from anchor_rm.method.training import TrainConfig") == [
        "anchor_rm.model.scoring (layer 2) imports anchor_rm.method.training (layer 4), line 1"]
    inside = "def f():\n    from anchor_rm.mlflow_edge import store\n"  # a lazy import climbs too
    assert climbing_imports("anchor_rm.evaluation.report", inside)[0].endswith("line 2")
    assert climbing_imports("anchor_rm.data.splits", "import service.batching")  # the service is above the library
    assert climbing_imports("anchor_rm.evaluation.scores", "from anchor_rm import pipeline")  # a package's name
    assert climbing_imports("anchor_rm.pipeline.study", "from anchor_rm.model.scoring import rank") == []  # down
    with pytest.raises(AssertionError, match="not in a layer"):
        layer_of("anchor_rm.loose_module")
