"""GRPO over multi-turn episodes on real worker groups: the actor runs the episodes (policy
turns and a sandboxed tool's observations), the environment's reward is the score, the update
trains on the policy's tokens only, and the metrics count turns, tool calls and observations."""

import pytest
from transformers import AutoTokenizer

from algorithms import GRPO, PPO, Groups, GRPOConfig, PPOConfig, ReinforcePP, ReinforcePPConfig
from tests.chat_kit import make_tiny_chat
from workbench import ActorConfig, ActorRolloutRefWorker, CriticConfig, CriticWorker, OptimConfig, SamplingConfig
from workbench.agents import Environment, Observation, SandboxLimits, ToolBox, calculator
from workbench.data.prompts import tokenize_prompts
from workbench.engines.multi_turn import EpisodeConfig
from workbench.errors import ConfigError
from workbench.workers.episode_reward import EpisodeReward


class AskTwice(Environment):
    """Every episode calls the calculator on its first turn (whatever the policy wrote: the tiny
    model writes no tool calls) and is judged on its second: 1 when the final turn is short."""

    def __init__(self):
        self.toolbox = ToolBox({"calculator": calculator}, SandboxLimits(seconds=5))

    def start(self, row):
        return {"turn": 0, "question": row["ground_truth"]}

    def step(self, state, text):
        state["turn"] += 1
        if state["turn"] == 1:
            return Observation(
                self.toolbox.call("calculator", {"expression": state["question"]}), info={"tool": "calc"}
            )
        return Observation(None, reward=float(len(text) < 12), done=True)


@pytest.fixture(scope="module")
def actor(shared_session, tmp_path_factory):
    directory = make_tiny_chat(tmp_path_factory.mktemp("episodes") / "tiny-chat")
    config = ActorConfig(model_path=str(directory), reference=True, optim=OptimConfig(lr=1e-4), mini_batch_size=8)
    group = shared_session.group("episode_actor", ActorRolloutRefWorker, shared_session.pool("episode_pool", 2), config)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}], "ground_truth": f"{a}*{b}"}
        for a, b in [(12, 3), (7, 8)]
    ]
    yield group, tokenize_prompts(rows, tokenizer, max_prompt_length=48)
    shared_session.clear()


def test_grpo_trains_on_episodes_and_counts_their_turns(actor):
    group, prompts = actor
    config = GRPOConfig(
        sampling=SamplingConfig(max_new_tokens=8, n=4, seed=0),
        env=AskTwice(),
        episode=EpisodeConfig(max_turns=3, turn_tokens=8, max_tokens=64),
    )
    grpo = GRPO(Groups(actor=group, reference=group, reward=EpisodeReward()), config)
    history = grpo.fit([prompts], iterations=2, log=None)
    for metrics in history:
        assert metrics["episode/turns/mean"] == 2.0 and metrics["episode/tool_calls"] == 8.0
        assert metrics["episode/tool_errors"] == 0.0 and metrics["episode/observation_tokens/mean"] > 0
        assert metrics["episode/length/mean"] > metrics["response_length/mean"]  # observations are not trained on
        assert (
            "actor/pg_loss" in metrics
            and metrics["prompt_length/mean"] == prompts["attention_mask"].sum(1).float().mean()
        )


@pytest.mark.parametrize("name", ["ppo", "reinforce_pp"])
def test_ppo_and_reinforce_pp_train_on_episodes_too(shared_session, actor, name):
    group, prompts = actor
    sampling = SamplingConfig(max_new_tokens=8, n=2, seed=1)
    episode = EpisodeConfig(max_turns=2, turn_tokens=8, max_tokens=48)
    if name == "ppo":
        critic = shared_session.group(
            "episode_critic",
            CriticWorker,
            shared_session.pool("episode_critic_pool", 1),
            CriticConfig(model_path=group.config.model_path, optim=OptimConfig(lr=1e-4)),
        )
        algorithm = PPO(
            Groups(actor=group, critic=critic, reference=group, reward=EpisodeReward()),
            PPOConfig(sampling=sampling, env=AskTwice(), episode=episode),
        )
    else:
        algorithm = ReinforcePP(
            Groups(actor=group, reference=group, reward=EpisodeReward()),
            ReinforcePPConfig(sampling=sampling, env=AskTwice(), episode=episode),
        )
    batch, metrics = algorithm.step(prompts)
    policy, attended = batch["response_mask"].bool(), batch["attention_mask"][:, -policy_width(batch) :].bool()
    assert metrics["episode/turns/mean"] == 2.0 and (attended & ~policy).any()
    assert not batch["advantages"][~policy].any()  # credit only on the policy's tokens
    assert batch["advantages"][policy].abs().sum() > 0 and "actor/pg_loss" in metrics
    if name == "ppo":
        assert "critic/vf_loss" in metrics


def policy_width(batch) -> int:
    return batch["response_mask"].shape[1]


def test_bad_episode_settings_are_refused_on_the_driver(actor):
    group, prompts = actor
    with pytest.raises(ConfigError, match="generate_episodes"):
        group.generate_episodes(prompts, "calculator", SamplingConfig(max_new_tokens=4))
    with pytest.raises(ConfigError, match="GRPOConfig.env"):
        GRPOConfig(env="calculator")
