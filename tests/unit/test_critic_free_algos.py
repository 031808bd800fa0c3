"""Critic-free RL math (group advantages, REINFORCE++ returns, loss aggregation, PPO-loss variants, KL clamp)
against hand-computed values (the arithmetic is in the comments) and invariances."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhfkit.algos import (
    AGGREGATIONS,
    aggregate,
    broadcast_to_tokens,
    compute_gae,
    discounted_returns,
    group_baseline,
    group_filter_mask,
    group_view,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    policy_loss,
    rloo_advantages,
    shape_rewards,
)

NAN = float("nan")


def close(actual, expected, atol=1e-5, rtol=0.0):
    """Compare against hand-computed numbers (given to 6 decimals)."""
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert_close(actual, expected, atol=atol, rtol=rtol)


# Two prompts, n = 4 samples each: a mixed group and a group of equal rewards.
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])


# ---------------------------------------------------------------- group_view


def test_group_view_shape_and_order():
    groups = group_view(SCORES, 4)
    assert groups.shape == (2, 4)
    close(groups[1], [2.0, 2.0, 2.0, 2.0])  # rows [4, 8) are prompt 1


@pytest.mark.parametrize("fn", [group_view, grpo_advantages, rloo_advantages, group_baseline, group_filter_mask])
def test_batch_not_divisible_by_n_raises(fn):
    with pytest.raises(ValueError, match="not divisible by samples per prompt n=4"):
        fn(torch.zeros(6), 4)


def test_group_view_rejects_bad_shapes():
    with pytest.raises(ValueError, match="1-D"):
        group_view(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match=">= 1"):
        group_view(torch.zeros(4), 0)


# ---------------------------------------------------------------- GRPO / Dr.GRPO


def test_grpo_advantages_by_hand():
    # group 0: mean 0.5, deviations +-0.5, unbiased var (4 * 0.25) / 3 = 1/3, std sqrt(1/3) = 0.577350
    #   -> +-0.5 / (0.577350 + 1e-6) = +-0.866024;  group 1: all equal -> 0 / (0 + eps) = 0, not NaN
    adv = grpo_advantages(SCORES, 4)
    close(adv, [0.866024, -0.866024, -0.866024, 0.866024, 0.0, 0.0, 0.0, 0.0])
    assert torch.isfinite(adv).all()


def test_grpo_uses_unbiased_std():
    # n = 2, scores (0, 2): mean 1, unbiased std sqrt((1 + 1) / 1) = sqrt(2) -> +-1/sqrt(2) = +-0.707107
    # (the biased std would be 1 and give +-1)
    close(grpo_advantages(torch.tensor([0.0, 2.0]), 2, eps=0.0), [-0.707107, 0.707107])


def test_dr_grpo_only_centres():
    # Dr.GRPO: r - mean -> group 0: +-0.5, group 1: 0
    adv = grpo_advantages(SCORES, 4, scale_by_std=False)
    close(adv, [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])


def test_grpo_invariant_to_affine_rescaling_and_group_order():
    scores = torch.randn(12, generator=torch.Generator().manual_seed(0))
    adv = grpo_advantages(scores, 3, eps=0.0)
    close(grpo_advantages(5.0 * scores - 7.0, 3, eps=0.0), adv)
    # swapping prompts 0 and 3 swaps their advantages
    perm = torch.tensor([9, 10, 11, 3, 4, 5, 6, 7, 8, 0, 1, 2])
    close(grpo_advantages(scores[perm], 3, eps=0.0), adv[perm])
    close(group_view(adv, 3).sum(dim=1), torch.zeros(4))


def test_grpo_accepts_bool_scores():
    # verifier rewards: (True, False) -> (1, 0): mean 0.5, unbiased std sqrt(0.5) = 0.707107 -> +-0.707107
    adv = grpo_advantages(torch.tensor([True, False]), 2, eps=0.0)
    assert adv.is_floating_point()
    close(adv, [0.707107, -0.707107])


def test_group_advantages_carry_no_gradient():
    scores = SCORES.clone().requires_grad_(True)
    assert not grpo_advantages(scores, 4).requires_grad
    assert not rloo_advantages(scores, 4).requires_grad
    assert not group_baseline(scores, 4).requires_grad


@pytest.mark.parametrize("fn,name", [(grpo_advantages, "grpo"), (rloo_advantages, "rloo")])
def test_one_sample_per_prompt_raises(fn, name):
    with pytest.raises(ValueError, match=f"{name} needs at least 2 samples per prompt"):
        fn(torch.tensor([1.0, 0.0]), 1)


# ---------------------------------------------------------------- RLOO and the plain group baseline


def test_rloo_by_hand():
    # leave-one-out: r0 = 1 vs mean(0, 0, 1) = 1/3 -> 2/3;  r1 = 0 vs mean(1, 0, 1) = 2/3 -> -2/3
    # closed form 4/3 * (r - 0.5) = +-2/3;  equal group -> 0
    adv = rloo_advantages(SCORES, 4)
    close(adv, [0.666667, -0.666667, -0.666667, 0.666667, 0.0, 0.0, 0.0, 0.0])


def test_rloo_matches_explicit_leave_one_out_loop():
    scores = torch.randn(10, generator=torch.Generator().manual_seed(1))
    n = 5
    expected = torch.empty(10)
    for i in range(10):
        g = i // n
        others = [scores[j] for j in range(g * n, (g + 1) * n) if j != i]
        expected[i] = scores[i] - torch.stack(others).mean()
    close(rloo_advantages(scores, n), expected)


def test_group_baseline_by_hand():
    close(group_baseline(SCORES, 4), [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    # n = 1: every sample is its own mean
    close(group_baseline(torch.tensor([3.0, -1.0]), 1), [0.0, 0.0])


# ---------------------------------------------------------------- DAPO dynamic-sampling filter


def test_group_filter_mask_drops_equal_groups():
    keep = group_filter_mask(SCORES, 4)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True] * 4 + [False] * 4


def test_group_filter_mask_atol():
    scores = torch.tensor([1.0, 1.05, 0.0, 1.0])
    # spreads 0.05 and 1.0: exact comparison keeps both; atol 0.1 drops the first group
    assert group_filter_mask(scores, 2).tolist() == [True, True, True, True]
    assert group_filter_mask(scores, 2, atol=0.1).tolist() == [False, False, True, True]


# ---------------------------------------------------------------- broadcast_to_tokens


def test_broadcast_to_tokens_with_arbitrary_mask():
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    close(out, [[2.0, 2.0, 0.0], [-1.0, 0.0, -1.0]])
    assert out.dtype == torch.float32


# ---------------------------------------------------------------- discounted returns (REINFORCE++)


def test_discounted_returns_gamma_one_and_half():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # gamma 1: suffix sums 6, 5, 3; padded position 0
    close(discounted_returns(rewards, mask, 1.0), [[6.0, 5.0, 3.0, 0.0]])
    # gamma 0.5: G2 = 3, G1 = 2 + 0.5 * 3 = 3.5, G0 = 1 + 0.5 * 3.5 = 2.75
    close(discounted_returns(rewards, mask, 0.5), [[2.75, 3.5, 3.0, 0.0]])


def test_discounted_returns_hole_is_transparent_and_nan_ignored():
    rewards = torch.tensor([[1.0, NAN, 2.0, 4.0, NAN]])
    mask = torch.tensor([[1, 0, 1, 1, 0]])
    # valid tokens (1, 2, 4), gamma 0.5: G = 4, 2 + 2 = 4, hole passes 4 through, 1 + 0.5 * 4 = 3
    out = discounted_returns(rewards, mask, 0.5)
    close(out, [[3.0, 0.0, 4.0, 4.0, 0.0]])
    close(discounted_returns(torch.tensor([[1.0, 2.0, 4.0]]), torch.ones(1, 3), 0.5), [[3.0, 4.0, 4.0]])


def test_discounted_returns_equal_gae_with_zero_values_and_lambda_one():
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(4, 7, generator=g)
    mask = torch.rand(4, 7, generator=g) > 0.3
    advantages, _ = compute_gae(rewards, torch.zeros(4, 7), mask, gamma=0.9, lam=1.0)
    close(discounted_returns(rewards, mask, 0.9), advantages)


def test_discounted_returns_left_and_right_padding_agree():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    pad = torch.tensor([[7.0, 7.0]])
    right = discounted_returns(torch.cat([rewards, pad], 1), torch.tensor([[1, 1, 1, 0, 0]]), 0.5)
    left = discounted_returns(torch.cat([pad, rewards], 1), torch.tensor([[0, 0, 1, 1, 1]]), 0.5)
    close(right[:, :3], left[:, 2:])
    assert not right.requires_grad


def test_reinforce_pp_returns_pipeline():
    # reward = -0.5 * kl per token + score 2 on the last valid token: (-0.05, -0.1, 2 - 0.15 = 1.85)
    # gamma 1 returns: 1.85, 1.75, 1.7
    kl = torch.tensor([[0.1, 0.2, 0.3, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]])
    rewards = shape_rewards(torch.tensor([2.0]), kl, mask, kl_coef=0.5)
    close(discounted_returns(rewards, mask, 1.0), [[1.7, 1.75, 1.85, 0.0]])


# ---------------------------------------------------------------- aggregate

LOSS_MAT = torch.tensor([[1.0, 2.0, NAN], [4.0, NAN, NAN]])
AGG_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
# valid: row 0 (1, 2), row 1 (4)
AGG_EXPECTED = {
    "token-mean": 7.0 / 3.0,  # (1 + 2 + 4) / 3 = 2.333333
    "seq-mean-token-mean": 2.75,  # (1.5 + 4) / 2
    "seq-mean-token-sum": 3.5,  # (3 + 4) / 2
    "seq-mean-token-sum-norm": 7.0 / 6.0,  # 7 / (B=2 * max_len=3) = 1.166667
}


def test_aggregations_tuple():
    assert AGGREGATIONS == tuple(AGG_EXPECTED)


@pytest.mark.parametrize("mode", list(AGG_EXPECTED))
def test_aggregate_by_hand_ignoring_nan(mode):
    loss_mat = LOSS_MAT.clone().requires_grad_(True)
    out = aggregate(loss_mat, AGG_MASK, mode, max_len=3)
    assert out.shape == ()
    assert out.item() == pytest.approx(AGG_EXPECTED[mode])
    out.backward()
    assert torch.isfinite(loss_mat.grad).all()
    assert (loss_mat.grad[~AGG_MASK.bool()] == 0).all()


def test_aggregate_gradients_weight_tokens_by_hand():
    loss_mat = LOSS_MAT.clone().requires_grad_(True)
    grads = {}
    for mode in AGGREGATIONS:
        loss_mat.grad = None
        aggregate(loss_mat, AGG_MASK, mode, max_len=3).backward()
        grads[mode] = loss_mat.grad.clone()
    close(grads["token-mean"], [[1 / 3, 1 / 3, 0.0], [1 / 3, 0.0, 0.0]])
    close(grads["seq-mean-token-mean"], [[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]])  # 1/2 per row, split per token
    close(grads["seq-mean-token-sum"], [[0.5, 0.5, 0.0], [0.5, 0.0, 0.0]])
    close(grads["seq-mean-token-sum-norm"], [[1 / 6, 1 / 6, 0.0], [1 / 6, 0.0, 0.0]])


def test_aggregate_empty_row():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert aggregate(loss_mat, mask, "token-mean").item() == pytest.approx(1.5)
    assert aggregate(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx(1.5)  # empty row excluded
    # a row with no valid token was left out of the update: not counted among the rows
    assert aggregate(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx(3.0)  # 3 / 1 row
    assert aggregate(loss_mat, mask, "seq-mean-token-sum-norm", max_len=3).item() == pytest.approx(1.0)  # 3 / (1 x 3)
    for mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert aggregate(loss_mat, torch.zeros(2, 3), mode, max_len=3).item() == 0.0
    assert aggregate(loss_mat, torch.zeros(2, 3), "seq-mean-token-mean").item() == 0.0


def test_aggregate_errors():
    with pytest.raises(ValueError, match="needs a positive max_len"):
        aggregate(LOSS_MAT, AGG_MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'.*seq-mean-token-sum-norm"):
        aggregate(LOSS_MAT, AGG_MASK, "sum")


# ---------------------------------------------------------------- policy_loss: defaults are plain PPO


def _old_policy_loss(logp, old_logp, advantages, mask, clip_eps=0.2):
    """Independent reference for the pre-existing behaviour: symmetric clip, token mean, k2 approx_kl."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    clip_fraction = masked_mean((clipped > unclipped).float(), mask).item()
    return loss, {"clip_fraction": clip_fraction, "approx_kl": masked_mean(0.5 * log_ratio**2, mask).item()}


def test_default_policy_loss_equals_old_behaviour_on_random_inputs():
    g = torch.Generator().manual_seed(3)
    for clip_eps in (0.1, 0.2):
        old_logp = -torch.rand(5, 9, generator=g) * 3
        logp = (old_logp + 0.4 * torch.randn(5, 9, generator=g)).requires_grad_(True)
        advantages = torch.randn(5, 9, generator=g)
        mask = (torch.rand(5, 9, generator=g) > 0.25).float()
        loss, stats = policy_loss(logp, old_logp, advantages, mask, clip_eps)
        (grad,) = torch.autograd.grad(loss, logp)
        ref_loss, ref_stats = _old_policy_loss(logp, old_logp, advantages, mask, clip_eps)
        (ref_grad,) = torch.autograd.grad(ref_loss, logp)
        assert_close(loss, ref_loss)
        assert_close(grad, ref_grad)
        assert set(stats) == {"clip_fraction", "approx_kl"}
        assert stats["clip_fraction"] == pytest.approx(ref_stats["clip_fraction"])
        assert stats["approx_kl"] == pytest.approx(ref_stats["approx_kl"])
        assert 0.0 < stats["clip_fraction"] < 1.0  # the random case does exercise the clip


@pytest.mark.parametrize("mode", list(AGG_EXPECTED))
def test_policy_loss_aggregation(mode):
    # ratio 1 (logp == old_logp): the per-token loss is -A, here the LOSS_MAT values
    old = torch.zeros(2, 3)
    loss, _ = policy_loss(old, old, -LOSS_MAT, AGG_MASK, aggregation=mode, max_len=3)
    assert loss.item() == pytest.approx(AGG_EXPECTED[mode])


def _logp_with_ratios(ratios):
    old_logp = torch.full_like(ratios, -1.0)
    return (old_logp + torch.log(ratios)).requires_grad_(True), old_logp


# ---------------------------------------------------------------- DAPO clip-higher


def test_asymmetric_clip_values():
    logp, old_logp = _logp_with_ratios(torch.tensor([[1.25, 1.5, 0.7]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    # bounds [0.8, 1.28]: 1.25 inside -> -1.25 (not clipped); 1.5 -> -1.28 (clipped); A<0, 0.7 -> max(0.7, 0.8) = 0.8
    # mean (-1.25 - 1.28 + 0.8) / 3 = -0.576667, clip_fraction 2/3
    loss, stats = policy_loss(logp, old_logp, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    close(loss, -0.576667)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    # gradient d(-A r)/dlogp / 3 = -1.25 / 3 only on the unclipped token
    loss.backward()
    close(logp.grad, [[-0.416667, 0.0, 0.0]])
    # symmetric 0.2: 1.25 is clipped too -> (-1.2 - 1.2 + 0.8) / 3 = -0.533333, clip_fraction 1
    loss, stats = policy_loss(logp, old_logp, adv, mask, clip_eps=0.2)
    close(loss, -0.533333)
    assert stats["clip_fraction"] == pytest.approx(1.0)


# ---------------------------------------------------------------- dual-clip


def test_dual_clip_caps_negative_advantages():
    logp, old_logp = _logp_with_ratios(torch.tensor([[5.0, 1.0, 5.0, 2.5]]))
    adv = torch.tensor([[-1.0, -2.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    # per token max(-A r, -A clip(r, 0.8, 1.2)), then for A < 0 min(., -3 A):
    #   A=-1, r=5:   max(5, 1.2) = 5 -> capped at 3
    #   A=-2, r=1:   2 (cap 6, inactive)
    #   A=+1, r=5:   max(-5, -1.2) = -1.2 (clipped; the cap does not apply to A > 0)
    #   A=-1, r=2.5: 2.5 (cap 3, inactive)
    # mean (3 + 2 - 1.2 + 2.5) / 4 = 1.575; dual_clip_fraction 1/4, clip_fraction 1/4
    loss, stats = policy_loss(logp, old_logp, adv, mask, dual_clip=3.0)
    close(loss, 1.575)
    assert stats["dual_clip_fraction"] == pytest.approx(0.25)
    assert stats["clip_fraction"] == pytest.approx(0.25)
    # gradient -A r / 4 on live tokens: 2 * 1 / 4 = 0.5 and 2.5 / 4 = 0.625; capped and clipped tokens 0
    loss.backward()
    close(logp.grad, [[0.0, 0.5, 0.0, 0.625]])
    # without the dual clip the first token is 5: (5 + 2 - 1.2 + 2.5) / 4 = 2.075
    loss, stats = policy_loss(logp, old_logp, adv, mask)
    close(loss, 2.075)
    assert "dual_clip_fraction" not in stats


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_must_exceed_one(c):
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), dual_clip=c)


# ---------------------------------------------------------------- GSPO sequence-level ratio


def _gspo_case():
    # log-ratios: row 0 (0.1, -0.3, 0.5) -> mean 0.1; row 1 (0.2, 0.4, masked NaN) -> mean 0.3
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, NAN]])
    log_ratio = torch.tensor([[0.1, -0.3, 0.5], [0.2, 0.4, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return (old_logp + log_ratio).requires_grad_(True), old_logp, mask


def test_gspo_ratio_is_exp_of_mean_log_ratio_per_row():
    logp, old_logp, mask = _gspo_case()
    # A = -1 and ratios inside [0.8, 1.2] on row 0 / above on row 1: the per-token loss is the ratio itself,
    # so seq-mean-token-mean over one row is s_i: exp(0.1) = 1.105171, exp(0.3) = 1.349859
    for row, expected in ((0, 1.105171), (1, 1.349859)):
        loss, _ = policy_loss(logp[row:row + 1], old_logp[row:row + 1], -torch.ones(1, 3), mask[row:row + 1],
                              ratio_level="sequence", aggregation="seq-mean-token-mean")
        close(loss, expected)


def test_gspo_value_and_gradient_by_hand():
    logp, old_logp, mask = _gspo_case()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, NAN]])
    # row 0: A = +1, s = 1.105171 inside the clip -> -1.105171 per token
    # row 1: A = -1, s = 1.349859 -> max(1.349859, 1.2) = 1.349859 (unclipped) per token
    # token mean over 5: (3 * -1.105171 + 2 * 1.349859) / 5 = -0.123159
    loss, stats = policy_loss(logp, old_logp, adv, mask, ratio_level="sequence")
    close(loss, -0.123159)
    assert stats["clip_fraction"] == 0.0
    # per token s_i * exp(logp_t - sg logp_t): d/dlogp_t = -A_i * s_i / 5, the same for every token of a row
    # (token-level PPO would give -A r_t / 5 instead): row 0 -1.105171 / 5 = -0.221034, row 1 +0.269972
    loss.backward()
    close(logp.grad, [[-0.221034, -0.221034, -0.221034], [0.269972, 0.269972, 0.0]])


def test_gspo_clipped_row_has_zero_gradient():
    logp, old_logp, mask = _gspo_case()
    # A = +1 on row 1: s = 1.349859 > 1.2 -> -1.2 per token (clipped), no gradient; row 0 as above
    adv = torch.ones(2, 3)
    loss, stats = policy_loss(logp, old_logp, adv, mask, ratio_level="sequence")
    close(loss, (3 * -1.105171 + 2 * -1.2) / 5)
    assert stats["clip_fraction"] == pytest.approx(2 / 5)
    loss.backward()
    close(logp.grad, [[-0.221034, -0.221034, -0.221034], [0.0, 0.0, 0.0]])


def test_gspo_equals_token_level_when_ratios_are_constant_per_row():
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])
    logp = (old_logp + torch.tensor([[0.15], [-0.1]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -0.5, 2.0], [-1.0, 0.3, 0.7]])
    mask = torch.ones(2, 3)
    seq, _ = policy_loss(logp, old_logp, adv, mask, ratio_level="sequence")
    (seq_grad,) = torch.autograd.grad(seq, logp)
    tok, _ = policy_loss(logp, old_logp, adv, mask)
    (tok_grad,) = torch.autograd.grad(tok, logp)
    assert_close(seq, tok)
    assert_close(seq_grad, tok_grad)


def test_unknown_ratio_level_raises():
    with pytest.raises(ValueError, match="unknown ratio_level 'row'"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), ratio_level="row")


# ---------------------------------------------------------------- masked garbage never leaks


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("mode", list(AGG_EXPECTED))
def test_policy_loss_nan_at_masked_positions(ratio_level, mode):
    g = torch.Generator().manual_seed(4)
    old_logp = -torch.rand(3, 5, generator=g)
    logp = old_logp + 0.3 * torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1]])
    kwargs = dict(ratio_level=ratio_level, aggregation=mode, max_len=5, dual_clip=3.0, clip_eps_high=0.3)

    clean_logp = logp.clone().requires_grad_(True)
    clean, clean_stats = policy_loss(clean_logp, old_logp, adv, mask, **kwargs)
    clean.backward()

    hole = ~mask.bool()
    dirty_logp = logp.masked_fill(hole, NAN).requires_grad_(True)
    dirty, dirty_stats = policy_loss(dirty_logp, old_logp.masked_fill(hole, NAN), adv.masked_fill(hole, NAN), mask,
                                     **kwargs)
    dirty.backward()

    assert_close(dirty, clean)
    assert dirty_stats == pytest.approx(clean_stats)
    assert_close(dirty_logp.grad, clean_logp.grad)
    assert (dirty_logp.grad[hole] == 0).all()


# ---------------------------------------------------------------- log-ratio clamp


def test_log_ratio_clamp_token_level():
    old_logp = torch.tensor([[-120.0, -1.0]])
    logp = (old_logp + torch.tensor([[100.0, math.log(1.1)]])).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0]])
    mask = torch.ones(1, 2)
    # unclamped, exp(100) overflows float32 to inf
    loss, _ = policy_loss(logp, old_logp, adv, mask)
    assert loss.item() == math.inf
    # clamped at 20: per token max(exp(20), 1.2) = exp(20) = 4.851652e8 and max(1.1, 1.1) = 1.1 -> mean / 2
    loss, _ = policy_loss(logp, old_logp, adv, mask, log_ratio_clamp=20.0)
    assert loss.item() == pytest.approx((math.exp(20.0) + 1.1) / 2, rel=1e-6)
    # the clamp stops the gradient of the clamped token; the other gets -A r / 2 = 0.55
    loss.backward()
    close(logp.grad, [[0.0, 0.55]])


def test_log_ratio_clamp_sequence_level():
    old_logp = torch.zeros(1, 2)
    logp = torch.tensor([[40.0, 20.0]])  # sequence log-ratio mean 30 -> clamped to 2 below
    loss, _ = policy_loss(logp, old_logp, -torch.ones(1, 2), torch.ones(1, 2), ratio_level="sequence",
                          log_ratio_clamp=2.0)
    close(loss, math.exp(2.0))  # 7.389056 on both tokens
    with pytest.raises(ValueError, match="log_ratio_clamp must be > 0"):
        policy_loss(logp, old_logp, torch.ones(1, 2), torch.ones(1, 2), log_ratio_clamp=0.0)


# ---------------------------------------------------------------- KL clamp


def test_kl_penalty_k3_clamp():
    logp = torch.zeros(1, 3)
    ref = torch.tensor([[math.log(2.0), 15.0, 0.0]])
    # k3 = exp(ref - logp) - 1 - (ref - logp): 2 - 1 - ln 2 = 0.306853; exp(15) - 16 = 3269001.37; 0
    close(kl_penalty(logp, ref, "k3"), [[0.306853, 3269001.372, 0.0]], rtol=1e-6)  # float32 at 3e6
    close(kl_penalty(logp, ref, "k3", clamp=10.0), [[0.306853, 10.0, 0.0]])
    # None is the old behaviour
    assert_close(kl_penalty(logp, ref, "k3", clamp=None), kl_penalty(logp, ref, "k3"))


def test_kl_penalty_clamp_is_symmetric_and_validated():
    # k1 = logp - ref can be negative: -15 -> -10
    close(kl_penalty(torch.zeros(1, 1), torch.tensor([[15.0]]), "k1", clamp=10.0), [[-10.0]])
    with pytest.raises(ValueError, match="KL clamp must be > 0"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k3", clamp=0.0)
