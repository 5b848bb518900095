"""Multi-turn episodes on the vLLM rollout, through the actor (real Ray, a real in-process vLLM
engine in the worker): the same structure as on the HF rollout — observations in the tool role
masked out, turn ends on the policy's tokens, episodes of different lengths in one batch of
fixed width — the rollout's log-probs equal to the training forward's, and the same seed gives
the same trajectories. The actor schedules continuously (each episode's next turn added to the
engine as soon as its tool answered): the same trajectories as turn by turn, and a slow tool
holds back no other episode's turns."""

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoTokenizer

import tests.engines.envs as envs
from tests.chat_kit import make_tiny_chat
from workbench import ActorConfig, ActorRolloutRefWorker, SamplingConfig
from workbench.data.prompts import tokenize_prompts
from workbench.engines.multi_turn import EpisodeConfig
from workbench.engines.vllm_rollout import VLLMRolloutConfig
from workbench.errors import ConfigError

ray.cloudpickle.register_pickle_by_value(envs)
TOL = 1e-3  # vLLM's fp32 kernels against the training forward (tests/engines/test_vllm_rollout.py)
EPISODE = EpisodeConfig(max_turns=4, turn_tokens=6, max_tokens=96)


@pytest.fixture(scope="module")
def vllm_actor(shared_session, tmp_path_factory):
    shm_before = set(os.listdir("/dev/shm"))
    directory = make_tiny_chat(tmp_path_factory.mktemp("vllm-episodes") / "tiny-chat")
    config = ActorConfig(
        model_path=str(directory),
        rollout="vllm",
        vllm=VLLMRolloutConfig(
            max_model_len=160, max_num_seqs=64, cache_root=str(tmp_path_factory.mktemp("vllm-cache"))
        ),
    )
    group = shared_session.group("vllm_episodes", ActorRolloutRefWorker, shared_session.pool("vllm_ep_pool", 1), config)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    rows = [
        {"prompt": [{"role": "user", "content": f"question {i}"}], "ground_truth": str(turns)}
        for i, turns in enumerate([1, 3, 2, 4])
    ]
    yield group, tokenizer, tokenize_prompts(rows, tokenizer, max_prompt_length=32)
    shared_session.clear()
    for name in set(os.listdir("/dev/shm")) - shm_before:  # segments the engine left behind
        if name.startswith("psm_"):
            Path("/dev/shm", name).unlink(missing_ok=True)


def test_vllm_episodes_have_the_multi_turn_structure_and_rescore_exactly(vllm_actor):
    group, tokenizer, prompts = vllm_actor
    batch = group.generate_episodes(prompts, envs.Replies(), SamplingConfig(n=2, seed=0), EPISODE).get()
    assert batch["responses"].shape[1] == EPISODE.max_tokens and batch["turn_ends"].shape[1] == EPISODE.max_turns
    assert batch["turns"].tolist() == [1, 1, 3, 3, 2, 2, 4, 4]  # the environment ends each episode
    policy, attended = batch["response_mask"].bool(), batch["attention_mask"][:, -EPISODE.max_tokens :].bool()
    for row in range(len(batch)):
        observed = int(batch["observation_tokens"][row])
        assert int(attended[row].sum()) == int(policy[row].sum()) + observed and (observed > 0) == (row >= 2)
        ends = [e for e in batch["turn_ends"][row].tolist() if e >= 0]
        assert len(ends) == batch["turns"][row] and all(policy[row, e] for e in ends)
        text = tokenizer.decode(batch["responses"][row][attended[row]])
        assert text.count("<|im_start|>tool\nresult") == batch["turns"][row] - 1
    # The training forward re-scores every sampled token as vLLM scored it while sampling.
    trained = group.compute_log_prob(batch).get()["old_log_probs"]
    assert (trained - batch["rollout_log_probs"])[policy].abs().max() <= TOL
    assert not batch["rollout_log_probs"][~policy].any()


def test_vllm_episodes_repeat_for_a_seed(vllm_actor):
    group, _, prompts = vllm_actor
    first, again, other = (
        group.generate_episodes(prompts, envs.Replies(), SamplingConfig(n=2, seed=seed), EPISODE).get()
        for seed in (3, 3, 4)
    )
    assert torch.equal(first["input_ids"], again["input_ids"]) and torch.equal(first["turn_ends"], again["turn_ends"])
    assert not torch.equal(first["responses"], other["responses"])


@pytest.mark.parametrize(
    "sampling, env",
    [
        (SamplingConfig(greedy=True), envs.Replies),
        (SamplingConfig(n=2, seed=7), envs.Replies),
        (SamplingConfig(n=2, seed=7), envs.Calculated),
    ],
    ids=["greedy", "seeded", "seeded-sandboxed"],
)
def test_continuous_scheduling_gives_the_turn_by_turn_trajectories(vllm_actor, sampling, env):
    """Every turn of an episode samples from its own stream (seed, row, turn) on either schedule,
    so only float rounding could tell them apart (a step's batch changes the kernels' reduction
    order): on this tiny fp32 model no sampled id moves, and the log-probs agree closely. So
    also when the observations come from a tool sandbox, read between engine steps."""
    group, _, prompts = vllm_actor
    continuous, turn_by_turn = (
        group.generate_episodes(prompts, env(), sampling, replace(EPISODE, continuous=flag)).get()
        for flag in (True, False)
    )
    for key in ("input_ids", "attention_mask", "response_mask", "turn_ends", "episode_reward", "turns", "tool_calls"):
        assert torch.equal(continuous[key], turn_by_turn[key]), key
    assert torch.equal(continuous["observation_tokens"], turn_by_turn["observation_tokens"])
    difference = (continuous["rollout_log_probs"] - turn_by_turn["rollout_log_probs"]).abs().max()
    assert difference <= 1e-4
    assert continuous["turns"].tolist() == [t for t in (1, 3, 2, 4) for _ in range(sampling.n)]


def test_an_episode_does_not_wait_for_another_episodes_slow_tool(vllm_actor, shared_session):
    """The 4-turn episode's first tool call takes 0.6 s. Turn by turn, no second turn starts
    before every first turn's tool answered; continuously, the episodes whose tools answered at
    once have their second turns in the engine before the slow tool is done, and decode them
    meanwhile when the slow step was submitted rather than run in place."""
    group, _, prompts = vllm_actor

    def spans(continuous: bool, env=None) -> dict[tuple[str, int], tuple[float, float]]:
        since = time.time()
        episode = replace(EPISODE, continuous=continuous)
        env = env or envs.SlowStart(4, 0.6)
        batch = group.generate_episodes(prompts, env, SamplingConfig(greedy=True), episode).get()
        assert batch["turns"].tolist() == [1, 3, 2, 4]
        return {
            (r.method, r.extra["turn"]): (r.start, r.end)
            for r in shared_session.trace()
            if r.start >= since and r.method in ("episode.generate", "episode.tools")
        }

    timed = spans(continuous=True)
    assert timed[("episode.generate", 1)][0] < timed[("episode.tools", 0)][1] - 0.5
    timed = spans(continuous=False)
    assert timed[("episode.generate", 1)][0] >= timed[("episode.tools", 0)][1]
    # A step that blocks (SlowStart.step) holds the engine: no third turn starts before it
    # answered. A submitted one (SlowSubmit, as a tool's sandbox answers) does not: the 3-turn
    # episode's second turn decodes and its third starts meanwhile.
    timed = spans(continuous=True)
    assert timed[("episode.generate", 2)][0] >= timed[("episode.tools", 0)][1]
    timed = spans(continuous=True, env=envs.SlowSubmit(4, 0.6))
    assert timed[("episode.generate", 2)][0] < timed[("episode.tools", 0)][1] - 0.3


def test_an_episode_that_cannot_fit_the_engine_is_refused_on_the_driver(vllm_actor):
    group, _, prompts = vllm_actor
    with pytest.raises(ConfigError, match="VLLMRolloutConfig.max_model_len"):
        group.generate_episodes(prompts, envs.Replies(), SamplingConfig(), EpisodeConfig(max_tokens=150))


def test_seeded_sampling_of_more_prompt_tokens_than_one_default_prefill_step(vllm_actor):
    """64 contexts of ~90 tokens: more than vLLM's CPU default of 4096 tokens per step. Had vLLM
    split a prefill over steps, a seeded request's discarded sample would rewind its generator,
    which CPU generators cannot do (RuntimeError: CPU Generator does not use offset)."""
    group, tokenizer, _ = vllm_actor
    long = " ".join(["word"] * 20)
    rows = [{"prompt": [{"role": "user", "content": f"{i} {long}"}], "ground_truth": "1"} for i in range(64)]
    prompts = tokenize_prompts(rows, tokenizer, max_prompt_length=120)
    assert int(prompts["attention_mask"].sum()) > 4096
    first, again = (group.generate_sequences(prompts, SamplingConfig(max_new_tokens=4, seed=5)).get() for _ in range(2))
    assert torch.equal(first["responses"], again["responses"])
