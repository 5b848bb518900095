"""Environments: what a policy acts in over several turns.

    env = ToolEnvironment({"calculator": calculator}, score=arithmetic_chat.score)
    state = env.start({"ground_truth": "5535"})
    env.step(state, '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>')
        -> Observation(text="5535", reward=0.0, done=False, info={"tool": "calculator"})
    env.step(state, "The answer is 5535.")
        -> Observation(text=None, reward=1.0, done=True, info={})

An environment starts an episode from a prompt row (`start`), and answers each of the policy's
turns (`step`, given the turn's text) with an Observation: text to show the policy next (in the
chat template's tool role, or the observation's own), a reward, and whether the episode ended. A
researcher's own environment is a subclass in a notebook cell. Tools run in a ToolBox's sandbox process, never in
the caller's: a tool that hangs, crashes or misbehaves becomes an error observation the policy
sees (and a count in the metrics), and the episode goes on. SkyRL's environments run unchanged
in one (workbench.agents.skyrl).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workbench.agents.sandbox import Call, Sandbox, SandboxLimits, ToolError, check_jail
from workbench.errors import ConfigError

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
"""A tool call in the policy's text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(the Hermes / Qwen convention many chat templates use)."""
TOOL_CALL_END = "</tool_call>"
"""The stop string that ends a policy turn that calls a tool."""


@dataclass
class Observation:
    """The environment's answer to one policy turn."""

    text: str | None
    """Shown to the policy before its next turn (None: nothing, e.g. the episode ended)."""
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)
    """What happened, for metrics: {"tool": name}, {"tool_error": kind}, {"tool_output_cut":
    characters}, ..."""
    role: str | None = None
    """The chat role it is shown in; None: EpisodeConfig.tool_role. An environment whose
    observations have a role of their own (skyrl's are "user" messages) names it."""


class Pending:
    """An environment's step under way (`Environment.submit`): `ready()` says without waiting
    whether its observation is in, `result()` waits for it."""

    def ready(self) -> bool:
        return True

    def result(self) -> Observation:
        raise NotImplementedError


class Answered(Pending):
    """A step that answered at once."""

    def __init__(self, observation: Observation):
        self.observation = observation

    def result(self) -> Observation:
        return self.observation


class Environment:
    """One episode per prompt row. Subclass and define `step`; `start` keeps the row by default."""

    def start(self, row: dict) -> Any:
        """The episode's state, from its prompt row (the row's columns: ground_truth, ...)."""
        return dict(row)

    def step(self, state: Any, text: str) -> Observation:
        raise NotImplementedError(f"{type(self).__name__}.step(state, text) -> Observation is not defined")

    def submit(self, state: Any, text: str) -> Pending:
        """`step`, started: an environment whose step waits on another process (a tool's
        sandbox) returns before the answer is in, and a rollout decodes other episodes' turns
        meanwhile. By default the step runs here, at once."""
        return Answered(self.step(state, text))

    def close(self) -> None:
        """Release what the environment holds (sandboxes)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def parse_tool_call(text: str) -> ToolCall | str | None:
    """The first tool call in `text`; None when there is none; a string saying what is wrong
    when there is one that cannot be read (the policy is told so, and can try again)."""
    match = TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as err:
        return f"the tool call is not JSON ({err.msg} at character {err.pos})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return 'a tool call is {"name": "...", "arguments": {...}}'
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return "the tool call's arguments must be an object of named values"
    return ToolCall(call["name"], arguments)


class ToolBox:
    """Named tools and the sandbox process they run in: one per process and limits, started on
    the first call and kept (an environment sent to a worker with every call finds the same
    sandbox there, not a new process per call)."""

    def __init__(self, tools: dict[str, Callable[..., str]], limits: SandboxLimits | None = None):
        bad = [name for name, fn in tools.items() if not (isinstance(name, str) and callable(fn))]
        if not tools or bad:
            raise ConfigError("ToolBox.tools", tools, "give {name: function}, e.g. {'calculator': calculator}")
        self.tools, self.limits = dict(tools), limits or SandboxLimits()
        check_jail(self.limits)  # here, on the driver, before any worker starts an episode

    def call(self, name: str, arguments: dict) -> str:
        """The tool's answer as text; ToolError when the call fails (unknown tool, bad
        arguments, a failure in the sandbox)."""
        return str(self.submit(name, arguments).result())

    def submit(self, name: str, arguments: dict) -> Call:
        """`call`, sent without waiting for the answer (see Sandbox.submit)."""
        if name not in self.tools:
            raise ToolError(name, "unknown", f"is not a tool here; the tools are {sorted(self.tools)}")
        return sandbox_for(self.limits).submit(self.tools[name], kwargs=arguments, tool=name)

    def close(self) -> None:
        """Stop this process's sandbox for these limits (the next call starts a fresh one)."""
        close_sandbox(self.limits)


_sandboxes: dict[SandboxLimits, Sandbox] = {}


def sandbox_for(limits: SandboxLimits) -> Sandbox:
    """This process's long-lived sandbox for `limits`."""
    if limits not in _sandboxes:
        _sandboxes[limits] = Sandbox(limits, name="tools")
    return _sandboxes[limits]


def close_sandbox(limits: SandboxLimits) -> None:
    """Stop this process's sandbox for `limits`, if one runs (the next call starts a fresh one)."""
    sandbox = _sandboxes.pop(limits, None)
    if sandbox is not None:
        sandbox.close()


class SandboxEnvironment(Environment):
    """An environment whose steps run in a sandbox process (`_send`): `step` waits for the
    answer, `submit` returns before it is in. A subclass's own `step` is what both run."""

    def step(self, state: Any, text: str) -> Observation:
        return self._send(state, text).result()

    def submit(self, state: Any, text: str) -> Pending:
        if type(self).step is not SandboxEnvironment.step:
            return Answered(self.step(state, text))
        return self._send(state, text)

    def _send(self, state: Any, text: str) -> Pending:
        raise NotImplementedError


class ToolEnvironment(SandboxEnvironment):
    """Tools until an answer: a turn with a tool call gets the tool's answer (or its error) as
    the observation; a turn without one is the final answer, scored by `score(text,
    row["ground_truth"])` (the task's rule, e.g. arithmetic_chat.score)."""

    def __init__(
        self,
        tools: dict[str, Callable[..., str]],
        score: Callable[[str, str], float],
        limits: SandboxLimits | None = None,
        truth_key: str = "ground_truth",
    ):
        self.toolbox = ToolBox(tools, limits)
        self.score, self.truth_key = score, truth_key

    def _send(self, state: dict, text: str) -> Pending:
        call = parse_tool_call(text)
        if call is None:  # the final answer
            return Answered(Observation(None, float(self.score(text, str(state[self.truth_key]))), done=True))
        if isinstance(call, str):
            return Answered(Observation(f"error: {call}", info={"tool_error": "format"}))
        try:
            return _ToolReply(call.name, self.toolbox.submit(call.name, call.arguments))
        except ToolError as err:
            return Answered(_tool_error(call.name, err))

    def close(self) -> None:
        self.toolbox.close()


def _tool_error(name: str, err: ToolError) -> Observation:
    """A failed call as the policy reads it (and may try again)."""
    return Observation(f"error: {err}", info={"tool": name, "tool_error": err.kind})


class _ToolReply(Pending):
    """A tool call's observation, once the sandbox answers."""

    def __init__(self, name: str, call: Call):
        self.name, self.call = name, call

    def ready(self) -> bool:
        return self.call.ready()

    def result(self) -> Observation:
        try:
            text = str(self.call.result())
        except ToolError as err:
            return _tool_error(self.name, err)
        cut = self.call.cut
        return Observation(text, info={"tool": self.name, **({"tool_output_cut": cut} if cut else {})})
