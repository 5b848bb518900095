"""algorithms.core on small tensors whose answers are worked out by hand in the comments."""

import math

import numpy as np
import pytest
import torch

from algorithms import core

T = torch.tensor


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


# ---- masked statistics -------------------------------------------------------------------------


def test_masked_statistics_ignore_masked_entries_and_never_give_nan():
    x, mask = T([[1.0, 3.0, 100.0]]), T([[1.0, 1.0, 0.0]])
    assert core.masked_mean(x, mask) == 2.0
    assert core.masked_var(x, mask) == 2.0  # unbiased: ((1-2)^2 + (3-2)^2) / 1
    assert close(core.masked_whiten(x, mask), [[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]], 1e-4)
    nothing = torch.zeros_like(mask)
    assert core.masked_mean(x, nothing) == 0.0
    assert torch.isfinite(core.masked_whiten(x, nothing)).all()


def test_last_token_scores_puts_the_score_on_the_last_real_token():
    mask = T([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    out = core.last_token_scores(T([2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 2, 0, 0], [0, 0, 0, 3], [4, 0, 0, 0]]


# ---- advantage estimators ------------------------------------------------------------------------


def test_gae_by_hand():
    # gamma = lam = 0.5, r = [0, 1], V = [0.2, 0.4]:
    # delta_1 = 1 - 0.4 = 0.6 -> A_1 = 0.6;  delta_0 = 0.5*0.4 - 0.2 = 0 -> A_0 = 0.25 * 0.6 = 0.15
    # returns = A + V = [0.35, 1.0]; the third position is padding.
    rewards, values, mask = T([[0.0, 1.0, 0.0]]), T([[0.2, 0.4, 9.0]]), T([[1, 1, 0]])
    adv, returns = core.gae(rewards, values, mask, gamma=0.5, lam=0.5)
    assert close(returns, [[0.35, 1.0, 0.0]])
    raw = T([[0.15, 0.6]])
    assert close(adv[:, :2], (raw - raw.mean()) / raw.std(), 1e-4) and adv[0, 2] == 0


def test_gae_length_one_response_and_fully_masked_row():
    rewards, values = T([[1.0, 0.0], [0.0, 0.0]]), T([[0.3, 5.0], [1.0, 1.0]])
    mask = T([[1, 0], [0, 0]])
    adv, returns = core.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert close(returns, [[1.0, 0.0], [0.0, 0.0]])  # A_0 = 1 - 0.3 = 0.7, R_0 = 1
    assert torch.isfinite(adv).all() and (adv[1] == 0).all()


def test_gae_and_returns_carry_across_masked_gaps():
    # A two-turn response: tokens 2-3 are a tool's output (masked), the reward comes at token 4.
    # Values there are garbage; the recursion skips them. gamma = 0.9, lam = 1:
    # t4: delta = 1 - 0.4 = 0.6 -> A = 0.6, R = 1
    # t1: delta = 0.9 * 0.4 - 0.2 = 0.16 -> A = 0.16 + 0.9 * 0.6 = 0.7, R = 0.9
    # t0: delta = 0.9 * 0.2 - 0.5 = -0.32 -> A = -0.32 + 0.9 * 0.7 = 0.31, R = 0.81
    rewards, values = T([[0.0, 0.0, 5.0, 5.0, 1.0]]), T([[0.5, 0.2, 9.0, 9.0, 0.4]])
    mask = T([[1, 1, 0, 0, 1]])
    adv, returns = core.gae(rewards, values, mask, gamma=0.9, lam=1.0)
    assert close(returns, [[0.81, 0.9, 0.0, 0.0, 1.0]])
    raw = T([0.31, 0.7, 0.6])
    assert close(adv[0, [0, 1, 4]], (raw - raw.mean()) / raw.std(), 1e-4) and (adv[0, 2:4] == 0).all()
    # Discounted returns the same way: gamma^k with k counting kept tokens only.
    assert close(core.discounted_returns(rewards, mask, gamma=0.9), [[0.81, 0.9, 0.0, 0.0, 1.0]])
    # A contiguous mask gives what it always did.
    assert close(core.discounted_returns(T([[0.0, 1.0, 7.0]]), T([[1, 1, 0]]), gamma=0.5), [[0.5, 1.0, 0.0]])


def test_grpo_normalises_within_groups_and_equal_groups_give_zero():
    rewards = core.last_token_scores(T([1.0, 0.0, 1.0, 1.0, 0.5]), torch.ones(5, 3))
    mask = T([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    uid = np.array(["a", "a", "b", "b", "c"])
    adv, returns = core.grpo(rewards, mask, uid)
    # group a: mean 0.5, unbiased std 0.7071 -> +-0.7071; group b all equal -> 0; c alone -> its reward
    assert close(adv[0], [0.7071] * 3, 1e-3) and close(adv[1], [-0.7071, 0, 0], 1e-3)
    assert (adv[2:4] == 0).all() and not torch.isnan(adv).any()
    assert close(adv[4], [0.5] * 3, 1e-5)
    assert torch.equal(adv, returns)
    dr, _ = core.drgrpo(rewards, mask, uid)  # Dr.GRPO: no std division
    assert close(dr[0], [0.5] * 3) and close(dr[1], [-0.5, 0, 0])


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    rewards = core.last_token_scores(T([1.0, 0.0, 0.0, 2.0]), torch.ones(4, 2))
    adv, _ = core.rloo(rewards, torch.ones(4, 2), np.array([0, 0, 0, 1]))
    # 1 - mean(0, 0) = 1;  0 - mean(1, 0) = -0.5;  a group of one keeps its reward
    assert close(adv[:, 0], [1.0, -0.5, -0.5, 2.0])


def test_remax_subtracts_the_greedy_reward_from_the_return():
    mask = T([[1, 1, 0], [1, 0, 0]])
    rewards = core.last_token_scores(T([1.0, 0.0]), mask)
    adv, returns = core.remax(rewards, mask, T([0.25, 0.5]))
    assert close(adv, [[0.75, 0.75, 0.0], [-0.5, 0.0, 0.0]])
    assert close(returns, [[1, 1, 0], [0, 0, 0]])


def test_reinforce_pp_discounts_then_whitens_over_the_batch():
    mask = T([[1, 1], [1, 1]])
    rewards = T([[0.0, 1.0], [0.0, 0.0]])
    adv, returns = core.reinforce_pp(rewards, mask, gamma=0.5)
    assert close(returns, [[0.5, 1.0], [0.0, 0.0]])
    assert close(core.masked_mean(adv, mask), 0.0, 1e-6) and close(core.masked_var(adv, mask), 1.0, 1e-4)
    base, centred = core.reinforce_pp_baseline(rewards, mask, np.array(["p", "p"]))
    assert close(centred, [[0.5, 0.5], [-0.5, -0.5]])  # scores 1, 0 minus their group mean 0.5


# ---- KL ----------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    logp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    assert close(core.kl_k1(logp, ref), [math.log(2)])
    assert close(core.kl_abs(ref, logp), [math.log(2)])
    assert close(core.kl_k2(logp, ref), [0.5 * math.log(2) ** 2])
    assert close(core.kl_k3(logp, ref), [0.5 + math.log(2) - 1])  # r - log r - 1, r = 0.25/0.5
    assert close(core.kl_k3(logp, logp), [0.0])


def test_kl_in_reward_penalises_each_token_and_reports_the_sequence_kl():
    mask = T([[1, 1, 0]])
    scores = T([[0.0, 1.0, 0.0]])
    old, ref = T([[-1.0, -1.0, -1.0]]), T([[-2.0, -1.5, -7.0]])
    rewards, kl = core.kl_in_reward(scores, old, ref, mask, kl_coef=0.1)
    assert close(rewards, [[-0.1, 1.0 - 0.05, 0.0]]) and close(kl, [[1.0, 0.5, 0.0]])
    assert core.mean_token_kl(kl, mask) == pytest.approx(0.75)


def test_kl_controllers():
    fixed = core.FixedKL(0.1)
    fixed.update(100.0, 8)
    assert fixed.value == 0.1
    adaptive = core.AdaptiveKL(0.1, target=1.0, horizon=100)
    adaptive.update(current_kl=5.0, n_steps=10)  # error clipped at +0.2: beta *= 1 + 0.2 * 10/100
    assert close(adaptive.value, 0.1 * 1.02)
    adaptive.update(current_kl=0.9, n_steps=10)  # error -0.1
    assert close(adaptive.value, 0.1 * 1.02 * 0.99)


def test_lagrange_multiplier_rises_over_budget_and_stays_non_negative():
    lam = core.LagrangeMultiplier(value=0.5, lr=1.0, budget=0.2)
    lam.update(mean_cost=0.7)
    assert close(lam.value, 1.0)
    lam.update(mean_cost=-5.0)
    assert lam.value == 0.0
    assert close(core.safe_advantages(T([1.0]), T([2.0]), 1.0), [-0.5])  # (1 - 2) / 2


# ---- aggregation and losses --------------------------------------------------------------------


def test_loss_aggregation_modes_by_hand():
    loss = T([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the third row is fully masked
    assert close(core.aggregate(loss, mask, "token-mean"), 10 / 4)
    assert close(core.aggregate(loss, mask, "seq-mean-token-sum"), (6 + 4) / 2)  # rows with tokens
    assert close(core.aggregate(loss, mask, "seq-mean-token-mean"), (2 + 4) / 2)  # rows with tokens
    assert close(core.aggregate(loss, mask, "seq-mean-token-sum-norm"), 10 / 9)
    for mode in core.LOSS_AGG_MODES:
        assert core.aggregate(loss, torch.zeros_like(mask), mode) == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        core.aggregate(loss, mask, "mean")


def test_ppo_clip_low_high_and_dual_clip():
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    # ratios 1.5 (A=+1: clipped to 1.2), 0.5 (A=-1: clipped to 0.8), 5 (A=-1: 5, dual-clipped to 3)
    new = torch.log(T([[1.5, 0.5, 5.0]]))
    adv = T([[1.0, -1.0, -1.0]])
    loss, m = core.ppo_clip(new, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert close(loss, (-1.2 + 0.8 + 5.0) / 3) and close(m["actor/pg_clipfrac"], 2 / 3)
    loss, _ = core.ppo_clip(new, old, adv, mask, clip_ratio_c=3.0)
    assert close(loss, (-1.2 + 0.8 + 3.0) / 3)
    loss, _ = core.ppo_clip(new, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.6)  # clip-higher
    assert close(loss, (-1.5 + 0.8 + 5.0) / 3)


def test_ppo_gradient_on_policy_is_the_policy_gradient():
    logp = torch.zeros(2, 2, requires_grad=True)
    adv, mask = T([[1.0, 1.0], [-2.0, 0.0]]), T([[1, 1], [1, 0]])
    loss, _ = core.ppo_clip(logp, torch.zeros(2, 2), adv, mask)
    loss.backward()
    assert close(logp.grad, -adv * mask / 3)  # d/dlogp of -A * ratio at ratio 1, token mean


def test_gspo_uses_one_length_normalised_ratio_per_sequence():
    old = torch.zeros(1, 3)
    logp = T([[0.1, 0.3, 0.0]]).requires_grad_()
    mask, adv = T([[1, 1, 0]]), T([[1.0, 1.0, 0.0]])
    loss, _ = core.gspo(logp, old, adv, mask, clip_ratio_low=10.0, clip_ratio_high=10.0)
    s = math.exp(0.2)  # exp(mean(0.1, 0.3)) over the two real tokens
    assert close(loss, -s, 1e-5)
    loss.backward()
    assert close(logp.grad, [[-s / 2, -s / 2, 0.0]], 1e-5)  # ds/dlogp_t = s / |y|
    clipped, m = core.gspo(logp.detach(), old, adv, mask)  # default ranges 3e-4 / 4e-4
    assert close(clipped, -(1 + 4e-4), 1e-6) and m["actor/pg_clipfrac"] == 1.0


def test_value_loss_clipping_by_hand():
    values, old, returns = T([[2.0, 0.0]]), T([[0.0, 0.0]]), T([[2.0, 1.0]])
    mask = torch.ones(1, 2)
    # token 0: raw 0, clipped value 0.5 -> (0.5-2)^2 = 2.25; token 1: raw 1, clipped value 0 -> 1
    loss, clipfrac = core.value_loss(values, old, returns, mask, cliprange_value=0.5)
    assert close(loss, 0.5 * (2.25 + 1) / 2) and close(clipfrac, 0.5)
    loss, _ = core.value_loss(values, old, returns, mask, cliprange_value=None)
    assert close(loss, 0.5 * (0 + 1) / 2)


# ---- registries and binding ----------------------------------------------------------------------


def test_registry_lookup_happens_at_call_time_and_redefinition_wins():
    name = "test_registry_entry"
    core.advantage(name)(lambda token_level_rewards, response_mask: (token_level_rewards, token_level_rewards))
    first = core.ADVANTAGES.get(name)

    @core.advantage(name)
    def doubled(token_level_rewards, response_mask, scale=2.0):
        return scale * token_level_rewards, token_level_rewards

    assert core.ADVANTAGES.get(name) is doubled is not first
    batch = {"token_level_rewards": T([1.0]), "response_mask": T([1.0])}
    adv, _ = core.call(core.ADVANTAGES.get(name), batch, {"scale": 3.0})
    assert adv.item() == 3.0
    assert core.ADVANTAGES.get(doubled) is doubled  # a function passes through
    with pytest.raises(KeyError, match="registered: .*gae"):
        core.ADVANTAGES.get("no_such_estimator")
    del core.ADVANTAGES.entries[name]


def test_call_names_the_missing_input():
    with pytest.raises(core.MissingInput, match="'values'.*neither a batch column nor a setting"):
        core.call(
            core.gae, {"token_level_rewards": T([[1.0]]), "response_mask": T([[1.0]])}, {"gamma": 1.0}, what="gae"
        )


def test_policy_losses_on_length_one_and_fully_masked_rows():
    logp = torch.log(T([[1.5, 9.0], [9.0, 9.0]])).requires_grad_()
    old, adv = torch.zeros(2, 2), T([[1.0, 5.0], [3.0, 3.0]])
    mask = T([[1, 0], [0, 0]])  # a length-1 response and a fully masked row
    for fn in (core.ppo_clip, core.gspo):
        loss, metrics = fn(logp, old, adv, mask)
        assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
    loss, _ = core.ppo_clip(logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    assert close(loss, -1.2)  # only the one real token counts, clipped at 1 + 0.2
    loss.backward()
    assert (logp.grad[mask == 0] == 0).all()
    adv1, _ = core.grpo(T([[1.0, 0.0], [0.0, 0.0]]), T([[1, 0], [1, 0]]), ["a", "a"])
    assert close(adv1, [[0.7071, 0.0], [-0.7071, 0.0]], 1e-3)


def test_unset_settings_leave_each_loss_its_own_defaults():
    from algorithms.base import AlgoConfig

    settings = AlgoConfig().settings()  # clip ranges None: PPO keeps 0.2, GSPO its 3e-4 / 4e-4
    batch = {
        "log_probs": torch.full((1, 2), 0.1),
        "old_log_probs": torch.zeros(1, 2),
        "advantages": torch.ones(1, 2),
        "response_mask": torch.ones(1, 2),
    }
    ppo_loss, _ = core.call(core.ppo_clip, batch, settings)
    gspo_loss, _ = core.call(core.gspo, batch, settings)
    assert close(ppo_loss, -1.0 * math.exp(0.1)) and close(gspo_loss, -(1 + 4e-4))  # e^0.1 < 1.2
    higher, _ = core.call(
        core.ppo_clip, {**batch, "log_probs": torch.full((1, 2), 0.5)}, {**settings, "clip_ratio_high": 0.28}
    )
    assert close(higher, -1.28)
