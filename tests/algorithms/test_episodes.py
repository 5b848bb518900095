"""GRPO over multi-turn episodes on real worker groups: the actor runs the episodes (policy
turns and a sandboxed tool's observations), the environment's reward is the score, the update
trains on the policy's tokens only, and the metrics count turns, tool calls and observations."""

import os
import time

import pytest
from transformers import AutoTokenizer

from algorithms import GRPO, PPO, Groups, GRPOConfig, PPOConfig, ReinforcePP, ReinforcePPConfig
from tests.chat_kit import make_tiny_chat
from tests.kit import checksum_score
from workbench import ActorConfig, ActorRolloutRefWorker, CriticConfig, CriticWorker, OptimConfig, SamplingConfig
from workbench.agents import Environment, Observation, SandboxLimits, ToolBox, ToolError, calculator, python
from workbench.data.prompts import tokenize_prompts
from workbench.engines.multi_turn import EpisodeConfig
from workbench.errors import ConfigError
from workbench.workers.episode_reward import EpisodeReward


class AskTwice(Environment):
    """Every episode calls the calculator on its first turn (whatever the policy wrote: the tiny
    model writes no tool calls) and is judged on its second: a checksum of the final turn's text
    in [0, 1), so any two episodes that end differently score apart and advantages are never all
    0, whatever the model samples on this machine's rounding."""

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
        return Observation(None, reward=checksum_score(text), done=True)


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


def test_grpo_trains_on_episodes_and_counts_their_turns(shared_session, actor):
    group, prompts = actor
    since = time.time()
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
    # Each turn's generation and its tool calls arrive in the trace, inside the rollout's call.
    spans = [r for r in shared_session.trace() if r.start >= since and r.role == "episode_actor"]
    calls = [r for r in spans if r.method == "generate_episodes"]
    turns = sorted(
        ((r.extra["iteration"], r.rank, r.extra["turn"], r.method) for r in spans if r.method.startswith("episode.")),
    )
    assert turns == sorted(
        (i, rank, turn, m)
        for i in (1, 2)
        for rank in (0, 1)
        for turn in (0, 1)
        for m in ("episode.generate", "episode.tools")
    )
    for r in spans:
        if r.method.startswith("episode."):
            call = next(c for c in calls if c.rank == r.rank and c.extra["iteration"] == r.extra["iteration"])
            assert call.start <= r.start <= r.end <= call.end and r.extra["step"] == "gen"
            if r.method == "episode.tools":
                assert (r.extra["tool_calls"], r.extra["tool_errors"]) == ((4, 0) if r.extra["turn"] == 0 else (0, 0))
            else:
                assert r.extra["rows"] == 4 and r.extra["tokens"] > 0


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


BAD_CODE = {
    "timeout": "import time\ntime.sleep(60)",
    "loop": "while True:\n    pass",
    "blocked-write": "open('/tmp/workbench-episode-escape.txt', 'w').write('x')",
    "blocked-socket": "import socket\nsocket.create_connection(('127.0.0.1', 9))",
    "memory": "x = []\nwhile True:\n    x.append(bytearray(10**7))",
    # Against the rank itself, under the audit hook (ctypes): its pid is out of the jail's sight.
    "kill-rank": "import ctypes\nif ctypes.CDLL(None).kill({rank}, 9) != 0:\n    raise ProcessLookupError('rank')",
    # Its real stdout is not the protocol: a stray line there is read by nobody; then it hangs.
    "stdout": "import sys, time\nsys.__stdout__.write('1234\\n')\nsys.__stdout__.flush()\ntime.sleep(60)",
}
NAMED = {
    "timeout": "took more than 1.0 s",
    "loop": "took more than 1.0 s",
    "blocked-write": "writes only inside the scratch directory",
    "blocked-socket": "no network in the sandbox",
    "memory": "ran out of memory",
    "kill-rank": "ProcessLookupError",
    "stdout": "took more than 1.0 s",
}


class Misbehaving(Environment):
    """Each episode's first turn runs a misbehaving tool (sleeps, loops, writes outside its
    directory, opens a socket, allocates without bound: the prompt row names two, one for each
    of its two samples); its second turn calls the calculator, which must answer; the third is
    judged. The memory bomb's sandbox has time to spare: on a loaded machine, filling 256 MiB
    can take longer than the others' 1 s, and the memory limit, not the clock, must stop it."""

    def __init__(self):
        tools = {"python": python, "calculator": calculator}
        self.toolbox = ToolBox(tools, SandboxLimits(seconds=1.0, memory_mib=256))
        self.roomy = ToolBox(tools, SandboxLimits(seconds=30.0, memory_mib=256))
        self.started: dict[str, int] = {}

    def start(self, row):
        names = row["ground_truth"].split(",")
        self.started[row["ground_truth"]] = self.started.get(row["ground_truth"], 0) + 1
        return {"turn": 0, "bad": names[(self.started[row["ground_truth"]] - 1) % len(names)]}

    def step(self, state, text):
        state["turn"] += 1
        toolbox = self.roomy if state["bad"] == "memory" else self.toolbox
        try:
            if state["turn"] == 1:
                return Observation(
                    toolbox.call("python", {"code": BAD_CODE[state["bad"]].format(rank=os.getpid())}),
                    info={"tool": "python"},
                )
            if state["turn"] == 2:
                return Observation(toolbox.call("calculator", {"expression": "6 * 7"}), info={"tool": "calculator"})
        except ToolError as err:
            return Observation(f"error: {err}", info={"tool": err.tool, "tool_error": err.kind})
        return Observation(None, reward=checksum_score(text), done=True)


def test_a_misbehaving_tool_is_stopped_and_named_while_the_next_iteration_runs(actor):
    group, _ = actor
    tokenizer = AutoTokenizer.from_pretrained(group.config.model_path)
    pairs = ["timeout,loop", "blocked-write,memory", "blocked-socket,kill-rank", "stdout,kill-rank"]
    rows = [{"prompt": [{"role": "user", "content": f"Try {p}."}], "ground_truth": p} for p in pairs]
    prompts = tokenize_prompts(rows, tokenizer, max_prompt_length=48)  # x 2 samples: 8 episodes, each misbehaviour
    config = GRPOConfig(
        sampling=SamplingConfig(max_new_tokens=4, n=2, seed=0),
        env=Misbehaving(),
        episode=EpisodeConfig(max_turns=3, turn_tokens=4, max_tokens=256),
    )
    grpo = GRPO(Groups(actor=group, reference=group, reward=EpisodeReward()), config)
    batches = []
    history = grpo.fit([prompts], iterations=2, log=None, callbacks=[lambda algo, batch, m: batches.append(batch)])
    for metrics, batch in zip(history, batches):
        assert metrics["episode/tool_calls"] == 16.0 and metrics["episode/tool_errors"] == 8.0
        assert metrics["episode/turns/mean"] == 3.0 and "actor/pg_loss" in metrics  # the iteration ran to its update
        seen, texts = set(), []
        for row in range(len(batch)):
            real = batch["attention_mask"][row, -batch["responses"].shape[1] :].bool()
            observed = real & ~batch["response_mask"][row].bool()
            text = tokenizer.decode(batch["responses"][row][observed])
            first, second = text.split("<|im_start|>tool\n")[1:3]
            assert first.startswith("error: tool 'python' ")
            seen |= {words for words in NAMED.values() if words in first}
            texts.append(first)
            assert second.startswith("42<|im_end|>")  # the next call, in a fresh sandbox process, answers
        assert seen == set(NAMED.values()), texts  # each misbehaviour, named
    assert not os.path.exists("/tmp/workbench-episode-escape.txt")
