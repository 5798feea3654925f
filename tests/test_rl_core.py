"""RL algorithm core: every function against numbers worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from sleuth.rl import advantages as adv_mod
from sleuth.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    gae_advantages,
    get_advantage_fn,
    grpo_advantages,
    outcome_to_token_rewards,
    register_advantage,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from sleuth.rl.dist import DistContext, dist_masked_whiten
from sleuth.rl.losses import (
    LossAgg,
    PolicyClip,
    agg_loss,
    apply_kl_penalty,
    entropy_from_logits,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    value_loss,
)

T = torch.tensor


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.float(), torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0
    )


# --------------------------------------------------------------------------- masked reductions


def test_masked_sum_mean_var_by_hand():
    values = T([[1.0, 2.0, 3.0, 100.0], [4.0, -50.0, 6.0, 7.0]])
    mask = T([[1, 1, 1, 0], [1, 0, 0, 1]])
    # selected: 1, 2, 3, 4, 7 -> sum 17, mean 3.4
    close(masked_sum(values, mask), 17.0)
    close(masked_mean(values, mask), 3.4)
    # per row: row0 1+2+3 = 6 over 3 -> 2; row1 4+7 = 11 over 2 -> 5.5
    close(masked_sum(values, mask, dim=-1), [6.0, 11.0])
    close(masked_mean(values, mask, dim=-1), [2.0, 5.5])
    # deviations -2.4 -1.4 -0.4 0.6 3.6 -> squares 5.76 1.96 0.16 0.36 12.96 = 21.2; /4 = 5.3; /5 = 4.24
    close(masked_var(values, mask), 5.3)
    close(masked_var(values, mask, unbiased=False), 4.24)


def test_masked_mean_of_empty_selection_is_zero_not_nan():
    values = T([[1.0, 2.0]])
    assert masked_mean(values, torch.zeros(1, 2)).item() == 0.0


def test_dist_whiten_of_equal_values_is_real_zero():
    """Equal advantages (every GAE return alike) give a variance a rounding error below 0 in float32 (2.9 x 111:
    sum of squares minus count x mean^2 < 0); it is clamped, so whitening gives zeros, not a complex tensor."""
    values = torch.full((3, 37), 2.9)
    whitened = dist_masked_whiten(values, torch.ones_like(values), DistContext())
    assert whitened.dtype == torch.float32
    assert whitened.abs().max().item() < 0.01


def test_masked_whiten_by_hand_and_zero_at_masked():
    values = T([[1.0, 2.0, 3.0, 99.0]])
    mask = T([[1, 1, 1, 0]], dtype=torch.bool)
    # mean 2, unbiased var ((1)+(0)+(1))/2 = 1 -> (-1, 0, 1), masked -> 0
    close(masked_whiten(values, mask), [[-1.0, 0.0, 1.0, 0.0]])
    # shift_mean=False keeps the mean: (-1, 0, 1) + 2
    close(masked_whiten(values, mask, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]])


def test_shape_mismatch_names_inputs():
    with pytest.raises(ValueError, match="values .* mask"):
        masked_sum(torch.zeros(2, 3), torch.ones(2, 4))


# --------------------------------------------------------------------------- agg_loss

LOSS_MAT = T([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
AGG_MASK = T([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # third row has no token


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        # tokens 1, 2, 3, 5 -> 11 / 4
        ("token-mean", {}, 2.75),
        # mini-batch token count 8 given by the caller -> 11 / 8
        ("token-mean", {"num_tokens": 8}, 1.375),
        # row sums 6 and 5 over the 2 rows that have tokens
        ("seq-mean-token-sum", {}, 5.5),
        # row means 2 and 5 -> 3.5
        ("seq-mean-token-mean", {}, 3.5),
        # row means 2 and 5 over 4 sequences of the mini-batch -> 7 / 4
        ("seq-mean-token-mean", {"num_seqs": 4}, 1.75),
        # row sums / T=4: 1.5 and 1.25 -> 1.375
        ("seq-mean-token-sum-norm", {}, 1.375),
        # row sums / 10: 0.6 and 0.5 -> 0.55
        ("seq-mean-token-sum-norm", {"norm_length": 10}, 0.55),
    ],
)
def test_agg_loss_modes_by_hand(mode, kwargs, expected):
    close(agg_loss(LOSS_MAT, AGG_MASK, mode, **kwargs), expected)


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS_MAT, AGG_MASK, "mean")


# --------------------------------------------------------------------------- policy loss


def _ratios_to_logprobs(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    old = T([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.2, -2.5, -1.0]])
    new = (old + torch.log(T(ratios))).requires_grad_(True)
    return old, new


# Row 0 has advantage +1, row 1 advantage -1.
RATIOS = [[1.1, 1.25, 1.3, 0.7], [0.9, 0.75, 1.5, 4.0]]
ADV = T([[1.0] * 4, [-1.0] * 4])
ONES = torch.ones(2, 4)


def test_policy_loss_clip_higher_by_hand():
    old, new = _ratios_to_logprobs(RATIOS)
    loss, stats = policy_loss(old, new, ADV, ONES, clip=PolicyClip(0.2, 0.28))
    # A>0: 1.1 -> -1.1; 1.25 inside 1.28 -> -1.25; 1.3 clipped to 1.28 -> -1.28;
    #      0.7 below 0.8 but A>0 so max(-0.7, -0.8) = -0.7 (lower clip inactive)
    # A<0: 0.9 -> 0.9; 0.75 clipped to 0.8 -> 0.8; 1.5 above 1.28 but A<0 so max(1.5, 1.28) = 1.5;
    #      4.0 -> 4.0 (no dual clip)
    # sum = -4.33 + 7.2 = 2.87 over 8 tokens
    close(loss, 2.87 / 8)
    assert stats["clipfrac"] == pytest.approx(2 / 8)  # (0,2) and (1,1)
    assert stats["clipfrac_lower"] == 0.0
    assert stats["ratio_max"] == pytest.approx(4.0, rel=1e-5)
    assert stats["ratio_min"] == pytest.approx(0.7, rel=1e-5)
    assert stats["ratio_mean"] == pytest.approx(sum(RATIOS[0] + RATIOS[1]) / 8, rel=1e-5)
    assert stats["approx_kl"] == pytest.approx(-sum(math.log(r) for r in RATIOS[0] + RATIOS[1]) / 8, rel=1e-5)
    k3 = sum(r - 1 - math.log(r) for r in RATIOS[0] + RATIOS[1]) / 8
    assert stats["approx_kl_k3"] == pytest.approx(k3, rel=1e-5)

    loss.backward()
    # d/dlogprob of -A*r is -A*r / 8 on unclipped tokens, 0 where the clipped branch is active
    expected_grad = [[-1.1 / 8, -1.25 / 8, 0.0, -0.7 / 8], [0.9 / 8, 0.0, 1.5 / 8, 4.0 / 8]]
    close(new.grad, expected_grad)


def test_policy_loss_symmetric_clip_by_hand():
    old, new = _ratios_to_logprobs(RATIOS)
    loss, stats = policy_loss(old, new, ADV, ONES, clip=PolicyClip(0.2, 0.2))
    # A>0 row: -1.1, -1.2 (1.25 clipped), -1.2 (1.3 clipped), -0.7 -> -4.2; A<0 row unchanged 7.2
    close(loss, 3.0 / 8)
    assert stats["clipfrac"] == pytest.approx(3 / 8)


def test_policy_loss_dual_clip_by_hand():
    old, new = _ratios_to_logprobs(RATIOS)
    loss, stats = policy_loss(old, new, ADV, ONES, clip=PolicyClip(0.2, 0.28, dual_clip_c=3.0))
    # only (1,3): A=-1, ratio 4 -> min(4.0, 3.0) = 3.0; sum 2.87 - 1.0 = 1.87
    close(loss, 1.87 / 8)
    assert stats["clipfrac_lower"] == pytest.approx(1 / 8)
    loss.backward()
    assert new.grad[1, 3].item() == 0.0  # bounded by a constant -> no gradient
    assert new.grad[1, 2].item() == pytest.approx(1.5 / 8, rel=1e-5)  # A<0, ratio 1.5 < c: untouched


def test_policy_loss_seq_mean_token_mean_by_hand():
    old, new = _ratios_to_logprobs(RATIOS)
    mask = T([[1, 1, 0, 0], [1, 1, 1, 1]])
    loss, _ = policy_loss(old, new, ADV, mask, clip=PolicyClip(0.2, 0.28), agg=LossAgg("seq-mean-token-mean"))
    # row0: (-1.1 - 1.25)/2 = -1.175; row1: 7.2/4 = 1.8; mean = 0.3125
    close(loss, 0.3125)


def test_masked_tokens_have_exactly_zero_gradient_even_with_garbage():
    old = T([[-1.0, -2.0, 0.0, 0.0], [-0.5, 0.0, -1.5, 0.0]])
    new_values = T([[-0.8, -2.3, float("nan"), 50.0], [-0.4, float("-inf"), -1.0, float("inf")]])
    mask = T([[1, 1, 0, 0], [1, 0, 1, 0]])
    advantages = T([[0.5, 0.5, float("nan"), 3.0], [-1.0, 7.0, -1.0, 2.0]])
    new = new_values.clone().requires_grad_(True)
    loss, stats = policy_loss(old, new, advantages, mask, agg=LossAgg("seq-mean-token-mean"))
    loss = loss + kl_loss(new, old, mask, kind="k3")
    loss.backward()
    assert torch.isfinite(loss)
    assert all(math.isfinite(v) for v in stats.values())
    assert (new.grad[mask == 0] == 0).all()
    assert (new.grad[mask == 1] != 0).all()

    # the loss equals the one computed on the selected tokens alone (garbage replaced)
    clean = torch.where(mask == 1, new_values, old)
    ref, _ = policy_loss(
        old, clean, torch.where(mask == 1, advantages, 0.0), mask, agg=LossAgg("seq-mean-token-mean")
    )
    ref = ref + kl_loss(clean, old, mask, kind="k3")
    close(loss.detach(), ref.item())


def test_policy_loss_rejects_bad_clip():
    old, new = _ratios_to_logprobs(RATIOS)
    with pytest.raises(ValueError, match="dual_clip_c"):
        policy_loss(old, new, ADV, ONES, clip=PolicyClip(dual_clip_c=1.0))
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(old, new, ADV, ONES, clip=PolicyClip(clip_low=1.5))


# --------------------------------------------------------------------------- value loss

V_NEW = T([[1.0, 0.6, 0.0, 2.0], [0.9, 0.1, 5.0, 5.0]])
V_OLD = T([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.0, 0.0]])
V_RET = T([[1.0, 1.0, 1.0, 0.0], [0.0, 0.1, 0.0, 0.0]])
V_MASK = T([[1, 1, 1, 1], [1, 1, 0, 0]])


def test_value_loss_clipped_by_hand():
    values = V_NEW.clone().requires_grad_(True)
    loss, stats = value_loss(values, V_OLD, V_RET, V_MASK, clip=0.2)
    # (v, v_old, R): unclipped (v-R)^2 | v_clip = clamp(v, v_old +- 0.2) | clipped err | max
    # (1.0, 0.5, 1.0): 0     | 0.7 | 0.09 | 0.09 (clip active)
    # (0.6, 0.5, 1.0): 0.16  | 0.6 | 0.16 | 0.16
    # (0.0, 0.5, 1.0): 1.0   | 0.3 | 0.49 | 1.0
    # (2.0, 0.5, 0.0): 4.0   | 0.7 | 0.49 | 4.0
    # (0.9, 0.5, 0.0): 0.81  | 0.7 | 0.49 | 0.81
    # (0.1, 0.5, 0.1): 0     | 0.3 | 0.04 | 0.04 (clip active)
    # 0.5 * 6.1 / 6
    close(loss, 0.5 * 6.1 / 6)
    assert stats["vf_clipfrac"] == pytest.approx(2 / 6)
    assert stats["vf_error"] == pytest.approx(5.97 / 6, rel=1e-5)
    loss.backward()
    # gradient of 0.5*(v-R)^2/6 is (v-R)/6 where unclipped wins, 0 where the clipped value wins
    close(values.grad, [[0.0, -0.4 / 6, -1.0 / 6, 2.0 / 6], [0.9 / 6, 0.0, 0.0, 0.0]])


def test_value_loss_without_clip_by_hand():
    loss, stats = value_loss(V_NEW, V_OLD, V_RET, V_MASK, clip=None)
    # 0.5 * (0 + 0.16 + 1 + 4 + 0.81 + 0) / 6
    close(loss, 0.5 * 5.97 / 6)
    assert stats["vf_clipfrac"] == 0.0


# --------------------------------------------------------------------------- KL

LP = T([[-1.0, -2.0, -0.3, -4.0], [-0.1, -3.0, -2.0, -1.0]])
REF = T([[-1.5, -1.0, -0.3, -2.0], [-0.2, -3.5, -1.0, -6.0]])


@pytest.mark.parametrize(
    ("kind", "formula"),
    [
        ("k1", lambda d: d),
        ("kl", lambda d: d),
        ("abs", lambda d: abs(d)),
        ("k2", lambda d: 0.5 * d * d),
        ("mse", lambda d: 0.5 * d * d),
        ("k3", lambda d: math.exp(-d) + d - 1),
        ("low_var_kl", lambda d: math.exp(-d) + d - 1),
    ],
)
def test_kl_estimators_match_direct_formula(kind, formula):
    got = kl_penalty(LP, REF, kind)
    expected = [
        [formula(a - b) for a, b in zip(ra, rb, strict=True)]
        for ra, rb in zip(LP.tolist(), REF.tolist(), strict=True)
    ]
    close(got, expected)


def test_k3_non_negative_and_clamped():
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(64, 32, generator=gen) * 3
    ref = torch.randn(64, 32, generator=gen) * 3
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    # d = logprob - ref = -30: exp(30) - 30 - 1 would overflow usefulness; verl clamps to 10
    assert kl_penalty(T([[-30.0]]), T([[0.0]]), "k3").item() == 10.0


def test_straight_through_kl_value_of_k3_gradient_of_k2():
    lp = LP.clone().requires_grad_(True)
    value = kl_penalty(lp, REF, "k3+")
    close(value.detach(), kl_penalty(LP, REF, "k3"))
    value.sum().backward()
    close(lp.grad, LP - REF)  # d/dlp 0.5 (lp - ref)^2


def test_kl_unknown_estimator():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LP, REF, "k4")


def test_apply_kl_penalty_by_hand():
    rewards = T([[0.0, 0.0, 1.0, 0.0]])
    kl = T([[0.1, 0.2, 0.3, 0.4]])
    mask = T([[1, 0, 1, 1]])
    # 0 - 0.5*0.1; masked: 0; 1 - 0.5*0.3; 0 - 0.5*0.4
    close(apply_kl_penalty(rewards, kl, 0.5, mask), [[-0.05, 0.0, 0.85, -0.2]])


def test_kl_loss_token_mean_by_hand():
    mask = T([[1, 1, 0, 0], [0, 0, 0, 1]])
    # k1 on selected: 0.5, -1.0, 5.0 -> 4.5 / 3
    close(kl_loss(LP, REF, mask, kind="k1"), 1.5)


# --------------------------------------------------------------------------- logits helpers


def test_entropy_and_logprobs_by_hand():
    probs = T([[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]])
    logits = torch.log(probs) + 3.0  # a constant shift changes nothing
    # H = 0.5 ln2 + 2 * 0.25 ln4 = 1.5 ln2; uniform over 3 -> ln3
    close(entropy_from_logits(logits), [1.5 * math.log(2), math.log(3)])
    close(logprobs_from_logits(logits, T([1, 0])), [math.log(0.25), math.log(1 / 3)])


def test_logprobs_match_log_softmax_in_chunks_and_bf16():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    reference = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    close(logprobs_from_logits(logits, labels), reference)
    close(logprobs_from_logits(logits, labels, chunk_rows=4), reference)
    ref_entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    close(entropy_from_logits(logits, chunk_rows=2), ref_entropy)
    out_bf16 = logprobs_from_logits(logits.bfloat16(), labels)
    assert out_bf16.dtype == torch.float32
    close(out_bf16, reference, atol=5e-2)

    leaf = logits.clone().requires_grad_(True)
    logprobs_from_logits(leaf, labels, chunk_rows=4).sum().backward()
    # d/dz log softmax(z)[y] = onehot(y) - softmax(z)
    expected = torch.nn.functional.one_hot(labels, 11).float() - torch.softmax(logits, -1)
    close(leaf.grad, expected)


def test_logprobs_reject_padding_labels():
    with pytest.raises(ValueError, match="padding"):
        logprobs_from_logits(torch.zeros(1, 2, 4), T([[1, -100]]))


# --------------------------------------------------------------------------- GAE


def test_gae_with_observation_hole_by_hand():
    gamma, lam = 0.9, 0.8
    # row 0: policy, OBSERVATION, policy, policy; reward 1 at the end
    # row 1: policy x3, padding; reward 2 on the last policy token
    mask = T([[1, 0, 1, 1], [1, 1, 1, 0]])
    rewards = T([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 2.0, 0.0]])
    values = T([[0.5, 9.0, 0.2, 0.4], [1.0, 0.5, 1.5, 7.0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    # row 0 (gamma*lam = 0.72):
    #   t3: delta = 1 - 0.4 = 0.6                  A3 = 0.6
    #   t2: delta = 0.9*0.4 - 0.2 = 0.16           A2 = 0.16 + 0.72*0.6 = 0.592
    #   t1: observation, skipped (its value 9.0 is never used)
    #   t0: next state is t2: delta = 0.9*0.2 - 0.5 = -0.32   A0 = -0.32 + 0.72*0.592 = 0.10624
    # row 1:
    #   t2: delta = 2 - 1.5 = 0.5                  A2 = 0.5
    #   t1: delta = 0.9*1.5 - 0.5 = 0.85           A1 = 0.85 + 0.72*0.5 = 1.21
    #   t0: delta = 0.9*0.5 - 1.0 = -0.55          A0 = -0.55 + 0.72*1.21 = 0.3212
    close(adv, [[0.10624, 0.0, 0.592, 0.6], [0.3212, 1.21, 0.5, 0.0]])
    # returns = A + V on policy tokens
    close(ret, [[0.60624, 0.0, 0.792, 1.0], [1.3212, 1.71, 2.0, 0.0]])

    # the value predicted at the observation token does not matter
    values2 = values.clone()
    values2[0, 1] = -123.0
    adv2, _ = gae_advantages(rewards, values2, mask, gamma=gamma, lam=lam, whiten=False)
    close(adv2, adv)


def _textbook_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_v = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * next_v - values[t] + gamma * lam * running
        out[t] = running
    return out


def test_gae_equals_textbook_gae_on_policy_tokens_only():
    gen = torch.Generator().manual_seed(2)
    mask = (torch.rand(6, 12, generator=gen) > 0.35).long()
    mask[:, 0] = 1
    rewards = torch.randn(6, 12, generator=gen) * mask
    values = torch.randn(6, 12, generator=gen)
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.7, whiten=False)
    for row in range(6):
        keep = mask[row].bool()
        expected = _textbook_gae(rewards[row][keep].tolist(), values[row][keep].tolist(), 0.95, 0.7)
        close(adv[row][keep], expected)
        assert (adv[row][~keep] == 0).all()


def test_gae_whitened_and_rejects_reward_on_masked_token():
    mask = T([[1, 0, 1, 1], [1, 1, 1, 0]])
    rewards = T([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 2.0, 0.0]])
    values = T([[0.5, 9.0, 0.2, 0.4], [1.0, 0.5, 1.5, 7.0]])
    raw, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    white, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=True)
    close(white, masked_whiten(raw, mask))
    assert masked_mean(white, mask).abs() < 1e-6
    bad = rewards.clone()
    bad[0, 1] = 1.0
    with pytest.raises(ValueError, match="masked positions"):
        gae_advantages(bad, values, mask)


# --------------------------------------------------------------------------- group estimators

SCORES = T([1.0, 0.0, 0.0, 5.0])
GROUPS = ["p", "p", "p", "q"]  # q has a single sample
GMASK = T([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])


def test_grpo_with_std_by_hand():
    adv, ret = grpo_advantages(SCORES, GROUPS, GMASK)
    # group p: mean 1/3, deviations 2/3, -1/3, -1/3; unbiased var (4/9+1/9+1/9)/2 = 1/3; std 0.577350
    # -> 1.154700, -0.577350, -0.577350; single-sample group q -> 0
    hi, lo = (2 / 3) / math.sqrt(1 / 3), (-1 / 3) / math.sqrt(1 / 3)
    close(adv, [[hi, hi, 0.0], [lo, 0.0, 0.0], [lo, lo, lo], [0.0, 0.0, 0.0]], atol=1e-5)
    assert ret is adv


def test_drgrpo_without_std_by_hand():
    adv, _ = grpo_advantages(SCORES, GROUPS, GMASK, norm_by_std=False)
    close(adv, [[2 / 3, 2 / 3, 0.0], [-1 / 3, 0.0, 0.0], [-1 / 3, -1 / 3, -1 / 3], [0.0, 0.0, 0.0]])
    close(get_advantage_fn("drgrpo")(SCORES, GROUPS, GMASK)[0], adv)


def test_grpo_zero_variance_group_gives_zero_and_tensor_group_ids():
    adv, _ = grpo_advantages(T([1.0, 1.0, 0.0, 1.0]), T([7, 7, 3, 3]), torch.ones(4, 2))
    # group 7 all equal -> 0; group 3: mean 0.5, std sqrt(0.5) -> -0.707107, 0.707107
    s = 0.5 / math.sqrt(0.5)
    close(adv, [[0, 0], [0, 0], [-s, -s], [s, s]], atol=1e-5)


def test_rloo_by_hand():
    adv, _ = rloo_advantages(SCORES, GROUPS, GMASK)
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (twice); single sample -> 0
    close(adv, [[1.0, 1.0, 0.0], [-0.5, 0.0, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]])


def test_reinforce_plus_plus_by_hand():
    mask = T([[1, 0, 1, 1], [1, 1, 0, 0]])
    rewards = T([[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]])
    adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # row 0: G3 = 1, G2 = 0.5, observation skipped, G0 = 0.25; row 1: G1 = 2, G0 = 1
    close(ret, [[0.25, 0.0, 0.5, 1.0], [1.0, 2.0, 0.0, 0.0]])
    # whitening: mean 0.95, deviations -0.7 -0.45 0.05 0.05 1.05, unbiased var 1.8/4 = 0.45
    s = math.sqrt(0.45)
    close(adv, [[-0.7 / s, 0.0, -0.45 / s, 0.05 / s], [0.05 / s, 1.05 / s, 0.0, 0.0]], atol=1e-4)


def test_outcome_to_token_rewards_by_hand():
    mask = T([[1, 1, 0, 0], [1, 0, 1, 0]])
    close(outcome_to_token_rewards(T([3.0, -1.0]), mask), [[0, 3, 0, 0], [0, 0, -1, 0]])
    with pytest.raises(ValueError, match="no policy token"):
        outcome_to_token_rewards(T([1.0, 2.0]), T([[1, 0], [0, 0]]))


def test_group_ids_length_must_match():
    with pytest.raises(ValueError, match="group_ids has 3 entries"):
        grpo_advantages(SCORES, ["a", "a", "b"], GMASK)


# --------------------------------------------------------------------------- registry / dispatch


def test_registry_and_dispatch():
    assert {"gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus"} <= set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match="known: .*grpo"):
        get_advantage_fn("ppo2")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(rloo_advantages)

    token_rewards = outcome_to_token_rewards(SCORES, GMASK)
    via_dispatch, _ = compute_advantages(
        "grpo", token_rewards=token_rewards, response_mask=GMASK, group_ids=GROUPS
    )
    close(via_dispatch, grpo_advantages(SCORES, GROUPS, GMASK)[0])
    dr, _ = compute_advantages(
        "grpo", token_rewards=token_rewards, response_mask=GMASK, group_ids=GROUPS, norm_by_std=False
    )
    close(dr, grpo_advantages(SCORES, GROUPS, GMASK, norm_by_std=False)[0])
    with pytest.raises(ValueError, match="norm_by_sdt"):
        compute_advantages(
            "grpo", token_rewards=token_rewards, response_mask=GMASK, group_ids=GROUPS, norm_by_sdt=1
        )
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages("gae", token_rewards=token_rewards, response_mask=GMASK)
    gae_adv, _ = compute_advantages(
        "gae",
        token_rewards=token_rewards,
        response_mask=GMASK,
        values=torch.zeros(4, 3),
        gamma=1.0,
        lam=1.0,
        whiten=False,
    )
    # gamma = lam = 1 and zero values: every policy token's advantage is the outcome reward
    close(gae_adv, SCORES[:, None] * GMASK)
    assert adv_mod.__all__  # module exports its public names


def _verl_style_grpo_float32(scores: list[float], epsilon: float = 1e-6) -> list[float]:
    """verl's compute_grpo_outcome_advantage arithmetic (float32 torch.mean / torch.std, one group)."""
    t = torch.tensor(scores, dtype=torch.float32)
    return ((t - t.mean()) / (t.std() + epsilon)).tolist()


def test_equal_reward_groups_get_exactly_zero_advantage():
    # The float32 rounding of mean/std divided by std + 1e-6 is not zero: 16 x 0.7 gives |A| ~ 0.1 there
    assert max(abs(a) for a in _verl_style_grpo_float32([0.7] * 16)) > 0.05
    noisy = [k / 100 for k in range(1, 100) if any(_verl_style_grpo_float32([k / 100] * 5))]
    assert noisy  # the group-of-5 rewards verl's arithmetic turns into non-zero advantages
    for n, values in ((16, [0.7]), (5, [k / 100 for k in range(1, 100)]), (3, [1e-8, 123.456, -0.3])):
        for value in values:
            scores = torch.tensor([value] * n + [0.0, 1.0], dtype=torch.float32)
            groups = ["same"] * n + ["other", "other"]
            mask = torch.ones(n + 2, 3)
            for name in ("grpo", "drgrpo", "rloo"):
                adv, _ = get_advantage_fn(name)(scores, groups, mask)
                assert torch.count_nonzero(adv[:n]) == 0, (name, n, value)
                assert torch.count_nonzero(adv[n:]) == 6, (name, n, value)  # the mixed group still learns


def test_equal_reward_groups_zero_under_compute_advantages_with_token_rewards():
    # the trainer's path: scalar rewards placed on the last policy token, summed back per row
    mask = T([[1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0], [1, 1, 1, 0]])
    token_rewards = outcome_to_token_rewards(T([0.81] * 5), mask)
    adv, _ = compute_advantages("grpo", token_rewards=token_rewards, response_mask=mask, group_ids=[0] * 5)
    assert torch.count_nonzero(adv) == 0


def test_rloo_group_of_one_convention_is_zero_not_verls_raw_reward():
    # verl's rloo leaves a lone sample's raw reward (here 5.0) as its advantage; sleuth gives 0, as for
    # GRPO, because there is no other sample to compare with (docs/compatibility.md, verl)
    adv, _ = rloo_advantages(T([5.0, 1.0, 3.0]), ["lone", "pair", "pair"], torch.ones(3, 2))
    close(adv, [[0.0, 0.0], [-2.0, -2.0], [2.0, 2.0]])
