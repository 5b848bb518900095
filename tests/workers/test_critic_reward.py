"""Critic, reward and cost workers on real processes (FSDP2 critic over 2 gloo ranks)."""

import pytest
import torch

from algorithms.losses import CriticLoss
from tests.kit import make_one_block
from workbench import Batch, Mesh
from workbench.data.prompts import tokenize_prompts
from workbench.engines.contract import OptimConfig
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError
from workbench.models import load, make_tiny
from workbench.models.load import LoadConfig
from workbench.models.value import last_token_index, load_value_model, token_values
from workbench.workers.critic import CriticConfig, CriticWorker, has_dropout
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


@pytest.mark.numerics
def test_critic_values_and_update_lowers_value_loss(session, model_dir, rollout):
    config = CriticConfig(model_path=model_dir, optim=OptimConfig(lr=3e-3), mini_batch_size=6, micro_batch_size=3)
    critic = session.group("critic", CriticWorker, session.pool("critic_pool", 2), config)
    values = critic.compute_values(rollout).get()["values"]
    assert values.shape == rollout["responses"].shape
    assert torch.all(values[rollout["response_mask"] == 0] == 0)
    batch = rollout.union(Batch({"values": values, "returns": torch.ones_like(values)}))
    losses = [critic.update_critic(batch, CriticLoss()).get()["critic/vf_loss"] for _ in range(4)]
    assert min(losses[1:]) < losses[0], losses  # a step lowered the loss (which one may differ by machine)
    metrics = critic.update_critic(batch, CriticLoss()).get()
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"} <= set(metrics)


def save_value_model(model_dir, path) -> str:
    """A value model saved to disk, so its (randomly initialised) head is fixed: seeded, so it
    is the same whichever tests ran before."""
    torch.manual_seed(0)
    loaded = load_value_model(model_dir)
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reward_dir(model_dir, tmp_path_factory):
    return save_value_model(model_dir, tmp_path_factory.mktemp("rm") / "reward")


@pytest.fixture(scope="module")
def one_block_reward_dir(tmp_path_factory):
    """The compiled paths' value model: one decoder block, the least that compiles alike."""
    return save_value_model(
        make_one_block(tmp_path_factory.mktemp("tiny1") / "m", seed=11), tmp_path_factory.mktemp("rm1") / "reward"
    )


def test_reused_values_forward_gives_the_update_recomputation_gives(session, reward_dir, rollout):
    """CriticConfig.reuse_values_forward: the values and the update's loss, gradient norm and new
    weights are those of a critic that recomputes; an update over other rows recomputes."""
    pool = session.pool("reuse_pool", 2)
    settings = dict(model_path=reward_dir, optim=OptimConfig(lr=3e-3), mini_batch_size=6, micro_batch_size=2)

    def run(config: CriticConfig, batch: Batch | None = None):
        """One fresh critic's values, update, values after it and update over the rows flipped.
        Each run re-creates the role on the same warm processes: the two critics run one after
        the other from the same weights, as two side by side would."""
        critic = session.group("critic", CriticWorker, pool, config)
        values = critic.compute_values(rollout).get()["values"]
        if batch is None:
            returns = values + torch.linspace(-1, 1, values.shape[1])
            batch = rollout.union(Batch({"values": values, "returns": returns}))
        update = critic.update_critic(batch, CriticLoss()).get()
        after = critic.compute_values(rollout).get()["values"]
        # `after` kept a forward too; rows in another order are not its rows, so this update computes its own.
        flipped = critic.update_critic(batch[torch.arange(len(batch) - 1, -1, -1)], CriticLoss()).get()
        return values, batch, update, after, flipped

    values, batch, got, after, got_flipped = run(CriticConfig(**settings, reuse_values_forward=True))
    plain_values, _, want, plain_after, want_flipped = run(CriticConfig(**settings), batch)

    assert (values - plain_values).abs().max() <= 1e-6
    assert got["critic/values_forward_reused"] == 1.0
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"):
        assert abs(got[key] - want[key]) <= 1e-6 * max(1.0, abs(want[key])), (key, got[key], want[key])
    assert (after - values).abs().max() > 1e-4  # the step moved the values ...
    assert (after - plain_after).abs().max() <= 1e-5  # ... to the same place
    assert got_flipped["critic/values_forward_reused"] == 0.0
    assert abs(got_flipped["critic/vf_loss"] - want_flipped["critic/vf_loss"]) <= 1e-5


@pytest.mark.parametrize("mesh", [None, Mesh(pp=2), Mesh(tp=2)], ids=["dp2", "pp2", "tp2"])
def test_reward_and_cost_scores_match_a_local_forward(session, reward_dir, rollout, mesh):
    """Data parallel, two pipeline stages, or tensor parallel: the scores are the local model's.
    Data parallel keeps the reward model as FSDP shards and the cost model's shards in host
    memory (ScoreModelConfig.keep): each rank keeps about half the weights."""
    pool = session.pool("rm_pool", 2)
    keeps = {"reward": "sharded", "cost": "host"} if mesh is None else {"reward": "whole", "cost": "whole"}
    scorers = {
        role: (cls, ScoreModelConfig(model_path=reward_dir, keep=keeps[role]))
        for role, cls in (("reward", RewardModelWorker), ("cost", CostModelWorker))
    }
    groups = session.fused(pool, mesh=mesh, **scorers)
    reward, cost = groups["reward"], groups["cost"]
    scores = reward.compute_reward(rollout).get()
    costs = cost.compute_cost(rollout).get()

    local = load_value_model(reward_dir).model
    with torch.no_grad():
        values = token_values(local, rollout["input_ids"], rollout["attention_mask"], rollout["position_ids"])
    expected = values[torch.arange(len(rollout)), last_token_index(rollout["attention_mask"])]
    assert (scores["scores"] - expected).abs().max() <= 1e-5
    assert (costs["costs"] - expected).abs().max() <= 1e-5  # same model, written as costs
    if mesh is not None:
        assert torch.equal(costs["costs"], scores["scores"])
    # The score sits on the last response token of each row, and nowhere else.
    token_level = scores["token_level_scores"]
    last = last_token_index(rollout["response_mask"])
    assert torch.equal(token_level[torch.arange(len(rollout)), last], scores["scores"])
    assert int((token_level != 0).sum()) <= len(rollout)


def test_a_fresh_score_head_is_the_same_on_every_rank_and_seeded(session, model_dir, rollout):
    # A plain causal-LM directory has no score head: each rank makes one at load, from the
    # config's seed, so both data-parallel ranks score with the head a seeded local load makes,
    # the reward model's and the cost model's alike (fused as above: the same warm processes).
    fresh = ScoreModelConfig(model_path=model_dir, seed=5)
    groups = session.fused(
        session.pool("fresh_rm", 2), reward=(RewardModelWorker, fresh), cost=(CostModelWorker, fresh)
    )
    torch.manual_seed(5)
    local = load_value_model(model_dir).model
    with torch.no_grad():
        values = token_values(local, rollout["input_ids"], rollout["attention_mask"], rollout["position_ids"])
    expected = values[torch.arange(len(rollout)), last_token_index(rollout["attention_mask"])]
    assert (groups["reward"].compute_reward(rollout).get()["scores"] - expected).abs().max() <= 1e-5
    assert (groups["cost"].compute_cost(rollout).get()["costs"] - expected).abs().max() <= 1e-5


def test_compiled_critic_and_reward_match_a_local_forward(session, one_block_reward_dir, rollout):
    """LoadConfig.compile: the compiled value forwards (critic under DeepSpeed ZeRO-2, frozen
    reward model) give what the eager local model gives, and the critic still trains."""
    compiled = LoadConfig(compile=True)
    critic_config = CriticConfig(
        model_path=one_block_reward_dir,
        backend="deepspeed",
        optim=OptimConfig(lr=3e-3),
        mini_batch_size=6,
        micro_batch_size=6,
        load=compiled,
        reuse_values_forward=True,
    )
    # One process for both (each process start imports torch again): each role compiles its own model.
    groups = session.fused(
        session.pool("compiled_pool", 1),
        critic=(CriticWorker, critic_config),
        reward=(RewardModelWorker, ScoreModelConfig(model_path=one_block_reward_dir, load=compiled)),
    )
    critic, reward = groups["critic"], groups["reward"]
    local = load_value_model(one_block_reward_dir).model
    with torch.no_grad():
        values = token_values(local, rollout["input_ids"], rollout["attention_mask"], rollout["position_ids"])
    expected = values[torch.arange(len(rollout)), last_token_index(rollout["attention_mask"])]
    assert (reward.compute_reward(rollout).get()["scores"] - expected).abs().max() <= 1e-5
    got = critic.compute_values(rollout).get()["values"]
    r = rollout["responses"].shape[1]
    assert (got - values[:, -r - 1 : -1] * rollout["response_mask"]).abs().max() <= 1e-5
    batch = rollout.union(Batch({"values": got, "returns": torch.ones_like(got)}))
    metrics = [critic.update_critic(batch, CriticLoss()).get() for _ in range(2)]
    # It trains: each step had a gradient and moved the compiled model's values. (Whether one
    # step lowers this 6-row loss depends on the step size and the model; the eager critic's
    # tests check the learning itself.)
    assert all(m["critic/grad_norm"] > 0 for m in metrics), metrics
    assert (critic.compute_values(rollout).get()["values"] - got).abs().max() > 1e-4
    # Only the first update follows compute_values: it reused that forward; the second computed its own.
    assert [m["critic/values_forward_reused"] for m in metrics] == [1.0, 0.0]


def test_reused_values_forward_is_refused_where_the_values_would_be_stale(model_dir):
    settings = dict(model_path=model_dir, mini_batch_size=6, micro_batch_size=2, reuse_values_forward=True)
    with pytest.raises(ConfigError, match=r"CriticConfig.reuse_values_forward.*epochs=2"):
        CriticConfig(**settings, epochs=2)
    with pytest.raises(ConfigError, match=r"CriticConfig.reuse_values_forward.*zero_stage=3"):
        CriticConfig(**settings, backend="deepspeed", zero_stage=3)
    with pytest.raises(
        ConfigError, match=r"reuse_values_forward.*several optimizer steps.*raise mini_batch_size to 12"
    ):
        CriticConfig(**settings).check_rows(12, "critic")
    CriticConfig(**settings).check_rows(6, "critic")
    model = load_value_model(model_dir).model
    assert not has_dropout(model)
    model.config.attention_dropout = 0.1  # a random training forward is not the values' forward
    assert has_dropout(model)


def test_a_scorers_stages_divide_its_layers(reward_dir):
    config = ScoreModelConfig(model_path=reward_dir)
    with pytest.raises(ConfigError, match=r"num_hidden_layers.*pp=3"):
        config.check_layout(Mesh(pp=3), "reward")
