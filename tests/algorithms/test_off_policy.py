"""The off-policy corrections (algorithms.core.OFF_POLICY_CORRECTIONS) against computations
written out here, on fixed inputs: values, gradients, caps, config refusals, live edits."""

import pytest
import torch

from algorithms import GRPOConfig, core
from algorithms.losses import ActorLoss
from workbench.errors import ConfigError

CLIP = 0.2


@pytest.fixture
def rows():
    g = torch.Generator().manual_seed(3)
    shape = (4, 6)
    old = -torch.rand(shape, generator=g) * 3
    rollout = old + torch.randn(shape, generator=g) * 0.6  # a behaviour policy some way off
    mask = torch.ones(shape)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    return {
        "log_probs": (old + torch.randn(shape, generator=g) * 0.1).requires_grad_(),
        "old_log_probs": old,
        "rollout_log_probs": rollout,
        "advantages": torch.randn(shape, generator=g),
        "response_mask": mask,
    }


def reference_loss(r, weight):
    """The clipped surrogate, token by token, each token times `weight(token)`, token mean."""
    total, count = 0.0, 0
    rows_, cols = r["response_mask"].shape
    for i in range(rows_):
        for t in range(cols):
            if not r["response_mask"][i, t]:
                continue
            ratio = torch.exp(r["log_probs"][i, t] - r["old_log_probs"][i, t])
            a = r["advantages"][i, t]
            surrogate = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - CLIP, 1 + CLIP))
            total = total + weight(i, t) * surrogate
            count += 1
    return total / count


def behaviour_ratio(r, i, t):
    return float(torch.exp(r["old_log_probs"][i, t] - r["rollout_log_probs"][i, t]))


def loss_and_grad(fn, r):
    r["log_probs"].grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), r["log_probs"].grad.clone()


def actor_loss(r, correction, cap=2.0):
    batch = {k: v.detach() for k, v in r.items() if k != "log_probs"}
    loss = ActorLoss(policy=core.ppo_clip, settings={"is_cap": cap}, correction=correction)  # None: no cap
    return lambda: loss({"log_probs": r["log_probs"], "entropy": torch.zeros_like(r["log_probs"])}, batch)[0]


@pytest.mark.parametrize("cap", [2.0, 1.2])
def test_tis_equals_the_truncated_weighting_written_out(rows, cap):
    got = loss_and_grad(actor_loss(rows, core.OFF_POLICY_CORRECTIONS.get("tis"), cap), rows)
    want = loss_and_grad(lambda: reference_loss(rows, lambda i, t: min(behaviour_ratio(rows, i, t), cap)), rows)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)  # the weights carry no gradient


@pytest.mark.parametrize("cap", [2.0, 1.2, None])
def test_decoupled_ppo_equals_the_proximal_weighting_written_out(rows, cap):
    def weight(i, t):
        w = behaviour_ratio(rows, i, t)
        return 0.0 if cap is not None and w > cap else w

    got = loss_and_grad(actor_loss(rows, core.OFF_POLICY_CORRECTIONS.get("decoupled"), cap), rows)
    want = loss_and_grad(lambda: reference_loss(rows, weight), rows)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)


def test_the_caps_count_the_tokens_they_cut(rows):
    mask = rows["response_mask"].bool()
    ratios = torch.exp(rows["old_log_probs"] - rows["rollout_log_probs"])[mask]
    for name in ("tis", "decoupled"):
        weights, metrics = core.call(core.OFF_POLICY_CORRECTIONS.get(name), rows, {"is_cap": 1.5})
        assert metrics["actor/is_capped_frac"] == pytest.approx(float((ratios > 1.5).float().mean()))
        assert 0 < metrics["actor/is_capped_frac"] < 1  # the fixture's behaviour policy is off enough
        assert metrics["actor/is_weight_max"] == pytest.approx(float(ratios.max()))
        assert float(weights[mask].max()) <= 1.5
        assert not weights.requires_grad


def test_no_correction_leaves_ppo_bit_identical(rows):
    plain = loss_and_grad(
        lambda: core.ppo_clip(rows["log_probs"], rows["old_log_probs"], rows["advantages"], rows["response_mask"])[0],
        rows,
    )
    through_loss = loss_and_grad(actor_loss(rows, None), rows)
    assert torch.equal(plain[0], through_loss[0]) and torch.equal(plain[1], through_loss[1])
    assert core.call(core.OFF_POLICY_CORRECTIONS.get("none"), rows, {}) == (None, {})


def test_a_correction_redefined_in_a_cell_is_the_one_the_next_loss_uses(rows):
    from algorithms.base import Algorithm

    original = core.OFF_POLICY_CORRECTIONS.get("tis")
    try:

        @core.off_policy_correction("tis")
        def halve(response_mask):
            return torch.full(response_mask.shape, 0.5), {"actor/halved": 1.0}

        algo = object.__new__(Algorithm)
        algo.config = GRPOConfig(off_policy_correction="tis", kl_loss_coef=0.0)
        algo.pi_old_source = "recompute"  # set per iteration by generate()
        loss = algo.actor_loss()
        batch = {k: v.detach() for k, v in rows.items() if k != "log_probs"}
        value, metrics = loss({"log_probs": rows["log_probs"], "entropy": torch.zeros_like(rows["log_probs"])}, batch)
        assert metrics["actor/halved"] == 1.0
        assert value.item() == pytest.approx(0.5 * reference_loss(rows, lambda i, t: 1.0).item(), rel=1e-6)
    finally:
        core.off_policy_correction("tis")(original)


def test_refusals_name_the_field():
    with pytest.raises(ConfigError, match="off_policy_correction"):
        GRPOConfig(off_policy_correction="importance")
    with pytest.raises(ConfigError, match="is_cap"):
        GRPOConfig(off_policy_correction="tis", is_cap=1.0)
    with pytest.raises(ConfigError, match="is_cap"):
        GRPOConfig(off_policy_correction="tis", is_cap=None)
    with pytest.raises(ConfigError, match="is_cap"):  # named or passed as the function itself
        GRPOConfig(off_policy_correction=core.truncated_importance_sampling, is_cap=None)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        loss = ActorLoss(policy=core.ppo_clip, correction=core.OFF_POLICY_CORRECTIONS.get("tis"))
        mask = torch.ones(1, 2)
        loss(
            {"log_probs": torch.zeros(1, 2), "entropy": torch.zeros(1, 2)},
            {"old_log_probs": torch.zeros(1, 2), "advantages": mask, "response_mask": mask},
        )


def test_a_correction_recomputes_pi_old_and_refuses_the_rollouts():
    from algorithms import Groups
    from algorithms.base import Algorithm

    algo = object.__new__(Algorithm)
    algo.groups = Groups()
    algo.config = GRPOConfig(off_policy_correction="decoupled")
    assert algo.old_log_prob_source(8) == "recompute"
    algo.config = GRPOConfig(off_policy_correction="decoupled", old_log_probs="rollout")
    with pytest.raises(ValueError, match="old_log_probs='recompute'"):
        algo.old_log_prob_source(8)
