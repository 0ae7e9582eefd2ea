import math

import pytest
import torch

from anchor_rm.method.losses import (anchor_loss, confidence_alpha, confidence_w2s_loss, resolve_anchor_layers,
                                     soft_bradley_terry_loss)


def test_soft_bradley_terry_hand_values():
    assert soft_bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.9])).item() == pytest.approx(math.log(2))
    margin = torch.tensor([math.log(3.0)])  # sigmoid = 0.75
    assert soft_bradley_terry_loss(margin, torch.tensor([1.0])).item() == pytest.approx(-math.log(0.75))
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert soft_bradley_terry_loss(margin, torch.tensor([0.75])).item() == pytest.approx(expected)
    # mean over pairs
    both = soft_bradley_terry_loss(torch.tensor([0.0, math.log(3.0)]), torch.tensor([1.0, 1.0])).item()
    assert both == pytest.approx((math.log(2) - math.log(0.75)) / 2)


def test_confidence_loss_hand_value():
    margin = torch.tensor([math.log(3.0)])  # p = 0.75, hardened target 1
    ce_teacher = -(0.25 * math.log(0.75) + 0.75 * math.log(0.25))
    ce_self = -math.log(0.75)
    value = confidence_w2s_loss(margin, torch.tensor([0.25]), alpha=0.5).item()
    assert value == pytest.approx(0.5 * ce_teacher + 0.5 * ce_self)
    assert confidence_w2s_loss(margin, torch.tensor([0.25]), alpha=0.0).item() == pytest.approx(ce_teacher)


def test_confidence_hardened_target_has_no_gradient():
    margin = torch.tensor([0.3], requires_grad=True)
    confidence_w2s_loss(margin, torch.tensor([0.5]), alpha=1.0).backward()
    # d/dm BCE(m, 1) = sigmoid(m) - 1: the target itself is not differentiated
    assert margin.grad.item() == pytest.approx(torch.sigmoid(torch.tensor(0.3)).item() - 1)


def test_confidence_alpha_warms_up_linearly():
    assert confidence_alpha(0, 100, 0.75) == 0.0
    assert confidence_alpha(10, 100, 0.75) == pytest.approx(0.375)
    assert confidence_alpha(20, 100, 0.75) == pytest.approx(0.75)
    assert confidence_alpha(90, 100, 0.75) == pytest.approx(0.75)


def test_anchor_loss_hand_value():
    student = torch.tensor([[[0.0, 0.0], [1.0, 1.0], [2.0, 0.0]]])  # per-token mean squares 0, 1, 2
    reference = torch.zeros_like(student)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    assert anchor_loss([student], [reference], mask).item() == pytest.approx(1.5)


def test_anchor_loss_means_per_sequence_then_over_sequences_and_layers():
    student = torch.zeros(2, 3, 1)
    student[0, 0, 0] = 2.0  # sequence A: one response token, squared error 4
    student[1, :, 0] = 1.0  # sequence B: three response tokens, squared error 1 each
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    layer1 = anchor_loss([student], [torch.zeros_like(student)], mask).item()
    assert layer1 == pytest.approx((4 + 1) / 2)
    two_layers = anchor_loss([student, torch.zeros_like(student)], [torch.zeros_like(student)] * 2, mask).item()
    assert two_layers == pytest.approx(2.5 / 2)


def test_prompt_and_padding_positions_cannot_change_the_anchor_term():
    torch.manual_seed(0)
    student = torch.randn(3, 7, 5, requires_grad=True)
    reference = torch.randn(3, 7, 5)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 0, 0]], dtype=torch.float32)
    base = anchor_loss([student], [reference], mask)
    base.backward()
    assert torch.all(student.grad[mask == 0] == 0)  # no gradient reaches prompt or padding positions
    changed_student = student.detach().clone()
    changed_reference = reference.clone()
    changed_student[mask == 0] = 1e6  # anything at all where the mask is 0
    changed_reference[mask == 0] = -1e6
    assert anchor_loss([changed_student], [changed_reference], mask).item() == pytest.approx(base.item())


def test_anchor_loss_is_zero_for_identical_states():
    states = torch.randn(2, 4, 3)
    assert anchor_loss([states], [states.clone()], torch.ones(2, 4)).item() == 0.0


def test_anchor_loss_rejects_mismatched_layers():
    with pytest.raises(ValueError, match="same non-zero number"):
        anchor_loss([torch.zeros(1, 1, 1)], [], torch.ones(1, 1))


def test_resolve_anchor_layers():
    assert resolve_anchor_layers("last", 6) == [6]
    assert resolve_anchor_layers("middle", 6) == [3, 5]
    assert resolve_anchor_layers("middle", 30) == [15, 23]
    assert resolve_anchor_layers("2,4", 6) == [2, 4]
    assert resolve_anchor_layers([4, 2, 2], 6) == [2, 4]
    with pytest.raises(ValueError, match="out of range"):
        resolve_anchor_layers("0,7", 6)
    with pytest.raises(ValueError, match="'last', 'middle'"):
        resolve_anchor_layers("top", 6)
