"""SkyRL's text environments (skyrl-gym), run unchanged in the workbench's sandbox.

    env = SkyRLEnvironment("gsm8k_multi_turn", max_turns=3)
    state = env.start({"prompt": [{"role": "user", "content": "..."}], "ground_truth": "72"})
    env.step(state, "I think 70. #### 70")
        -> Observation(text="Please provide your step-by-step reasoning, ...", reward=0.067, done=False,
                       info={"tool": "gsm8k_multi_turn"}, role="user")

    environment("skyrl:gsm8k_multi_turn", max_turns=3)   # the same, from a config string

The env's code never runs in the caller's process: `start` makes the env (`skyrl_gym.make`) and
calls its `init` in a sandbox's jail, and each `step` runs `env.step(text)` there too. Between
calls the env lives as its own pickle (cloudpickle, base64) in the episode's state: it travels
into the jail with the turn's text and comes back with the step's output, so an episode keeps
its env across turns whichever sandbox process serves them, and a crashed or killed step leaves
the env as it was before that turn. So an env must pickle between steps (its state plain
attributes, as skyrl's text envs keep it; not an open connection or a process), and its
pickle counts against `SandboxLimits.output_chars` with the step's observations.

A prompt row becomes `make(id, env_config=..., extras=...)` as SkyRL's dataset does it: every
column but `prompt` (and `env_class`: the env is the one named here) is an extra, so a row in
SkyRL's layout (`reward_spec`, `extra_info`, `data_source`, ...) is read as it is. A row in
verl's or the workbench's layout has no `reward_spec`: it gets `{"method": "rule",
"ground_truth": row["ground_truth"]}` (load_prompts fills `ground_truth` from verl's
`reward_model.ground_truth`), and `extra_info` defaults to {}. `max_turns` given here overrides
a row's own `max_turns` column. `env_config` reaches the env as SkyRL's Hydra config would: an
OmegaConf DictConfig (attribute access, `env_config.db_path`).

Observations are the step's messages' contents joined, shown in their own role (skyrl's text
envs answer as "user"). A failure in the sandbox (timeout, crash, the env raising) is an error
observation the policy reads, and the episode goes on (as ToolEnvironment's tools); each step
counts as a tool call in the episode's metrics. Not carried over from SkyRL: a step's
`postprocessed_action` (kept in `info`; the sampled tokens stay as sampled), and a step with no
observation that is not done (the workbench ends an episode with nothing to show).
"""

from __future__ import annotations

import sys
from typing import Any

import cloudpickle

from workbench import checks
from workbench.agents.env import Environment, Observation, Pending, SandboxEnvironment, close_sandbox, sandbox_for
from workbench.agents.sandbox import Call, SandboxLimits, ToolError, check_jail
from workbench.errors import ConfigError
from workbench.references import NotFound, find

ROLE = "user"
"""The role skyrl's text envs show observations in (BaseTextEnv.step): the workbench's own error
observations use it too, so one template role serves a whole episode."""
LIMITS = SandboxLimits(seconds=30.0, output_chars=65_536)
"""Default limits: a step's answer carries the env's pickle beside its observations, and a call
process's first call imports skyrl_gym (pandas, requests: seconds on a busy machine)."""
NOT_EXTRAS = ("prompt", "env_class")
"""A row's columns that are not the env's extras (SkyRL's dataset leaves the same two out)."""


class SkyRLEnvironment(SandboxEnvironment):
    """A skyrl-gym environment by its registered id (`skyrl_gym.registry`, or your own
    `skyrl_gym.register(id=..., entry_point=YourEnv)`: a class of a notebook travels by value)."""

    def __init__(
        self,
        env_id: str,
        env_config: dict | None = None,
        limits: SandboxLimits | None = None,
        max_turns: int | None = None,
    ):
        import skyrl_gym  # here, on the driver: only its registry is read

        spec = skyrl_gym.registry.get(env_id)
        if spec is None:
            raise ConfigError(
                "SkyRLEnvironment.env_id",
                env_id,
                f"is not a registered skyrl-gym environment; the registered ones: {sorted(skyrl_gym.registry)} "
                f"(register your own with skyrl_gym.register(id=..., entry_point=...))",
            )
        checks.whole("SkyRLEnvironment", "max_turns", max_turns, none_ok=True, fix="give turns >= 1, or None")
        self.env_id, self.env_config, self.max_turns = env_id, dict(env_config or {}), max_turns
        # The spec's parts, not the spec: a worker holding this object need not import skyrl_gym.
        self.entry_point, self.spec_kwargs = spec.entry_point, dict(spec.kwargs)
        self.limits = limits or LIMITS
        check_jail(self.limits)  # here, on the driver, before any worker starts an episode

    def extras(self, row: dict) -> dict:
        """The env's extras from a prompt row (see the module docstring)."""
        extras = {k: v for k, v in row.items() if k not in NOT_EXTRAS}
        extras.setdefault("reward_spec", {"method": "rule", "ground_truth": row.get("ground_truth")})
        extras.setdefault("extra_info", {})
        if self.max_turns is not None:
            extras["max_turns"] = self.max_turns
        return extras

    def start(self, row: dict) -> dict:
        prompt = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        spec = (self.env_id, self.entry_point, self.spec_kwargs)
        tool = f"{self.env_id}.init"
        try:
            made = sandbox_for(self.limits).call(
                _make_in_jail, (spec, self.env_config, self.extras(row), prompt), tool=tool
            )
        except ToolError as err:
            raise ToolError(
                tool,
                err.kind,
                f"{err.detail}; the row's columns were {sorted(row)} (how a row becomes the env's "
                "extras: workbench.agents.skyrl)",
            ) from None
        if made["changed_prompt"] is not None:
            raise ValueError(
                f"{tool} returned a prompt other than the row's ({made['changed_prompt']}); the workbench renders "
                f"the row's prompt before the episode starts, so give rows whose prompt is what init returns"
            )
        return {"env": made["env"], "metadata": made["metadata"]}

    def _send(self, state: dict, text: str) -> Pending:
        if state["env"] is None:
            raise RuntimeError(f"{self.env_id}: the episode ended (done) and its env was closed; start another")
        tool = f"{self.env_id}.step"
        return _Step(
            self.env_id, state, sandbox_for(self.limits).submit(_step_in_jail, (state["env"], text), tool=tool)
        )

    def close(self) -> None:
        """Stop this process's sandbox for these limits (a ToolBox with the same limits shares it)."""
        close_sandbox(self.limits)


class _Step(Pending):
    """A step of the env in the jail; its env's new pickle goes into the episode's state when
    it answers."""

    def __init__(self, env_id: str, state: dict, call: Call):
        self.env_id, self.state, self.call = env_id, state, call

    def ready(self) -> bool:
        return self.call.ready()

    def result(self) -> Observation:
        try:
            out = _checked(self.call.result(), self.call.tool)
        except ToolError as err:  # the policy reads what went wrong; the env stays as it was
            hint = " (the answer carries the env's pickle too)" if err.kind == "output" else ""
            return Observation(f"error: {err}{hint}", info={"tool": self.env_id, "tool_error": err.kind}, role=ROLE)
        self.state["env"] = out["env"]
        messages = out["observations"]
        info: dict[str, Any] = {"tool": self.env_id}
        info |= {k: out[k] for k in ("metadata", "postprocessed_action") if out.get(k)}
        return Observation(
            "\n".join(m["content"] for m in messages) if messages else None,
            out["reward"],
            out["done"],
            info,
            role=messages[0]["role"] if messages else ROLE,
        )


def _checked(answer: Any, tool: str) -> dict:
    """The jail's answer, its shape checked (the jail is not trusted to keep it)."""
    messages = answer.get("observations") if isinstance(answer, dict) else None
    good = (
        isinstance(messages, list)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
        and type(answer.get("reward")) in (int, float)
        and isinstance(answer.get("done"), bool)
        and (isinstance(answer.get("env"), str) or (answer.get("env") is None and answer["done"]))
    )
    if not good:
        raise ToolError(tool, "result", "answered with something other than a step's output")
    return answer


# ---- in the jail: the standard library, cloudpickle and installed packages only ---------------
def _skyrl_gym():
    """skyrl_gym, imported as the jail allows: its import pulls requests and pandas."""
    import os
    import socket

    # pandas' BLAS and pyarrow's jemalloc start threads, and a call process left with a thread is
    # replaced (the next step would import all again): one thread each, none in the background.
    os.environ.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", JE_ARROW_MALLOC_CONF="background_thread:false")
    if "skyrl_gym" not in sys.modules:
        # urllib3 opens an IPv6 socket at import to probe for IPv6; the sandbox refuses sockets,
        # and the jail has no network to find: say so, for the import only.
        had, socket.has_ipv6 = socket.has_ipv6, False
        try:
            import skyrl_gym  # noqa: F401
        finally:
            socket.has_ipv6 = had
    return sys.modules["skyrl_gym"]


def _pack(env) -> str:
    import base64

    return base64.b64encode(cloudpickle.dumps(env)).decode()


def _data(value) -> Any:
    """`value` as JSON data (what is not, as its repr)."""
    import json

    return json.loads(json.dumps(value, default=repr))


def _make_in_jail(spec: tuple, env_config: dict, extras: dict, prompt: list) -> dict:
    skyrl_gym = _skyrl_gym()
    from skyrl_gym.envs.registration import EnvSpec

    try:
        from omegaconf import OmegaConf

        config: Any = OmegaConf.create(env_config)
    except ImportError:
        config = env_config
    env_id, entry_point, kwargs = spec
    env = skyrl_gym.make(EnvSpec(env_id, entry_point, kwargs), env_config=config, extras=extras)
    messages, metadata = env.init(prompt)
    return {
        "env": _pack(env),
        "metadata": _data(metadata or {}),
        "changed_prompt": None if messages == prompt else repr(messages)[:300],
    }


def _step_in_jail(packed: str, action: str) -> dict:
    import base64
    import pickle

    _skyrl_gym()
    env = pickle.loads(base64.b64decode(packed))
    out = env.step(action)
    done = bool(out["done"])
    if done:
        env.close()
    return {
        "env": None if done else _pack(env),
        "observations": [{"role": str(m["role"]), "content": str(m["content"])} for m in out["observations"] or []],
        "reward": float(out["reward"] or 0.0),
        "done": done,
        "metadata": _data(out.get("metadata") or {}),
        "postprocessed_action": _data(out.get("postprocessed_action")),
    }


# Sent by value: the jail cannot import the workbench.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ---- a config's reference --------------------------------------------------------------------
def environment(reference: str, **options) -> Environment:
    """The environment a config names, made with `options`:
    `skyrl:<env id>` a SkyRLEnvironment (options: env_config, limits, max_turns);
    `path/to/file.py:make_env` or `package.module:make_env` a factory of yours, called with them."""
    kind, _, env_id = reference.partition(":")
    if kind == "skyrl":
        return SkyRLEnvironment(env_id, **options)
    try:
        factory = find(reference)
    except NotFound as error:
        raise ConfigError("environment", reference, f"{error}; or write `skyrl:<env id>`") from None
    if not callable(factory):
        raise ConfigError("environment", reference, f"a {type(factory).__name__}, not a factory function")
    env = factory(**options)
    if not isinstance(env, Environment):
        raise ConfigError(
            "environment",
            reference,
            f"returned a {type(env).__name__}; a factory returns a workbench.agents.Environment",
        )
    return env
