"""rlhfkit.algos against hand-computed values (the arithmetic is in the comments) and invariances."""

import math

import pytest
import torch

from rlhfkit.algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    compute_gae,
    entropy_from_logits,
    kl_penalty,
    last_valid_index,
    lm_loss_sum,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    pairwise_loss,
    policy_loss,
    shape_rewards,
    token_logprobs,
    value_loss,
)

LN2 = math.log(2.0)


def close(actual, expected, atol=1e-5):
    """Compare against hand-computed numbers (given to 6 decimals)."""
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# ---------------------------------------------------------------- masked reductions


def test_masked_sum_mean_with_dim_and_garbage():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    # all: 1 + 2 + 4 + 6 = 13 over 4 valid -> 3.25; rows: (1+2)/2 = 1.5, (4+6)/2 = 5
    close(masked_sum(x, mask), 13.0)
    close(masked_mean(x, mask), 3.25)
    close(masked_mean(x, mask, dim=1), [1.5, 5.0])
    close(masked_sum(x, mask.bool(), dim=0), [5.0, 2.0, 6.0])


def test_masked_mean_of_nothing_is_zero():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    close(masked_mean(x, torch.zeros_like(x)), 0.0)
    close(masked_mean(x, mask, dim=1), [0.0, 3.0])


def test_masked_var_biased_and_unbiased():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    # mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5 -> unbiased 5/3, biased 5/4
    close(masked_var(x, mask), 5.0 / 3.0)
    close(masked_var(x, mask, unbiased=False), 1.25)


def test_masked_whiten_by_hand():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 55.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    # (x - 2.5) / sqrt(5/3); sqrt(5/3) = 1.290994 -> 1.5 / 1.290994 = 1.161895, 0.5 / 1.290994 = 0.387298
    out = masked_whiten(x, mask, eps=0.0)
    close(out, [-1.161895, -0.387298, 0.387298, 1.161895, 0.0])
    close(masked_mean(out, mask), 0.0)
    close(masked_var(out, mask), 1.0)


def test_masked_whiten_ignores_garbage_and_keeps_mean():
    x = torch.tensor([[1.0, 2.0, 7.0], [3.0, 4.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    garbage = x.clone()
    garbage[:, 2] = float("nan")
    torch.testing.assert_close(masked_whiten(x, mask), masked_whiten(garbage, mask))
    kept = masked_whiten(x, mask, shift_mean=False)
    close(masked_mean(kept, mask), 2.5)  # mean of 1, 2, 3, 4 is added back
    close(masked_var(kept, mask), 1.0)
    close(kept[:, 2], [0.0, 0.0])


# ---------------------------------------------------------------- log-probs


def test_token_logprobs_and_entropy_two_token_vocab():
    # logits (0, ln 3) -> probs (1/4, 3/4); uniform logits -> (1/2, 1/2)
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)], [5.0, 5.0]]])
    labels = torch.tensor([[1, 0, 0]])
    # ln(3/4) = -0.287682, ln(1/4) = -1.386294, ln(1/2) = -0.693147
    close(token_logprobs(logits, labels), [[-0.287682, -1.386294, -LN2]])
    # H = 1/4 * 1.386294 + 3/4 * 0.287682 = 0.346574 + 0.215762 = 0.562335; uniform: ln 2
    close(entropy_from_logits(logits), [[0.562335, 0.562335, LN2]])


def test_token_logprobs_low_precision_matches_float32():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11)
    labels = torch.randint(0, 11, (2, 3))
    low = token_logprobs(logits.bfloat16(), labels)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, token_logprobs(logits.bfloat16().float(), labels))


def test_lm_loss_sum_ignore_index():
    logits = torch.tensor([[[0.0, math.log(3.0)]] * 3])  # (1, 3, 2), probs (1/4, 3/4) everywhere
    labels = torch.tensor([[1, 0, -100]])
    # -ln(3/4) - ln(1/4) = 0.287682 + 1.386294 = 1.673976 over 2 tokens
    nll, n = lm_loss_sum(logits, labels)
    close(nll, 1.673976)
    assert n == 2 and isinstance(n, int)


def test_lm_loss_sum_micro_batches_add_up():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7)
    labels = torch.randint(0, 7, (4, 5))
    labels[0, :3] = -100
    labels[2, 4] = -100
    full_sum, full_n = lm_loss_sum(logits, labels)
    parts = [lm_loss_sum(logits[i : i + 1], labels[i : i + 1]) for i in range(4)]
    close(sum(p[0] for p in parts) / sum(p[1] for p in parts), full_sum / full_n)
    assert full_n == 16


# ---------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    # pi = 1/2, ref = 1/4 on the first token; swapped on the second
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    # k1 = log pi - log ref = +ln2, -ln2
    close(kl_penalty(logp, ref), [[LN2, -LN2]])
    # k2 = 0.5 * (ln 2)^2 = 0.240227 both ways
    close(kl_penalty(logp, ref, "k2"), [[0.240227, 0.240227]])
    # k3 = r - 1 - ln r with r = ref/pi: r=1/2 -> 0.5 - 1 + ln2 = 0.193147; r=2 -> 2 - 1 - ln2 = 0.306853
    close(kl_penalty(logp, ref, "k3"), [[0.193147, 0.306853]])
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}


def test_k3_is_nonnegative():
    torch.manual_seed(0)
    logp, ref = torch.randn(4, 8) * 3, torch.randn(4, 8) * 3
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    close(kl_penalty(logp, logp, "k3"), torch.zeros(4, 8))


def test_unknown_kl_estimator_names_valid_kinds():
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), kind="k4")


@pytest.mark.parametrize(
    "current_kl, expected",
    [
        (7.5, 0.100512),  # 7.5/6 - 1 = 0.25 -> clipped to 0.2; 0.1 * (1 + 0.2 * 256/10000) = 0.1 * 1.00512
        (6.6, 0.100256),  # 6.6/6 - 1 = 0.1;  0.1 * (1 + 0.1 * 0.0256) = 0.1 * 1.00256
        (5.4, 0.099744),  # 5.4/6 - 1 = -0.1; 0.1 * (1 - 0.00256)
        (3.0, 0.099488),  # 3/6 - 1 = -0.5 -> clipped to -0.2; 0.1 * (1 - 0.00512)
    ],
)
def test_adaptive_kl_controller_one_update(current_kl, expected):
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl, n_steps=256)
    close(ctl.value, expected, atol=1e-9)


def test_kl_controllers_fixed_and_state_round_trip():
    """A resumed run keeps the adapted coefficient of an adaptive checkpoint and takes everything the config
    sets from its config: a fixed coefficient, the target and the horizon (changed on a resume, they apply)."""
    fixed = FixedKLController(0.05)
    fixed.update(100.0, n_steps=1000)
    assert fixed.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 1.0

    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(7.5, 256)
    same = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    same.load_state_dict(ctl.state_dict())
    same.update(7.5, 256)
    ctl.update(7.5, 256)
    assert same.value == ctl.value
    changed = AdaptiveKLController(0.5, target=3.0, horizon=1000)
    changed.load_state_dict(ctl.state_dict())
    assert changed.value == ctl.value and (changed.target, changed.horizon) == (3.0, 1000.0)
    changed.update(6.0, 100)  # 6/3 - 1 = 1 -> clipped to 0.2, over the new horizon
    close(changed.value, ctl.value * (1 + 0.2 * 100 / 1000), atol=1e-12)
    started = AdaptiveKLController(0.5, target=3.0, horizon=1000)  # fixed until the resume: from ppo.kl_coef
    started.load_state_dict(fixed.state_dict())
    assert started.value == 0.5


# ---------------------------------------------------------------- GAE


def test_gae_by_hand_gamma1_lam095():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    # deltas: t2: 1 + 0 - 0.7 = 0.3; t1: 0 + 0.7 - 0.6 = 0.1; t0: 0 + 0.6 - 0.5 = 0.1
    # A2 = 0.3; A1 = 0.1 + 0.95 * 0.3 = 0.385; A0 = 0.1 + 0.95 * 0.385 = 0.46575
    adv, ret = compute_gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=0.95)
    close(adv, [[0.46575, 0.385, 0.3]])
    close(ret, [[0.96575, 0.985, 1.0]])  # A + V


def test_gae_lam1_returns_are_discounted_sums():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, -1.0, 2.0]])
    # R2 = 3; R1 = 2 + 0.9 * 3 = 4.7; R0 = 1 + 0.9 * 4.7 = 5.23; A = R - V
    adv, ret = compute_gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=1.0)
    close(ret, [[5.23, 4.7, 3.0]])
    close(adv, [[4.73, 5.7, 1.0]])


def test_gae_ignores_values_and_rewards_after_eos():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask)
    garbage_r, garbage_v = rewards.clone(), values.clone()
    garbage_r[0, 3:] = torch.tensor([5.0, float("nan")])
    garbage_v[0, 3:] = torch.tensor([-7.0, 9.0])
    adv2, ret2 = compute_gae(garbage_r, garbage_v, mask)
    torch.testing.assert_close(adv, adv2)
    torch.testing.assert_close(ret, ret2)
    # same as the unpadded 3-token hand case; zero after EOS
    close(adv, [[0.46575, 0.385, 0.3, 0.0, 0.0]])
    close(ret, [[0.96575, 0.985, 1.0, 0.0, 0.0]])


def test_gae_batched_equals_per_row_loop():
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 6), torch.randn(4, 6)
    lengths = [6, 3, 1, 4]
    mask = torch.tensor([[1.0] * n + [0.0] * (6 - n) for n in lengths])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.99, lam=0.9)
    for i in range(4):
        a_i, r_i = compute_gae(rewards[i : i + 1], values[i : i + 1], mask[i : i + 1], gamma=0.99, lam=0.9)
        torch.testing.assert_close(adv[i : i + 1], a_i)
        torch.testing.assert_close(ret[i : i + 1], r_i)


def test_gae_padding_invariance():
    torch.manual_seed(0)
    rewards, values = torch.randn(1, 4), torch.randn(1, 4)
    adv, ret = compute_gae(rewards, values, torch.ones(1, 4), gamma=0.9, lam=0.8)
    pad = torch.randn(1, 3)
    # right padding: the valid prefix gives the unpadded result
    right = compute_gae(torch.cat([rewards, pad], 1), torch.cat([values, pad], 1),
                        torch.tensor([[1, 1, 1, 1, 0, 0, 0]]), gamma=0.9, lam=0.8)
    torch.testing.assert_close(right[0][:, :4], adv)
    torch.testing.assert_close(right[1][:, :4], ret)
    # left padding: the valid suffix gives the unpadded result too
    left = compute_gae(torch.cat([pad, rewards], 1), torch.cat([pad, values], 1),
                       torch.tensor([[0, 0, 0, 1, 1, 1, 1]]), gamma=0.9, lam=0.8)
    torch.testing.assert_close(left[0][:, 3:], adv)
    close(left[0][:, :3], torch.zeros(1, 3))


# ---------------------------------------------------------------- reward shaping


def test_last_valid_index_padding_sides():
    right = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 1, 1]])
    odd = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [0, 1, 0, 0]])
    assert last_valid_index(right).tolist() == [2, 0, 3]
    assert last_valid_index(left).tolist() == [3, 3, 3]
    assert last_valid_index(odd.bool()).tolist() == [2, 0, 1]
    assert last_valid_index(right).dtype == torch.long


def test_shape_rewards_right_padded_with_clip():
    scores = torch.tensor([2.0, -3.0])
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, -0.5, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # -0.5 * kl on valid tokens; row 0 score on t=2: -0.15 + 2 = 1.85; row 1 on t=1: 0.25 - 3 = -2.75
    close(shape_rewards(scores, kl, mask, kl_coef=0.5), [[-0.05, -0.1, 1.85, 0.0], [-0.25, -2.75, 0.0, 0.0]])
    # clip to +-1: -0.15 + 1 = 0.85; 0.25 - 1 = -0.75
    close(shape_rewards(scores, kl, mask, kl_coef=0.5, score_clip=1.0),
          [[-0.05, -0.1, 0.85, 0.0], [-0.25, -0.75, 0.0, 0.0]])


def test_shape_rewards_left_padded():
    scores = torch.tensor([1.0, 4.0])
    kl = torch.tensor([[9.0, 0.2, 0.4], [9.0, 9.0, 1.0]])
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    # coef 0.1: row 0: [0, -0.02, -0.04 + 1 = 0.96]; row 1: [0, 0, -0.1 + 4 = 3.9]
    close(shape_rewards(scores, kl, mask, kl_coef=0.1), [[0.0, -0.02, 0.96], [0.0, 0.0, 3.9]])


# ---------------------------------------------------------------- losses


def test_pairwise_loss_by_hand():
    # -log sigmoid(2) = log(1 + e^-2) = 0.126928
    close(pairwise_loss(torch.tensor([2.0]), torch.tensor([0.0])), 0.126928)
    # batch: (0.126928 + log 2) / 2 = (0.126928 + 0.693147) / 2 = 0.410038
    close(pairwise_loss(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])), 0.410038)
    # huge negative gap stays finite: -log sigmoid(-1000) ~= 1000
    close(pairwise_loss(torch.tensor([0.0]), torch.tensor([1000.0])), 1000.0, atol=1e-3)


def test_pairwise_loss_margin():
    chosen, rejected = torch.tensor([2.0, 2.0]), torch.tensor([0.0, 0.0])
    # float margin 1: -log sigmoid(1) = log(1 + e^-1) = 0.313262
    close(pairwise_loss(chosen, rejected, margin=1.0), 0.313262)
    # per-pair margins (1, 2): (0.313262 + log 2) / 2 = 0.503204
    close(pairwise_loss(chosen, rejected, margin=torch.tensor([1.0, 2.0])), 0.503204)


def _policy_case():
    # tokens: (A=+1, ratio 1.5) clip hit; (A=+1, ratio 0.5) miss; (A=-1, ratio 1.5) miss; (A=-1, ratio 0.5) hit
    ratio = torch.tensor([[1.5, 0.5, 1.5, 0.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    old_logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    return old_logp + torch.log(ratio), old_logp, adv


def test_policy_loss_clip_hit_and_miss():
    logp, old_logp, adv = _policy_case()
    # per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   max(-1.5, -1.2) = -1.2 (clipped); max(-0.5, -0.8) = -0.5;
    #   max(1.5, 1.2) = 1.5;              max(0.5, 0.8) = 0.8 (clipped)
    # mean = (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.15; clip_fraction = 2/4
    # approx_kl = mean 0.5 (log r)^2 = 0.5 * ((ln 1.5)^2 + (ln 0.5)^2) / 2 = 0.5 * (0.164402 + 0.480453) / 2
    loss, stats = policy_loss(logp, old_logp, adv, torch.ones(1, 4), clip_eps=0.2)
    close(loss, 0.15)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert stats["approx_kl"] == pytest.approx(0.161214, abs=1e-5)
    assert isinstance(stats["clip_fraction"], float) and isinstance(stats["approx_kl"], float)


def test_policy_loss_gradient_zero_where_clipped():
    logp, old_logp, adv = _policy_case()
    logp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old_logp, adv, torch.ones(1, 4))
    loss.backward()
    # unclipped tokens: d/dlogp (-A r) / 4 = -A r / 4 -> -0.5/4 = -0.125 and 1.5/4 = 0.375
    close(logp.grad, [[0.0, -0.125, 0.375, 0.0]])


def test_policy_loss_equal_terms_are_not_clipped():
    # A = 2, ratio 1.1 (inside the clip): both terms -2.2, so clipping is not active
    old = torch.zeros(1, 1)
    loss, stats = policy_loss(old + math.log(1.1), old, torch.tensor([[2.0]]), torch.ones(1, 1))
    close(loss, -2.2)
    assert stats["clip_fraction"] == 0.0


def test_policy_loss_ignores_masked_tokens():
    logp, old_logp, adv = _policy_case()

    def pad(t, v):  # append one masked token holding garbage
        return torch.cat([t, torch.tensor([[v]])], 1)

    loss, stats = policy_loss(pad(logp, 50.0), pad(old_logp, -50.0), pad(adv, 1e6),
                              torch.tensor([[1, 1, 1, 1, 0]]))
    close(loss, 0.15)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert stats["approx_kl"] == pytest.approx(0.161214, abs=1e-5)


def test_value_loss_clipped_and_unclipped():
    old = torch.zeros(1, 4)
    values = torch.tensor([[0.5, 0.1, 0.5, 3.0]])
    returns = torch.tensor([[1.0, 1.0, 0.0, 8.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # eps 0.2 -> v_clip = (0.2, 0.1, 0.2)
    #   t0: (0.5-1)^2 = 0.25 vs (0.2-1)^2 = 0.64 -> 0.64 (clipped term chosen)
    #   t1: 0.81 vs 0.81 -> 0.81 (inside the clip)
    #   t2: (0.5-0)^2 = 0.25 vs 0.04 -> 0.25
    # 0.5 * (0.64 + 0.81 + 0.25) / 3 = 0.283333; clip fraction 1/3
    loss, stats = value_loss(values, old, returns, mask, clip_eps=0.2)
    close(loss, 0.283333)
    assert stats["value_clip_fraction"] == pytest.approx(1 / 3)
    # no clipping: 0.5 * (0.25 + 0.81 + 0.25) / 3 = 0.218333
    loss, stats = value_loss(values, old, returns, mask, clip_eps=None)
    close(loss, 0.218333)
    assert stats["value_clip_fraction"] == 0.0
