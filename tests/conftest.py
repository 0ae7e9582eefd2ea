import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two xdist workers share the cores, and each torch process (a pipeline, a Ray worker, a service: all inherit
# this) runs as many OpenMP threads as there are cores. By default an OpenMP thread that waits spins, taking a
# core from the other worker's process: two 2-thread trainers on 2 cores did 0.20 steps/s together, against
# 0.49 with waiting threads that sleep, and 0.41-0.44 for one alone (M3, bench/oversubscription.py,
# docs/benchmarks.md). Set before anything loads torch's OpenMP runtime, which reads it once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every process the tests start writes its temporary files into one folder, removed when the first pytest
# process (xdist's controller, or the only one with -n 0) ends: a pipeline that a test SIGKILLs cannot remove
# its own (each killed tune run left 0.3-0.8 GB in /tmp, about 1 GB per suite run).
# That first process keeps the system's folder for itself (pytest's tmp_path lives there); Ray keeps /tmp/ray
# (its socket paths must stay under 108 bytes).
if "ANCHOR_RM_TEST_SCRATCH" not in os.environ:
    tempfile.tempdir = tempfile.gettempdir()
    os.environ.setdefault("RAY_TMPDIR", tempfile.tempdir)
    os.environ["ANCHOR_RM_TEST_SCRATCH"] = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="anchor-rm-tests-")
    atexit.register(shutil.rmtree, os.environ["ANCHOR_RM_TEST_SCRATCH"], ignore_errors=True)
# Ray Train starts a preemption watcher actor per trial (about 5 s of CPU each here) that polls for draining
# nodes; no test drains a node, so the tests do without it. Production keeps Ray's default.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# The tests make their own stores; a developer's MLflow URIs must not reach them. Nor may a developer's Ray
# cluster or token: each cluster a test starts has its own (tests/helpers.py: ray_head), and tune.py's local
# clusters make theirs (pipelines/tune.py: use_ray_token).
URI_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
for _name in (*URI_ENV, "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
    os.environ.pop(_name, None)

import pytest  # noqa: E402

# The served service (a registry, `bentoml serve`, an HTTP client) for test_service_http and test_fuzz.
pytest_plugins = ["service_fixtures"]


@pytest.fixture(autouse=True)
def mlflow_uris_do_not_leak():
    """MLflow keeps the tracking and registry URIs in module globals and exports them to the environment, so a
    test's URIs would outlive it in its worker process. store.connect moves the registry with the tracking
    store (tests/test_fast_units.py); a test that sets URIs with MLflow's own calls still must not reach the
    next one. Each test leaves both URIs as it found them (a module's fixtures may have set them before)."""
    env = {name: os.environ.get(name) for name in URI_ENV}
    modules = ("mlflow.tracking._tracking_service.utils", "_tracking_uri"), ("mlflow.tracking._model_registry.utils", "_registry_uri")
    saved = [getattr(sys.modules.get(module), attr, None) for module, attr in modules]
    yield
    for (module, attr), value in zip(modules, saved):
        if module in sys.modules:
            setattr(sys.modules[module], attr, value)
    for name, value in env.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


@pytest.fixture(scope="session")
def minilm_tokenizer():
    from anchor_rm.model.loading import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("minilm-l6"))


@pytest.fixture
def tiny_bert(minilm_tokenizer):
    """A 2-layer, 32-wide BERT on MiniLM's vocabulary: real code paths, millisecond steps (helpers.tiny_bert)."""
    from helpers import tiny_bert

    return lambda seed=0: tiny_bert(minilm_tokenizer, seed)


# The longest modules first (measured, docs/benchmarks.md "Test suite"): with two xdist workers taking one
# module at a time in this order, the tune test (14.5-25 minutes beside the rest on 2 AVX2-only cores) and
# the cluster test start at once and the rest share what is left, instead of a long test starting last and
# running alone. test_fsdp.py (its sharded LoRA tune run: 8-10 minutes beside the rest, M3) comes before the
# 3-4-minute modules.
LONGEST_FIRST = ("test_tune.py", "test_cluster.py", "test_resume.py", "test_fsdp.py", "test_pipeline_train.py",
                 "test_study.py", "test_packaging.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
