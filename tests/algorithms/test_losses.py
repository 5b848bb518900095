"""The loss functions shipped to workers, checked in this process against core's pieces."""

import pickle

import pytest
import ray
import torch

from algorithms import core
from algorithms.losses import ActorLoss, CriticLoss, PretrainLoss
from workbench import Batch
from workbench.engines.forward import model_outputs, response_log_probs, response_values
from workbench.models import load, make_tiny
from workbench.models.value import load_value_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny("1m", tmp_path_factory.mktemp("losses") / "m", seed=2)


@pytest.fixture(scope="module")
def batch(model_dir):
    torch.manual_seed(0)
    rows, prompt, response = 4, 5, 3
    ids = torch.randint(5, 200, (rows, prompt + response))
    attention = torch.ones_like(ids)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    attention[:, prompt:] = mask
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "position_ids": torch.arange(prompt + response).expand(rows, -1),
            "responses": ids[:, prompt:],
            "response_mask": mask,
            "old_log_probs": -torch.rand(rows, response) * mask,
            "ref_log_probs": -torch.rand(rows, response) * mask,
            "advantages": torch.randn(rows, response) * mask,
            "values": torch.randn(rows, response) * mask,
            "returns": torch.randn(rows, response) * mask,
            "loss_mask": attention,
        }
    )


def run(loss_fn, model, batch):
    """A loss in one process, as an engine runs it: the forward its `needs` names, then the loss."""
    outputs = model_outputs(model, batch, loss_fn.needs, getattr(loss_fn, "temperature", 1.0))
    assert set(outputs) == set(loss_fn.needs)  # exactly what it asked for; never the model
    return loss_fn(outputs, batch)


def test_actor_loss_is_policy_loss_minus_entropy_plus_kl(model_dir, batch):
    model = load(model_dir).model
    loss_fn = ActorLoss(
        core.ppo_clip,
        {"clip_ratio_low": 0.1},
        temperature=0.7,
        entropy_coeff=0.01,
        kl_coef=0.2,
        kl_penalty=core.kl_k3,
        loss_agg_mode="seq-mean-token-mean",
    )
    loss, metrics = run(loss_fn, model, batch)
    log_probs, entropy = response_log_probs(model, batch, 0.7, with_entropy=True)
    mask = batch["response_mask"]
    pg, _ = core.ppo_clip(
        log_probs, batch["old_log_probs"], batch["advantages"], mask, clip_ratio_low=0.1, loss_agg_mode="token-mean"
    )  # the policy loss's own default aggregation
    ent = core.aggregate(entropy, mask, "seq-mean-token-mean")
    kl = core.aggregate(core.kl_k3(log_probs, batch["ref_log_probs"]), mask, "seq-mean-token-mean")
    assert torch.allclose(loss, pg - 0.01 * ent + 0.2 * kl, atol=1e-6)
    assert metrics["actor/kl_loss"] == pytest.approx(kl.item(), abs=1e-6)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_losses_travel_by_value_with_a_notebook_defined_policy(batch, model_dir):
    def half_ppo(log_probs, old_log_probs, advantages, response_mask):
        loss, metrics = core.ppo_clip(log_probs, old_log_probs, advantages, response_mask)
        return 0.5 * loss, metrics

    shipped = pickle.loads(ray.cloudpickle.dumps(ActorLoss(half_ppo)))
    model = load(model_dir).model
    full, _ = run(ActorLoss(core.ppo_clip), model, batch)
    half, _ = run(shipped, model, batch)
    assert torch.allclose(half, 0.5 * full, atol=1e-6)


def test_critic_and_pretrain_losses(model_dir, batch):
    model = load_value_model(model_dir).model
    loss, metrics = run(CriticLoss(cliprange_value=0.2), model, batch)
    expected, clipfrac = core.value_loss(
        response_values(model, batch), batch["values"], batch["returns"], batch["response_mask"], 0.2
    )
    assert torch.allclose(loss, expected) and metrics["critic/vf_clipfrac"] == pytest.approx(float(clipfrac))
    lm = load(model_dir).model
    ptx, metrics = run(PretrainLoss(coef=0.5), lm, batch)
    assert ptx.item() == pytest.approx(0.5 * metrics["actor/ptx_loss"], rel=1e-6)
    with pytest.raises(ValueError, match="text_batch"):
        PretrainLoss.check(Batch({"input_ids": batch["input_ids"]}))
