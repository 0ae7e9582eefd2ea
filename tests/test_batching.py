"""The service's batcher (service/batching.py): pure asyncio, no server."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from service.batching import QueueTimeout, ScoreBatcher


class FakeModel:
    """Scores a response by its length; records every batch; can be held mid-batch."""

    def __init__(self, hold: threading.Event | None = None):
        self.batches: list[list[str]] = []
        self.hold = hold
        self.started = threading.Event()
        self.version = "1"

    def __call__(self, prompts, responses):
        self.started.set()
        if self.hold is not None:
            assert self.hold.wait(10)
        self.batches.append(list(responses))
        return [float(len(r)) for r in responses], [len(r) > 5 for r in responses], self.version


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_a_lone_request_is_scored_at_once_with_its_own_results():
    model = FakeModel()
    batcher = ScoreBatcher(model, max_batch_size=8)

    async def go():
        started = time.perf_counter()
        out = await batcher.score(["p", "p"], ["ab", "abcdefg"])
        return out, time.perf_counter() - started

    (rewards, truncated, version), took = run(go())
    assert rewards == [2.0, 7.0] and truncated == [False, True] and version == "1"
    assert model.batches == [["ab", "abcdefg"]]
    assert took < 1.0  # no timer: an idle model does not wait for company


def test_requests_that_arrive_during_a_batch_share_the_next_one_and_get_their_own_slices():
    hold = threading.Event()
    model = FakeModel(hold)
    batcher = ScoreBatcher(model, max_batch_size=5)

    async def go():
        first = asyncio.create_task(batcher.score(["p"], ["x"]))
        while not model.started.is_set():
            await asyncio.sleep(0.01)
        # while "x" is being scored, four requests queue (2 + 2 + 1 + 3 pairs)
        later = [asyncio.create_task(batcher.score(["p"] * len(rs), rs))
                 for rs in (["aa", "bbb"], ["cccc", "d"], ["eeeee"], ["f", "gg", "hhh"])]
        await asyncio.sleep(0.05)
        hold.set()
        return await first, await asyncio.gather(*later)

    first, later = run(go())
    assert first[0] == [1.0]
    # whole requests up to 5 pairs: [aa bbb cccc d eeeee], then the 3-pair request alone
    assert model.batches == [["x"], ["aa", "bbb", "cccc", "d", "eeeee"], ["f", "gg", "hhh"]]
    assert [r[0] for r in later] == [[2.0, 3.0], [4.0, 1.0], [5.0], [1.0, 2.0, 3.0]]
    assert batcher.stats.batches == 3 and batcher.stats.pairs == 9 and batcher.stats.largest_batch == 5


def test_a_request_larger_than_the_batch_goes_alone_and_is_never_split():
    model = FakeModel()
    batcher = ScoreBatcher(model, max_batch_size=2)
    rewards, _, _ = run(batcher.score(["p"] * 5, ["a", "bb", "ccc", "dddd", "eeeee"]))
    assert rewards == [1.0, 2.0, 3.0, 4.0, 5.0] and len(model.batches) == 1


def test_without_batching_each_request_is_its_own_batch():
    hold = threading.Event()
    model = FakeModel(hold)
    batcher = ScoreBatcher(model, max_batch_size=32, batching=False)

    async def go():
        tasks = [asyncio.create_task(batcher.score(["p"], [r])) for r in ("a", "bb", "ccc")]
        await asyncio.sleep(0.05)
        hold.set()
        return await asyncio.gather(*tasks)

    run(go())
    assert model.batches == [["a"], ["bb"], ["ccc"]]


def test_a_failing_batch_fails_its_requests_only():
    calls = []

    def flaky(prompts, responses):
        calls.append(responses)
        if "boom" in responses:
            raise RuntimeError("model exploded")
        return [1.0] * len(responses), [False] * len(responses), "v"

    batcher = ScoreBatcher(flaky)

    async def go():
        with pytest.raises(RuntimeError, match="model exploded"):
            await batcher.score(["p"], ["boom"])
        return await batcher.score(["p"], ["fine"])

    assert run(go())[0] == [1.0]


def test_a_request_queued_past_the_limit_gets_queue_timeout_and_the_rest_go_on():
    hold = threading.Event()
    model = FakeModel(hold)
    batcher = ScoreBatcher(model, max_batch_size=4, max_wait_seconds=0.1)

    async def go():
        first = asyncio.create_task(batcher.score(["p"], ["x"]))
        while not model.started.is_set():
            await asyncio.sleep(0.01)
        late = asyncio.create_task(batcher.score(["p"], ["yy"]))
        await asyncio.sleep(0.3)  # "yy" waits behind the held batch, past the 0.1 s limit
        hold.set()
        await first
        with pytest.raises(QueueTimeout, match="more than the limit of 0.1 s"):
            await late
        return await batcher.score(["p"], ["zzz"])  # the batcher still serves

    assert run(go())[0] == [3.0]
    assert batcher.stats.timed_out == 1 and ["yy"] not in model.batches


def test_a_cancelled_request_is_not_scored():
    hold = threading.Event()
    model = FakeModel(hold)
    batcher = ScoreBatcher(model)

    async def go():
        first = asyncio.create_task(batcher.score(["p"], ["x"]))
        while not model.started.is_set():
            await asyncio.sleep(0.01)
        gone = asyncio.create_task(batcher.score(["p"], ["client left"]))
        kept = asyncio.create_task(batcher.score(["p"], ["kept"]))
        await asyncio.sleep(0.02)
        gone.cancel()
        hold.set()
        await first
        return await kept

    assert run(go())[0] == [4.0]
    assert model.batches == [["x"], ["kept"]]


def test_mismatched_lengths_and_bad_batch_sizes_are_refused():
    with pytest.raises(ValueError, match="max_batch_size=0"):
        ScoreBatcher(FakeModel(), max_batch_size=0)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        run(ScoreBatcher(FakeModel()).score(["a", "b"], ["c"]))


# ---------------------------------------------------------------------------------------------------
# A reward does not depend on its batch-mates (anchor_rm/model/scoring.py, WIDTH_BUCKET): what /model states.

def _texts(n: int) -> list[tuple[str, str]]:
    return [(f"Question {i}: how should I handle situation number {i}?",
             ("Here is a careful answer with a reason. " * (1 + (7 * i) % 11)) + f"Item {i}.") for i in range(n)]


def _largest_batch_effect(scorer, items) -> float:
    import numpy as np

    alone = np.array([scorer.score([p], [r]).rewards[0] for p, r in items])
    together = scorer.score([p for p, _ in items], [r for _, r in items]).rewards
    reversed_pairs = np.array([scorer.score([items[i][0], items[-1 - i][0]], [items[i][1], items[-1 - i][1]]).rewards[0]
                               for i in range(len(items))])
    return float(max(np.abs(alone - together).max(), np.abs(alone - reversed_pairs).max()))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_reward_scored_alone_or_with_any_batch_mates_differs_by_at_most_the_stated_bound(precision,
                                                                                          minilm_tokenizer):
    """MiniLM-L6 (pretrained: under bf16 its rewards moved 1.6e-4 with the batch's padded width before the width
    buckets) and a tiny Llama (the decoder students' architecture), texts of 10-150 tokens, in both precisions."""
    import torch

    from anchor_rm.model.encoding import RewardEncoder
    from anchor_rm.model.reward_model import load_pretrained
    from anchor_rm.model.scoring import BATCH_INVARIANCE_BOUND, RewardScorer, batch_invariance
    from helpers import tiny_llama

    assert batch_invariance()["bound"] == BATCH_INVARIANCE_BOUND  # what /model states is what is asserted here
    torch.manual_seed(0)
    minilm = load_pretrained("minilm-l6", 256, 0)
    llama = tiny_llama(minilm_tokenizer)
    items = _texts(12)
    for model, encoder in ((minilm.model, minilm.encoder), (llama, RewardEncoder(minilm_tokenizer, 256, decoder=True))):
        model.eval()
        effect = _largest_batch_effect(RewardScorer(model, encoder, 4, precision), items)
        assert effect <= BATCH_INVARIANCE_BOUND, (type(model).__name__, precision, effect)
