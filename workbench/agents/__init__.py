"""Agents: environments a policy acts in over several turns, and the tools they call, run in
sandbox processes (issue 25's foundation: the multi-turn rollout builds on these); SkyRL's
environments run unchanged in them, and `environment("skyrl:<id>" or "file.py:make_env")` makes
the one a config names."""

from workbench.agents.env import (
    Answered,
    Environment,
    Observation,
    Pending,
    SandboxEnvironment,
    ToolBox,
    ToolCall,
    ToolEnvironment,
    parse_tool_call,
)
from workbench.agents.sandbox import Sandbox, SandboxLimits, ToolError
from workbench.agents.skyrl import SkyRLEnvironment, environment
from workbench.agents.tools import calculator, python

__all__ = [
    "Answered",
    "Environment",
    "Observation",
    "Pending",
    "Sandbox",
    "SandboxEnvironment",
    "SandboxLimits",
    "SkyRLEnvironment",
    "ToolBox",
    "ToolCall",
    "ToolEnvironment",
    "ToolError",
    "calculator",
    "environment",
    "parse_tool_call",
    "python",
]
