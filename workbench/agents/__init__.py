"""Agents: environments a policy acts in over several turns, and the tools they call, run in
sandbox processes (issue 25's foundation: the multi-turn rollout builds on these)."""

from workbench.agents.env import Environment, Observation, ToolBox, ToolCall, ToolEnvironment, parse_tool_call
from workbench.agents.sandbox import Sandbox, SandboxLimits, ToolError
from workbench.agents.tools import calculator, python

__all__ = [
    "Environment",
    "Observation",
    "Sandbox",
    "SandboxLimits",
    "ToolBox",
    "ToolCall",
    "ToolEnvironment",
    "ToolError",
    "calculator",
    "parse_tool_call",
    "python",
]
