"""What a served model holds in bf16 and what it keeps in fp32, and that its rewards are evaluation's (issue 46,
item 9): the service casts the matmul weights alone, on the CPU before any move (service/holder.py,
place_for_scoring), so the rotary inv_freq buffer, the norms, the embeddings and the reward head stay fp32,
as evaluation holds them; and it declares a GPU to BentoML only where it scores on one (service/config.py)."""

from __future__ import annotations

import random
import types
import warnings

import pytest
import torch

from anchor_rm.model.encoding import RewardEncoder
from anchor_rm.model.reward_model import RewardModel, load_saved, save_reward_model
from anchor_rm.model.scoring import RewardScorer, reward_head
from helpers import tiny_llama
from service.config import Settings, SettingsError, declared_gpus, gpu_resources, load_settings
from service.holder import load_served_model, place_for_scoring

# bf16 requested on a CPU that emulates it warns once (anchor_rm/model/precision.py); here that is expected.
pytestmark = pytest.mark.filterwarnings("ignore:precision bf16 requested")

MAX_LENGTH = 512
WORDS = ("the river stone light garden window quiet market paper music winter road answer people morning "
         "kitchen letter doctor bridge forest number story table question summer island engine voice").split()


@pytest.fixture(scope="module")
def llama_folder(minilm_tokenizer, tmp_path_factory):
    """A tiny Llama reward model (RoPE, RMSNorm, a score head) saved as the project saves models, scoring
    pairs of up to 512 tokens."""
    model = tiny_llama(minilm_tokenizer, seed=3)
    assert model.config.max_position_embeddings >= MAX_LENGTH
    encoder = RewardEncoder(minilm_tokenizer, MAX_LENGTH, decoder=True)
    return save_reward_model(RewardModel(model, minilm_tokenizer, encoder, "tiny-llama"),
                             tmp_path_factory.mktemp("tiny-llama") / "model")


def long_pairs(n: int = 4, seed: int = 0) -> tuple[list[str], list[str]]:
    """n (prompt, response) pairs of about 520 words, cut to the 512-token budget."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(300)) + "?" for _ in range(n)]
    responses = [" ".join(rng.choice(WORDS) for _ in range(220)) + "." for _ in range(n)]
    return prompts, responses


def tensors_by_dtype(model) -> dict[str, torch.dtype]:
    """Every parameter and buffer, by name."""
    return {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}


def assert_matmul_weights_alone_in_bf16(model) -> None:
    head = reward_head(model)
    matmul = {f"{name}.{p}" for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and m is not head for p, _ in m.named_parameters(recurse=False)}
    dtypes = tensors_by_dtype(model)
    assert matmul and all(dtypes[name] == torch.bfloat16 for name in matmul)
    # Everything else stays fp32 -- named, so that a failure says which.
    assert {name: d for name, d in dtypes.items() if name not in matmul and d != torch.float32} == {}
    assert head.weight.dtype == torch.float32
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(m.weight.dtype == torch.float32 for m in norms)
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    assert embeddings and all(m.weight.dtype == torch.float32 for m in embeddings)
    inv_freq = [b for name, b in model.named_buffers() if name.endswith("inv_freq")]
    assert inv_freq and all(b.dtype == torch.float32 for b in inv_freq)


def test_a_bf16_service_holds_its_matmul_weights_in_bf16_and_inv_freq_norms_embeddings_and_head_in_fp32(
        llama_folder, tmp_path):
    served = load_served_model(str(llama_folder), tmp_path / "dl", precision="bf16", device="cpu")
    assert served.scorer.precision == "bf16" and served.describe()["device"] == "cpu"
    assert_matmul_weights_alone_in_bf16(served.scorer.model)


def test_served_rewards_of_512_token_pairs_are_evaluations_bit_for_bit(llama_folder, tmp_path):
    """Evaluation scores fp32 weights under bf16 autocast (load_saved + RewardScorer); the service casts the same
    weights to bf16 once. Tolerance: none (exact equality): autocast rounds an fp32 weight to bf16 exactly as
    the one cast does, and the same bf16 values reach the same kernels, so any difference at all means a
    tensor was held in another dtype than evaluation's. (Rewards near 0.15, 8e-3 apart; a rounded inv_freq
    alone moves them by about 4e-5, the old whole-model cast by 3e-4: the next test.)"""
    prompts, responses = long_pairs()
    served = load_served_model(str(llama_folder), tmp_path / "dl", precision="bf16", device="cpu")
    assert served.token_counts(prompts, responses) == [MAX_LENGTH] * len(prompts)
    scored = served.score(prompts, responses)
    assert scored.truncated.all()
    evaluated = load_saved(llama_folder).scorer(batch_size=2, precision="bf16").score(prompts, responses)
    assert scored.rewards.tolist() == evaluated.rewards.tolist()
    assert len(set(scored.rewards.tolist())) == len(prompts)  # distinct pairs, distinct rewards: a real comparison


def test_the_old_whole_model_bf16_cast_rounds_inv_freq_and_the_head_and_moves_the_rewards(llama_folder):
    """What the old GPU branch did (`model.to(torch.bfloat16)` after the move): the tests above tell it apart,
    and a rounded inv_freq alone already moves the rewards of 512-token pairs."""
    prompts, responses = long_pairs()
    evaluation = load_saved(llama_folder)
    expected = evaluation.scorer(batch_size=2, precision="bf16").score(prompts, responses).rewards

    def rewards(model):
        return RewardScorer(model, evaluation.encoder, batch_size=2, precision="bf16").score(prompts, responses).rewards

    rounded = load_saved(llama_folder).model
    place_for_scoring(rounded, "bf16", "cpu")
    rotary = [m for m in rounded.modules() if hasattr(m, "inv_freq")]
    for module in rotary:
        module.inv_freq = module.inv_freq.to(torch.bfloat16).float()  # rounded to bf16, as the old cast left it
    assert rotary and abs(rewards(rounded) - expected).max() > 0

    whole = load_saved(llama_folder).model.to(torch.bfloat16)
    assert reward_head(whole).weight.dtype == torch.bfloat16
    assert all(b.dtype == torch.bfloat16 for name, b in whole.named_buffers() if name.endswith("inv_freq"))
    with pytest.raises(AssertionError):
        assert_matmul_weights_alone_in_bf16(whole)
    assert abs(rewards(whole) - expected).max() > 1e-4


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_weights_are_cast_on_the_cpu_before_the_move_for_any_device(llama_folder, device):
    """One path for the CPU and a GPU: the cast is decided from the precision resolved for the device and done
    before the move, so a GPU never receives the fp32 copy. Without a GPU the move to cuda fails, and what was
    cast before it shows."""
    model = load_saved(llama_folder).model
    if device == "cuda" and not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="ANCHOR_RM_DEVICE=cuda: cannot place the model there"):
            place_for_scoring(model, "bf16", device)
        assert next(model.parameters()).device.type == "cpu"
    else:
        assert place_for_scoring(model, "bf16", device) == "bf16"
        assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {device}
    assert_matmul_weights_alone_in_bf16(model)


def test_fp32_scoring_casts_nothing(llama_folder):
    model = load_saved(llama_folder).model
    assert place_for_scoring(model, "fp32", "cpu") == "fp32"
    assert set(tensors_by_dtype(model).values()) == {torch.float32}


@pytest.mark.parametrize("device, gpu_visible, expected", [
    ("auto", True, 1), ("cuda", True, 1), ("cuda:0", True, 1),
    ("auto", False, 0), ("cuda", False, 0),  # no GPU: BentoML would name one that is not there (the test below)
    ("cpu", True, 0),  # scoring on the CPU holds no GPU
    ("cuda:1", True, 0),  # names its GPU itself; a declared one would renumber what the worker sees
])
def test_a_gpu_is_declared_by_default_only_where_the_service_scores_on_one(device, gpu_visible, expected):
    settings = Settings(device=device)
    assert declared_gpus(settings, gpu_visible) == expected
    assert gpu_resources(settings, gpu_visible) == ({"gpu": expected} if expected else {})


def test_anchor_rm_gpus_overrides_the_default_and_is_checked():
    assert load_settings({}).gpus is None
    assert load_settings({"ANCHOR_RM_GPUS": "auto"}).gpus is None
    assert gpu_resources(load_settings({"ANCHOR_RM_GPUS": "2"}), gpu_visible=False) == {"gpu": 2}
    assert gpu_resources(load_settings({"ANCHOR_RM_GPUS": "0", "ANCHOR_RM_DEVICE": "cuda"}), gpu_visible=True) == {}
    for bad in ("-1", "1.5", "many"):
        with pytest.raises(SettingsError, match="ANCHOR_RM_GPUS"):
            load_settings({"ANCHOR_RM_GPUS": bad})


def test_bentoml_names_a_declared_gpu_in_the_workers_cuda_visible_devices(monkeypatch):
    """What BentoML 1.4 does with resources={"gpu": 1} (_bentoml_impl/server/allocator.py,
    ResourceAllocator.get_worker_env): the worker's CUDA_VISIBLE_DEVICES names the first GPU no other service
    of the same `bentoml serve` holds -- also on a machine without one, where it names GPU 0 all the same
    (after a ResourceWarning) -- and nothing where CUDA_VISIBLE_DEVICES is set already."""
    from _bentoml_impl.server.allocator import ResourceAllocator

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("BENTOML_DISABLE_GPU_ALLOCATION", raising=False)
    service = types.SimpleNamespace(name="anchor_rm_reward")
    declared = {"anchor_rm_reward": {"workers": 1, "resources": {"gpu": 1}}}
    allocator = ResourceAllocator()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        assert allocator.get_worker_env(service, services=declared) == (1, {"CUDA_VISIBLE_DEVICES": "0"})
        assert allocator.get_worker_env(service, services=declared) == (1, {"CUDA_VISIBLE_DEVICES": "1"})
    assert ResourceAllocator().get_worker_env(service, services={"anchor_rm_reward": {"workers": 1}}) == (1, {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert ResourceAllocator().get_worker_env(service, services=declared) == (1, {})
