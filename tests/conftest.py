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
