import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

# The served service (a registry, `bentoml serve`, an HTTP client) for test_service_http and test_fuzz.
pytest_plugins = ["service_fixtures"]


@pytest.fixture(scope="session")
def minilm_tokenizer():
    from anchor_rm.models import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("minilm-l6"))


@pytest.fixture
def tiny_bert(minilm_tokenizer):
    """A 2-layer, 32-wide BERT on MiniLM's vocabulary: real code paths, millisecond steps (helpers.tiny_bert)."""
    from helpers import tiny_bert

    return lambda seed=0: tiny_bert(minilm_tokenizer, seed)


# The longest modules first (measured, docs/benchmarks.md "Test suite"): with two xdist workers taking one
# module at a time in this order, the tune test (about 10 minutes) starts at once and the rest share the
# other worker, instead of the tune test starting last and running alone.
LONGEST_FIRST = ("test_tune.py", "test_pipeline_train.py", "test_study.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
