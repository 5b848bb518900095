"""Environments over policy turns: tool calls parsed from the text and answered by a sandboxed
tool (or an error the policy can read), the final answer scored by the task's rule."""

import pytest

from workbench.agents import (
    Environment,
    Observation,
    SandboxLimits,
    ToolBox,
    ToolCall,
    ToolEnvironment,
    calculator,
    parse_tool_call,
)
from workbench.data import arithmetic_chat
from workbench.errors import ConfigError


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def env():
    environment = ToolEnvironment({"calculator": calculator}, arithmetic_chat.score, SandboxLimits(seconds=2))
    yield environment
    environment.close()


def test_parsing_a_tool_call():
    assert parse_tool_call("I will compute. " + call("calculator", expression="3*4")) == ToolCall(
        "calculator", {"expression": "3*4"}
    )
    assert parse_tool_call("The answer is 12.") is None
    assert "not JSON" in parse_tool_call("<tool_call>{name: calculator}</tool_call>")
    assert "arguments must be an object" in parse_tool_call('<tool_call>{"name": "c", "arguments": [1]}</tool_call>')


def test_an_episode_calls_the_tool_then_answers(env):
    state = env.start({"ground_truth": "5535", "prompt": "What is 123 * 45?"})
    first = env.step(state, call("calculator", expression="123 * 45"))
    assert first == Observation("5535", 0.0, False, {"tool": "calculator"})
    last = env.step(state, "123 * 45 = 5535")
    assert last.done and last.reward == 1.0 and last.text is None
    assert env.step(state, "It is 5534.").reward == 0.0


def test_tool_failures_become_observations_the_episode_goes_on(env):
    state = env.start({"ground_truth": "1"})
    unknown = env.step(state, call("search", query="x"))
    assert not unknown.done and unknown.info["tool_error"] == "unknown" and "tools are ['calculator']" in unknown.text
    bad = env.step(state, call("calculator", expression="__import__('os')"))
    assert bad.info == {"tool": "calculator", "tool_error": "raised"} and bad.text.startswith("error: ")
    wrong_args = env.step(state, call("calculator", formula="1+1"))
    assert wrong_args.info["tool_error"] == "raised" and "formula" in wrong_args.text
    garbled = env.step(state, "<tool_call>calculator(1+1)</tool_call>")
    assert garbled.info == {"tool_error": "format"} and "not JSON" in garbled.text
    assert env.step(state, call("calculator", expression="1 + 0")).text == "1"  # the sandbox still serves


def test_a_tool_of_ones_own_and_an_environment_subclass():
    def shout(text: str) -> str:
        return text.upper()

    box = ToolBox({"shout": shout})
    try:
        assert box.call("shout", {"text": "hi"}) == "HI"
    finally:
        box.close()

    class Countdown(Environment):
        def step(self, state, text):
            state["left"] = state.get("left", 2) - 1
            return Observation(f"{state['left']} left", reward=float(state["left"] == 0), done=state["left"] == 0)

    episode = Countdown()
    state = episode.start({"prompt": "go"})
    assert [episode.step(state, "x").done for _ in range(2)] == [False, True]
    with pytest.raises(NotImplementedError, match="Environment.step"):
        Environment().step({}, "x")
    with pytest.raises(ConfigError, match="ToolBox.tools"):
        ToolBox({})


def test_a_step_is_submitted_and_a_subclass_own_step_is_what_runs(env):
    """`submit` sends a tool call and returns before the answer (a rollout decodes meanwhile);
    its observation is `step`'s. A subclass that defines its own `step` is stepped by it."""
    state = env.start({"ground_truth": "5535"})
    pending = [env.submit(state, call("calculator", expression=f"123 * {k}")) for k in (45, 46, 47)]
    observations = [p.result() for p in pending]
    assert [o.text for o in observations] == ["5535", "5658", "5781"]
    assert observations == [env.step(state, call("calculator", expression=f"123 * {k}")) for k in (45, 46, 47)]
    final = env.submit(state, "The answer is 5535.")
    assert final.ready() and final.result().reward == 1.0

    class Logged(ToolEnvironment):
        def step(self, state, text):
            observation = super().step(state, text)
            observation.info["logged"] = True
            return observation

    logged = Logged({"calculator": calculator}, arithmetic_chat.score, SandboxLimits(seconds=2))
    assert logged.submit(state, call("calculator", expression="2 * 3")).result().info["logged"]
