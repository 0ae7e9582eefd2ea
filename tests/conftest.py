import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def minilm_tokenizer():
    from anchor_rm.models import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("minilm-l6"))


@pytest.fixture
def tiny_bert(minilm_tokenizer):
    """A 2-layer, 32-wide BERT on MiniLM's vocabulary: real code paths, millisecond steps."""
    from transformers import BertConfig, BertForSequenceClassification

    def make(seed: int = 0):
        torch.manual_seed(seed)
        config = BertConfig(vocab_size=minilm_tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=64, num_labels=1, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, pad_token_id=minilm_tokenizer.pad_token_id)
        return BertForSequenceClassification(config)

    return make
