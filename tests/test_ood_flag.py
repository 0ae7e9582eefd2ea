"""The OOD flag (anchor_rm/model/ood_flag.py): the density, its threshold, the representation it reads from the
scoring pass, its files beside the model, and the report block that measures it."""

import json

import numpy as np
import pytest
import torch

from anchor_rm.data.records import PreferencePair
from anchor_rm.evaluation.report import SplitResult, build_report, report_from_dict
from anchor_rm.evaluation.report_files import report_to_markdown
from anchor_rm.model.ood_flag import (ARRAYS_FILE, INFO_FILE, FlaggedSet, auroc, fit_density, ledoit_wolf,
                                      load_density, measure_sets)

RNG = np.random.default_rng(0)


def gaussian(n, d, shift=0.0, seed=0):
    rng = np.random.default_rng(seed)
    scales = np.linspace(0.3, 3.0, d)
    return rng.normal(size=(n, d)) * scales + shift


def test_ledoit_wolf_is_sklearns_estimate():
    sklearn_covariance = pytest.importorskip("sklearn.covariance")
    x = gaussian(40, 25, seed=1)
    ours, shrinkage = ledoit_wolf(x)
    theirs, their_shrinkage = sklearn_covariance.ledoit_wolf(x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12)
    assert shrinkage == pytest.approx(their_shrinkage, rel=1e-10)


def test_the_score_is_the_mahalanobis_distance_of_the_shrunk_gaussian_and_of_its_compact_form():
    x, probe = gaussian(300, 12, seed=2), gaussian(20, 12, shift=0.5, seed=3)
    covariance, _ = ledoit_wolf(x)
    centred = probe - x.mean(axis=0)
    full = fit_density(x, x[:50], fit_split="train", threshold_split="val")
    expected = np.einsum("ij,jk,ik->i", centred, np.linalg.inv(covariance), centred) / 12
    np.testing.assert_allclose(full.score(probe), expected, rtol=1e-8)
    # Four components kept: the others share their mean variance (probabilistic PCA's covariance).
    compact = fit_density(x, x[:50], fit_split="train", threshold_split="val", max_components=4)
    values, vectors = np.linalg.eigh(covariance)
    top, rest = vectors[:, -4:], values[:-4].mean()
    ppca = top @ np.diag(values[-4:]) @ top.T + rest * (np.eye(12) - top @ top.T)
    np.testing.assert_allclose(compact.score(probe),
                               np.einsum("ij,jk,ik->i", centred, np.linalg.inv(ppca), centred) / 12, rtol=1e-8)
    assert compact.basis.shape == (4, 12)
    with pytest.raises(ValueError, match="fitted on 12 dimensions"):
        full.score(probe[:, :5])


def test_the_threshold_flags_its_quantile_of_the_threshold_split_and_shifted_data_mostly():
    x, val = gaussian(2000, 8, seed=4), gaussian(1000, 8, seed=5)
    fit = fit_density(x, val, fit_split="train", threshold_split="val", quantile=0.9)
    assert fit.threshold == pytest.approx(np.quantile(fit.score(val), 0.9))
    assert np.mean(fit.in_domain(fit.score(val))) == pytest.approx(0.9, abs=0.002)
    assert np.mean(fit.score(x)) == pytest.approx(1.0, abs=0.05)  # per dimension: about 1 in distribution
    shifted = fit.score(gaussian(500, 8, shift=3.0, seed=6))
    assert np.mean(~fit.in_domain(shifted)) > 0.9
    with pytest.raises(ValueError, match="quantile"):
        fit_density(x, val, fit_split="t", threshold_split="v", quantile=1.0)
    with pytest.raises(ValueError, match="NaN or infinite"):
        fit_density(np.full((3, 2), np.nan), val[:, :2], fit_split="t", threshold_split="v")


def test_auroc_counts_ties_half_and_its_standard_error_is_hanley_mcneils():
    metrics = pytest.importorskip("sklearn.metrics")
    positive, negative = np.array([3.0, 2.0, 2.0, 5.0, 0.5]), np.array([1.0, 2.0, 0.5, 0.1])
    area, se = auroc(positive, negative)
    labels = np.r_[np.ones(5), np.zeros(4)]
    assert area == pytest.approx(metrics.roc_auc_score(labels, np.r_[positive, negative]))
    q1, q2 = area / (2 - area), 2 * area ** 2 / (1 + area)
    assert se == pytest.approx(np.sqrt((area * (1 - area) + 4 * (q1 - area ** 2) + 3 * (q2 - area ** 2)) / 20))
    same, _ = auroc(RNG.normal(size=4000), RNG.normal(size=4000))
    assert same == pytest.approx(0.5, abs=0.03)
    with pytest.raises(ValueError, match="non-empty"):
        auroc(np.array([]), negative)


def test_the_fit_round_trips_through_its_files_and_a_damaged_one_is_named(tmp_path):
    fit = fit_density(gaussian(100, 6), gaussian(30, 6, seed=7), fit_split="student_train", threshold_split="src/val",
                      max_components=3)
    fit.save(tmp_path)
    loaded = load_density(tmp_path)
    probe = gaussian(10, 6, shift=1.0, seed=8)
    np.testing.assert_allclose(loaded.score(probe), fit.score(probe), rtol=1e-5)  # float32 on disk
    assert loaded.describe() == {**fit.describe(), "threshold": pytest.approx(fit.threshold)}
    assert load_density(tmp_path / "nothing-here") is None
    info = json.loads((tmp_path / INFO_FILE).read_text())
    del info["threshold"]
    (tmp_path / INFO_FILE).write_text(json.dumps(info))
    with pytest.raises(ValueError, match=f"{INFO_FILE}.*threshold"):
        load_density(tmp_path)
    (tmp_path / ARRAYS_FILE).write_bytes(b"not an npz")
    with pytest.raises(ValueError, match="cannot be read"):
        load_density(tmp_path)


def pairs(n, dataset="toy", offset=0):
    words = ["apple", "river", "stone", "cloud", "green", "music", "paper", "light"]
    return [PreferencePair(f"Question {i}: tell me about {words[i % 8]}.", f"A kind answer about {words[(i + 1) % 8]}.",
                           f"{words[(i + offset) % 8]} {words[(i + 3) % 8]}", dataset) for i in range(n)]


@pytest.mark.parametrize("architecture", ["bert", "llama"])
def test_scoring_reads_the_last_layers_mean_over_the_anchored_positions_in_the_same_pass(architecture, minilm_tokenizer):
    from helpers import tiny_bert, tiny_llama

    from anchor_rm.evaluation.scores import fit_ood_flag
    from anchor_rm.model.encoding import RewardEncoder, collate
    from anchor_rm.model.reward_model import RewardModel
    from anchor_rm.model.scoring import reward_forward

    model = (tiny_bert if architecture == "bert" else tiny_llama)(minilm_tokenizer, 0).eval()
    rm = RewardModel(model, minilm_tokenizer, RewardEncoder(minilm_tokenizer, 40, decoder=architecture == "llama"), "tiny")
    encoded = rm.encode(pairs(12))
    sequences = encoded.chosen + encoded.rejected
    features = rm.scorer(batch_size=5, precision="fp32").features(sequences)  # the reference below is fp32
    for i in (0, 7, 23):
        batch = collate([sequences[i]], rm.encoder.pad_token_id)
        with torch.no_grad():
            last = reward_forward(model, batch, output_hidden_states=True).hidden_states[-1][0]
        mask = torch.tensor(sequences[i].anchor_mask, dtype=torch.bool)
        np.testing.assert_allclose(features[i], last[mask].mean(dim=0).numpy(), rtol=1e-4, atol=1e-5)

    fit_ood_flag(rm, pairs(40), pairs(20, offset=2), fit_split="student_train", threshold_split="toy/val")
    plain, flagged = rm.scorer(ood_flag=False), rm.scorer()
    prompts, responses = [p.prompt for p in pairs(6, offset=5)], [p.rejected for p in pairs(6, offset=5)]
    without, scored = plain.score(prompts, responses), flagged.score(prompts, responses)
    assert without.ood_scores is None and without.in_domain is None
    np.testing.assert_allclose(scored.rewards, without.rewards, rtol=1e-6)  # the flag changes no reward
    expected = rm.density.score(plain.features([rm.encoder.encode(p, r) for p, r in zip(prompts, responses)]))
    np.testing.assert_allclose(scored.ood_scores, expected, rtol=1e-5)
    assert list(scored.in_domain) == list(expected <= rm.density.threshold)
    # With every layer's states kept for another hook (drift), the flag reads the same last layer.
    rewards, ood = flagged.rewards_and_ood([rm.encoder.encode(p, r) for p, r in zip(prompts, responses)],
                                           lambda *args: None)
    np.testing.assert_allclose(ood, expected, rtol=1e-5)


def test_a_saved_model_serves_its_flag_and_the_report_measures_it(tmp_path, minilm_tokenizer):
    from helpers import tiny_reward_model

    from anchor_rm.evaluation.scores import evaluate_pairs_with_ood, fit_ood_flag, flagged_set
    from anchor_rm.model.reward_model import load_saved, save_reward_model

    rm = tiny_reward_model(minilm_tokenizer, 0, 40)
    fit_ood_flag(rm, pairs(40), pairs(20, offset=2), fit_split="student_train", threshold_split="toy/val")
    save_reward_model(rm, tmp_path / "model")
    loaded = load_saved(tmp_path / "model")
    assert loaded.density.describe()["n_fit"] == 80 and loaded.density.describe()["threshold_split"] == "toy/val"
    probe = pairs(8, offset=4)
    np.testing.assert_allclose(loaded.scorer().score([p.prompt for p in probe], [p.chosen for p in probe]).ood_scores,
                               rm.scorer().score([p.prompt for p in probe], [p.chosen for p in probe]).ood_scores,
                               rtol=1e-4)

    sets = []
    for name, role, data in (("toy", "id", pairs(30, "toy", 1)), ("other", "ood", pairs(25, "other", 6))):
        score, ood = evaluate_pairs_with_ood(loaded, data)
        sets.append(flagged_set(name, role, score, ood))
    block = measure_sets(loaded.density, sets, reference=sets[0])
    assert block["sets"][0]["auroc"] is None and 0 <= block["sets"][1]["auroc"] <= 1
    other = block["sets"][1]
    assert other["n_pairs"] == 25 and other["n_sequences"] == 50
    flagged_pairs = ~(loaded.density.in_domain(sets[1].chosen_scores) & loaded.density.in_domain(sets[1].rejected_scores))
    assert other["flagged_pairs"] == int(flagged_pairs.sum())
    if other["flagged_pairs"]:
        assert other["accuracy_flagged"] == pytest.approx(100 * sets[1].correct[flagged_pairs].mean())
    rows = [SplitResult("toy", "id", "test", 30, 50.0, sets[0].correct.mean() * 100, None, 0.0),
            SplitResult("other", "ood", "test", 25, 50.0, sets[1].correct.mean() * 100, None, 0.0)]
    model = {"name": "m", "student": "s", "teacher": "t", "method": "naive", "hyperparameters": {}}
    report = build_report(model, rows, selection_splits="val", figure_splits="test", ood_flag=block)
    assert report_from_dict(json.loads(json.dumps(report.to_dict()))).ood_flag == json.loads(json.dumps(block))
    assert "## Out-of-distribution flag" in report_to_markdown(report)

    wrong = json.loads(json.dumps(block))
    wrong["sets"][1]["dataset"] = "nowhere"
    with pytest.raises(ValueError, match=r"ood_flag.sets\[1\].dataset: 'nowhere' is not a dataset"):
        build_report(model, rows, selection_splits="val", figure_splits="test", ood_flag=wrong)
    wrong = json.loads(json.dumps(block))
    wrong["sets"][0]["flagged_fraction"] = 1.5
    with pytest.raises(ValueError, match=r"ood_flag.sets\[0\].flagged_fraction"):
        build_report(model, rows, selection_splits="val", figure_splits="test", ood_flag=wrong)


@pytest.mark.parametrize("architecture", ["bert", "llama"])
def test_an_empty_response_scores_with_a_finite_reward_and_ood_score(architecture, minilm_tokenizer):
    """A policy may stop at once: /score, /best_of_n and /get_reward score an empty response like any other."""
    from helpers import tiny_bert, tiny_llama

    from anchor_rm.evaluation.scores import fit_ood_flag
    from anchor_rm.model.encoding import RewardEncoder
    from anchor_rm.model.reward_model import RewardModel

    model = (tiny_bert if architecture == "bert" else tiny_llama)(minilm_tokenizer, 0).eval()
    rm = RewardModel(model, minilm_tokenizer, RewardEncoder(minilm_tokenizer, 40, decoder=architecture == "llama"), "tiny")
    fit_ood_flag(rm, pairs(40), pairs(20, offset=2), fit_split="student_train", threshold_split="toy/val")
    assert any(rm.encoder.encode("Question 1: tell me.", "").anchor_mask)  # [CLS] or the answer's header
    scored = rm.scorer().score(["Question 1: tell me.", "Question 2: and you?"], ["", "   "])
    assert np.isfinite(scored.rewards).all() and np.isfinite(scored.ood_scores).all()
