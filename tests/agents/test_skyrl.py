"""SkyRL's environments run unchanged in the workbench's sandbox: stepped through the adapter
they answer exactly as skyrl_gym stepping them directly does, in the jail, turn by turn; a
failed step is an observation and the env goes on as it was; on a real worker group a tiny chat
model's episodes see the env's observations in its own role and end by the env's done or the
episode's max_turns."""

import os
import sys
import time

import cloudpickle
import pytest
import skyrl_gym
from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv
from transformers import AutoTokenizer

from tests.chat_kit import make_tiny_chat
from workbench import ActorConfig, ActorRolloutRefWorker, SamplingConfig
from workbench.agents import SandboxLimits, SkyRLEnvironment, environment
from workbench.agents.jail import SCRATCH
from workbench.data.prompts import tokenize_prompts
from workbench.engines.multi_turn import EpisodeConfig
from workbench.errors import ConfigError

ROW = {
    "prompt": [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in all?"}],
    "ground_truth": "72",
    "data_source": "openai/gsm8k",
    "extra_info": {"split": "test", "index": 0},
}
EXTRAS = {"reward_spec": {"method": "rule", "ground_truth": "72"}, "extra_info": {"split": "test", "index": 0}}
TEXTS = ["48 + 24 = 70. #### 70", "I am not sure.", "#### 72"]  # formatted but wrong, unformatted, right


class WhereAmI(GSM8kMultiTurnEnv):
    """gsm8k_multi_turn that says where its step ran, and hangs when told to."""

    def step(self, action):
        if action == "hang":
            time.sleep(60)
        out = super().step(action)
        out["metadata"] = {"pid": os.getpid(), "cwd": os.getcwd()}
        return out


class AddsASystemPrompt(GSM8kMultiTurnEnv):
    def init(self, prompt):
        return [{"role": "system", "content": "Be brief."}, *prompt], {}


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the jail cannot import the tests
for env_id, cls in (("workbench_test_where", WhereAmI), ("workbench_test_system", AddsASystemPrompt)):
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=cls)


def test_steps_answer_as_skyrl_gym_does_directly_and_run_in_the_jail():
    env = SkyRLEnvironment("gsm8k_multi_turn", max_turns=3)
    direct = skyrl_gym.make("gsm8k_multi_turn", env_config={}, extras={**EXTRAS, "max_turns": 3})
    assert direct.init(ROW["prompt"]) == (ROW["prompt"], {})
    state = env.start(ROW)
    got = []
    for text in TEXTS:
        want, seen = direct.step(text), env.step(state, text)
        assert seen.text == ("\n".join(m["content"] for m in want["observations"]) or None)
        assert (seen.reward, seen.done, seen.role) == (want["reward"], want["done"], "user")
        got.append(seen)
    assert [o.reward for o in got] == pytest.approx([0.2 / 3, 0.0, 1.0]) and [o.done for o in got] == [0, 0, 1]
    assert got[0].text.startswith("Please provide your step-by-step reasoning") and got[0].info == {
        "tool": "gsm8k_multi_turn"
    }

    # An env of one's own (a class of this file, by value) shows where its step ran; a hung step
    # is an error observation, and the env goes on as it was before it.
    # 5 s a call: the first call of a fresh sandbox imports skyrl_gym (a second or more on a busy machine)
    where = SkyRLEnvironment("workbench_test_where", limits=SandboxLimits(seconds=5.0, output_chars=8192), max_turns=2)
    state = where.start(ROW)
    first = where.step(state, TEXTS[0])
    assert first.info["metadata"]["cwd"] == SCRATCH and first.info["metadata"]["pid"] != os.getpid()
    hung = where.step(state, "hang")
    assert hung.info == {"tool": "workbench_test_where", "tool_error": "timeout"} and not hung.done
    assert hung.text.startswith("error: tool 'workbench_test_where.step' took more than 5.0 s") and hung.role == "user"
    last = where.step(state, TEXTS[1])  # the env's second turn: the hung one never happened to it
    assert last.done and last.text is None and last.info["metadata"]["cwd"] == SCRATCH
    with pytest.raises(RuntimeError, match="the episode ended"):
        where.step(state, TEXTS[2])
    where.close()
    env.close()


def test_unknown_ids_and_references_are_named_on_the_driver(tmp_path):
    with pytest.raises(ConfigError, match=r"SkyRLEnvironment.env_id='gsm8k_multi'.*'gsm8k_multi_turn'"):
        SkyRLEnvironment("gsm8k_multi")
    with pytest.raises(ConfigError, match="not a registered skyrl-gym environment"):
        environment("skyrl:nope")
    assert environment("skyrl:gsm8k", max_turns=2).max_turns == 2
    (tmp_path / "my_env.py").write_text(
        "from workbench.agents import SkyRLEnvironment\n\n"
        "def make_env(turns):\n    return SkyRLEnvironment('gsm8k_multi_turn', max_turns=turns)\n"
    )
    made = environment(f"{tmp_path}/my_env.py:make_env", turns=4)
    assert isinstance(made, SkyRLEnvironment) and made.max_turns == 4
    with pytest.raises(ConfigError, match="has no function 'make'"):
        environment(f"{tmp_path}/my_env.py:make")
    with pytest.raises(ConfigError, match="write `skyrl:<env id>`"):
        environment("gsm8k_multi_turn")
    changes = SkyRLEnvironment("workbench_test_system")
    with pytest.raises(ValueError, match="returned a prompt other than the row's"):
        changes.start(ROW)
    changes.close()


@pytest.fixture(scope="module")
def actor(shared_session, tmp_path_factory):
    directory = make_tiny_chat(tmp_path_factory.mktemp("skyrl") / "tiny-chat")
    config = ActorConfig(model_path=str(directory))
    group = shared_session.group("skyrl_actor", ActorRolloutRefWorker, shared_session.pool("skyrl_pool", 1), config)
    yield group, AutoTokenizer.from_pretrained(directory)
    shared_session.clear()


def test_a_tiny_model_plays_gsm8k_multi_turn_on_a_worker_group(actor):
    group, tokenizer = actor
    # The env ends the first row's episodes after one turn; the episode's max_turns the second's.
    rows = [{**ROW, "max_turns": 1}, {**ROW, "max_turns": 5}]
    prompts = tokenize_prompts(rows, tokenizer, max_prompt_length=96)
    sampling = SamplingConfig(n=2, seed=0, max_new_tokens=8)
    episode = EpisodeConfig(max_turns=2, turn_tokens=8, max_tokens=256)
    batch = group.generate_episodes(prompts, SkyRLEnvironment("gsm8k_multi_turn"), sampling, episode).get()
    assert batch["turns"].tolist() == [1, 1, 2, 2] and batch["tool_calls"].tolist() == [1, 1, 2, 2]
    assert not batch["tool_errors"].any()
    policy = batch["response_mask"].bool()
    attended = batch["attention_mask"][:, -policy.shape[1] :].bool()
    for row in range(len(batch)):
        shown = tokenizer.decode(batch["responses"][row][attended[row] & ~policy[row]])
        if row < 2:
            assert shown == ""
        else:  # in the env's role, not the template's tool role
            assert "<|im_start|>user\nPlease provide your step-by-step reasoning" in shown
            assert "<|im_start|>tool" not in shown
        # The rewards are skyrl's for the turns the env read.
        direct = skyrl_gym.make(
            "gsm8k_multi_turn", env_config={}, extras={**EXTRAS, "max_turns": rows[row // 2]["max_turns"]}
        )
        start, reward = 0, 0.0
        for end in batch["turn_ends"][row].tolist()[: int(batch["turns"][row])]:
            ids = batch["responses"][row][start : end + 1][policy[row][start : end + 1]]
            reward += direct.step(tokenizer.decode(ids, skip_special_tokens=True))["reward"]
            start = end + 1
        assert float(batch["episode_reward"][row]) == pytest.approx(reward)
