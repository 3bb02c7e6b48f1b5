"""The PPO-clip + k3 loss on hand-made per-token tensors, where every value can be worked out."""

from __future__ import annotations

import math

import pytest
import torch

from core.train.loss import policy_loss


def tensors(logp, old, adv, mask, weights=None):
    as_t = lambda xs: torch.tensor([xs], dtype=torch.float32)  # noqa: E731
    new = as_t(logp).requires_grad_(True)
    return (
        new,
        as_t(old),
        as_t(adv),
        torch.tensor([mask]),
        as_t(weights if weights is not None else [1.0] * len(logp)),
    )


def loss_of(logp, old, adv, mask, weights=None, normalizer=None, **kw):
    new, old_t, adv_t, mask_t, w = tensors(logp, old, adv, mask, weights)
    kw.setdefault("clip_low", 0.2)
    kw.setdefault("clip_high", 0.2)
    terms = policy_loss(new, old_t, adv_t, mask_t, w, normalizer=normalizer or float(sum(mask)), **kw)
    terms.loss.backward()
    return terms, new.grad[0].tolist()


def test_on_policy_loss_is_minus_the_weighted_mean_advantage_and_gradient_is_the_advantage():
    logp = [-1.0, -2.0, -3.0]
    terms, grad = loss_of(logp, logp, [2.0, -1.0, 5.0], [True, True, False], [1.0, 3.0, 1.0], normalizer=4.0)
    assert terms.loss.item() == pytest.approx(-(2.0 * 1 + (-1.0) * 3) / 4)
    # d/dlogp of -w*A*exp(logp - old) at ratio 1 is -w*A/normalizer; the masked-out token gets nothing.
    assert grad == pytest.approx([-2.0 / 4, 3.0 / 4, 0.0])
    assert terms.tokens == 2 and terms.clipped == 0 and terms.kl_sum == 0.0


def test_ratios_beyond_the_bound_in_the_advantages_direction_pass_no_gradient():
    up = math.log(1.5)  # ratio 1.5, past 1 + 0.2
    terms, grad = loss_of([up, up, -up, -up], [0.0] * 4, [1.0, -1.0, 1.0, -1.0], [True] * 4)
    # Positive advantage above the bound and negative advantage below it are clipped; the others are not.
    assert grad[0] == 0.0 and grad[3] == 0.0
    assert grad[1] == pytest.approx(1.5 / 4) and grad[2] == pytest.approx(-(1 / 1.5) / 4)
    assert terms.clipped == 2


def test_asymmetric_bounds_let_positive_advantages_climb_further():
    up = math.log(1.25)
    _, tight = loss_of([up], [0.0], [1.0], [True], clip_low=0.2, clip_high=0.2)
    _, loose = loss_of([up], [0.0], [1.0], [True], clip_low=0.2, clip_high=0.28)
    assert tight == [0.0]
    assert loose == pytest.approx([-1.25])


def test_tis_weights_each_token_by_its_truncated_ratio_instead_of_clipping():
    up = math.log(1.5)
    terms, grad = loss_of([up, up, 0.0], [0.0] * 3, [1.0, -1.0, 1.0], [True] * 3, tis_cap=1.2)
    # Gradient -w*A/normalizer with w = min(ratio, cap): 1.2 for the off-policy pair, 1 on-policy.
    assert grad == pytest.approx([-1.2 / 3, 1.2 / 3, -1.0 / 3])
    assert terms.loss.item() == pytest.approx(-(1.2 - 1.2 + 1.0) / 3)
    assert terms.clipped == 2  # tokens whose weight hit the cap


def test_k3_is_zero_at_the_reference_and_positive_away_from_it():
    base = dict(old=[-1.0, -1.0], adv=[0.0, 0.0], mask=[True, True], kl_coef=0.5)
    at_ref, _ = loss_of([-1.0, -1.0], ref_logp=torch.tensor([[-1.0, -1.0]]), **base)
    assert at_ref.kl_sum == 0.0 and at_ref.loss.item() == 0.0
    away, grad = loss_of([-1.0, -1.0], ref_logp=torch.tensor([[-2.0, -0.5]]), **base)
    d = [-1.0, 0.5]  # ref - new
    expected = [math.exp(x) - x - 1 for x in d]
    assert away.kl_sum == pytest.approx(sum(expected))
    assert away.loss.item() == pytest.approx(0.5 * sum(expected) / 2)
    # d k3 / d logp = 1 - exp(ref - new): the penalty pulls the policy toward the reference.
    assert grad == pytest.approx([0.5 * (1 - math.exp(x)) / 2 for x in d])


def test_garbage_on_padding_does_not_leak_into_the_loss():
    terms, grad = loss_of([-1.0, float("nan")], [-1.0, float("inf")], [1.0, float("nan")], [True, False])
    assert math.isfinite(terms.loss.item())
    assert grad[0] == pytest.approx(-1.0) and grad[1] == 0.0


def test_the_behaviour_logprob_gap_is_summed_and_maxed_over_trained_tokens_only():
    terms, _ = loss_of([-1.0, -2.5, -3.0, -9.0], [-1.25, -2.0, -3.0, float("nan")], [1.0, -1.0, 1.0, 1.0],
                       [True, True, True, False])
    assert terms.behaviour_diff_sum == pytest.approx(0.75)
    assert terms.behaviour_diff_max == pytest.approx(0.5)  # the padding's NaN gap counts for nothing


def test_a_far_off_policy_token_stays_finite():
    terms, grad = loss_of([0.0], [-500.0], [-1.0], [True])
    assert math.isfinite(terms.loss.item()) and all(math.isfinite(g) for g in grad)


def test_bad_arguments_are_refused_with_a_reason():
    new, old, adv, mask, w = tensors([-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0], [True, True])
    with pytest.raises(ValueError, match="one shape"):
        policy_loss(new, old[:, :1], adv, mask, w, clip_low=0.2, clip_high=0.2, normalizer=2.0)
    with pytest.raises(ValueError, match="normalizer must be positive"):
        policy_loss(new, old, adv, mask, w, clip_low=0.2, clip_high=0.2, normalizer=0.0)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(new, old, adv, mask, w, clip_low=0.2, clip_high=0.2, normalizer=2.0, kl_coef=0.1)


def two_rows(logp, old, adv, mask, **kw):
    """loss_of for a [2, T] batch: each argument a pair of rows (two sequences)."""
    new = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    kw.setdefault("clip_low", 0.2)
    kw.setdefault("clip_high", 0.2)
    terms = policy_loss(new, as_t(old), as_t(adv), torch.tensor(mask), torch.ones_like(new),
                        normalizer=float(sum(map(sum, mask))), **kw)
    terms.loss.backward()
    return terms, new.grad.tolist()


def test_token_mis_drops_the_tokens_whose_ratio_leaves_its_bounds_and_counts_them():
    # Ratios 3.0 and 1/3 leave [1/2, 2]; 1.5 and 1 stay. The dropped tokens get no gradient, the kept
    # ones exactly PPO-clip's, and the normaliser still counts all four (TRL zeroes their weight).
    far, near = math.log(3.0), math.log(1.5)
    terms, grad = loss_of([far, -far, near, 0.0], [0.0] * 4, [1.0, -1.0, -1.0, 1.0], [True] * 4,
                          correction="token_mis", tis_cap=2.0, clip_low=0.6, clip_high=0.6)
    assert grad == pytest.approx([0.0, 0.0, 1.5 / 4, -1.0 / 4])
    assert terms.masked_out == 2 and terms.tokens == 4
    assert terms.loss.item() == pytest.approx(-(-1.5 + 1.0) / 4)


def test_seq_mis_drops_a_whole_sequence_whose_summed_ratio_leaves_its_bounds():
    # Row 0: two tokens at ratio 1.5 each -> sequence ratio 2.25 > 2: dropped whole, though each
    # token alone is inside [1/2, 2]. Row 1: ratios 1.5 and 1/1.5 -> sequence ratio 1: kept.
    up = math.log(1.5)
    terms, grad = two_rows([[up, up], [up, -up]], [[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]],
                           [[True, True], [True, True]], correction="seq_mis", tis_cap=2.0, clip_low=0.9, clip_high=0.9)
    assert grad[0] == [0.0, 0.0]
    assert grad[1] == pytest.approx([-1.5 / 4, -(1 / 1.5) / 4])
    assert terms.masked_out == 2


def test_seq_tis_weights_every_token_of_a_sequence_by_its_truncated_sequence_ratio():
    up = math.log(1.5)
    terms, grad = two_rows([[up, up], [up, -up]], [[0.0, 0.0], [0.0, 0.0]], [[1.0, -1.0], [1.0, 1.0]],
                           [[True, True], [True, True]], correction="seq_tis", tis_cap=2.0)
    # Row 0's sequence ratio 2.25 truncates to 2 on both tokens; row 1's is 1.
    assert grad[0] + grad[1] == pytest.approx([-2.0 / 4, 2.0 / 4, -1.0 / 4, -1.0 / 4])
    assert terms.clipped == 2 and terms.masked_out == 0


def test_cispo_gradient_is_the_clipped_stop_gradient_weight_times_the_advantage_on_every_token():
    # Hand-computed: d/dlogp of -clip(r, lo, hi).detach() * A * logp / N = -clip(r, lo, hi) * A / N.
    # Unlike PPO-clip, the token at ratio 3 (past the bound, positive advantage) keeps a gradient.
    ratios = [3.0, 0.5, 1.0, 0.05]
    adv = [1.0, -2.0, 0.5, 1.0]
    lo, hi = 0.1, 2.0
    terms, grad = loss_of([math.log(r) for r in ratios], [0.0] * 4, adv, [True] * 4, loss="cispo",
                          cispo_min=lo, cispo_max=hi)
    expected = [-min(max(r, lo), hi) * a / 4 for r, a in zip(ratios, adv)]
    assert grad == pytest.approx(expected, rel=1e-6)
    assert terms.clipped == 2  # ratio 3 above hi, 0.05 below lo
    _, ppo = loss_of([math.log(r) for r in ratios], [0.0] * 4, adv, [True] * 4)
    assert ppo[0] == 0.0 and grad[0] != 0.0


def test_cispo_refuses_a_tis_correction_it_already_contains():
    new, old, adv, mask, w = tensors([-1.0], [-1.0], [1.0], [True])
    with pytest.raises(ValueError, match="CISPO"):
        policy_loss(new, old, adv, mask, w, clip_low=0.2, clip_high=0.2, normalizer=1.0, loss="cispo",
                    correction="token_tis", tis_cap=2.0)


def test_mismatch_kl_and_ratio_mean_are_k3_and_r_over_the_trained_tokens():
    gaps = [0.1, -0.2, 0.0]
    terms, _ = loss_of(gaps + [5.0], [0.0] * 4, [1.0] * 4, [True, True, True, False])
    assert terms.ratio_sum == pytest.approx(sum(math.exp(g) for g in gaps), rel=1e-6)
    assert terms.mismatch_kl_sum == pytest.approx(sum(math.exp(g) - 1 - g for g in gaps), rel=1e-5)
    assert terms.mismatch_kl_sum > 0.0
