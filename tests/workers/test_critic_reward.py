"""Critic, reward and cost workers on real processes (FSDP2 critic over 2 gloo ranks)."""

import pytest
import torch

from algorithms.losses import CriticLoss
from workbench import Batch
from workbench.data.prompts import tokenize_prompts
from workbench.engines.contract import OptimConfig
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.rollout import SamplingConfig
from workbench.models import load, make_tiny
from workbench.models.load import LoadConfig
from workbench.models.value import last_token_index, load_value_model, token_values
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.reward import CostModelWorker, RewardModelWorker, ScoreModelConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny("1m", tmp_path_factory.mktemp("tiny") / "m", seed=11))


@pytest.fixture(scope="module")
def rollout(model_dir):
    loaded = load(model_dir)
    rows = [{"prompt": f"Q: {i}+1=? A:", "ground_truth": str(i + 1)} for i in range(6)]
    prompts = tokenize_prompts(rows, loaded.tokenizer, max_prompt_length=16)
    engine = HFRollout(loaded.model, loaded.tokenizer.pad_token_id, loaded.tokenizer.eos_token_id)
    return engine.generate(prompts, SamplingConfig(max_new_tokens=6, seed=0))


def test_critic_values_and_update_lowers_value_loss(session, model_dir, rollout):
    config = CriticConfig(model_path=model_dir, optim=OptimConfig(lr=3e-3), mini_batch_size=6, micro_batch_size=3)
    critic = session.group("critic", CriticWorker, session.pool("critic_pool", 2), config)
    values = critic.compute_values(rollout).get()["values"]
    assert values.shape == rollout["responses"].shape
    assert torch.all(values[rollout["response_mask"] == 0] == 0)
    batch = rollout.union(Batch({"values": values, "returns": torch.ones_like(values)}))
    losses = [critic.update_critic(batch, CriticLoss()).get()["critic/vf_loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses
    metrics = critic.update_critic(batch, CriticLoss()).get()
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"} <= set(metrics)


@pytest.fixture(scope="module")
def reward_dir(model_dir, tmp_path_factory):
    """A value model saved to disk, so its (randomly initialised) head is fixed."""
    loaded = load_value_model(model_dir)
    path = tmp_path_factory.mktemp("rm") / "reward"
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return str(path)


def test_reward_and_cost_scores_match_a_local_forward(session, reward_dir, rollout):
    pool = session.pool("rm_pool", 2)
    reward = session.group("reward", RewardModelWorker, pool, ScoreModelConfig(model_path=reward_dir))
    cost = session.group("cost", CostModelWorker, pool, ScoreModelConfig(model_path=reward_dir))
    scores = reward.compute_reward(rollout).get()
    costs = cost.compute_cost(rollout).get()

    local = load_value_model(reward_dir).model
    with torch.no_grad():
        values = token_values(local, rollout["input_ids"], rollout["attention_mask"], rollout["position_ids"])
    expected = values[torch.arange(len(rollout)), last_token_index(rollout["attention_mask"])]
    assert (scores["scores"] - expected).abs().max() <= 1e-5
    assert torch.equal(costs["costs"], scores["scores"])  # same model, written as costs
    # The score sits on the last response token of each row, and nowhere else.
    token_level = scores["token_level_scores"]
    last = last_token_index(rollout["response_mask"])
    assert torch.equal(token_level[torch.arange(len(rollout)), last], scores["scores"])
    assert int((token_level != 0).sum()) <= len(rollout)


def test_compiled_critic_and_reward_match_a_local_forward(session, reward_dir, rollout):
    """LoadConfig.compile: the compiled value forwards (critic under DeepSpeed ZeRO-2, frozen
    reward model) give what the eager local model gives, and the critic still trains."""
    pool = session.pool("compiled_pool", 1)
    compiled = LoadConfig(compile=True)
    critic = session.group("critic", CriticWorker, pool, CriticConfig(
        model_path=reward_dir, backend="deepspeed", optim=OptimConfig(lr=3e-3), mini_batch_size=6, micro_batch_size=6,
        load=compiled))
    reward = session.group("reward", RewardModelWorker, pool, ScoreModelConfig(model_path=reward_dir, load=compiled))
    local = load_value_model(reward_dir).model
    with torch.no_grad():
        values = token_values(local, rollout["input_ids"], rollout["attention_mask"], rollout["position_ids"])
    expected = values[torch.arange(len(rollout)), last_token_index(rollout["attention_mask"])]
    assert (reward.compute_reward(rollout).get()["scores"] - expected).abs().max() <= 1e-5
    got = critic.compute_values(rollout).get()["values"]
    r = rollout["responses"].shape[1]
    assert (got - values[:, -r - 1 : -1] * rollout["response_mask"]).abs().max() <= 1e-5
    batch = rollout.union(Batch({"values": got, "returns": torch.ones_like(got)}))
    losses = [critic.update_critic(batch, CriticLoss()).get()["critic/vf_loss"] for _ in range(3)]
    assert losses[-1] < losses[0], losses
