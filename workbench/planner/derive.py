"""Dataflows read off the algorithm files, so the planner plans what `step()` really does.

`derive_dataflow(algorithms.PPO)` parses the class's `step()` (its source, not a run) and turns
every stage call on `self` into a model function call, with dependencies from the variables
its arguments come from:

    gen = self.generate(prompts)                     -> actor_gen
    batch = self.collect(gen, self.values(gen), ...) -> critic_values (deps: actor_gen), ...
    self.update_actor(batch)                         -> actor_train (deps: all calls in batch)

Calls under a condition (GRPO's reference pass when the KL loss is on, Safe-RLHF's ptx step)
are included: the plan is for the algorithm with its options on.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from workbench.planner.dataflow import Call, Dataflow
from workbench.planner.errors import UnknownPresetError

# Stage method -> (role, call kind, call name) in the planner's vocabulary.
STAGE_CALLS = {
    "generate": ("actor", "generate", "actor_gen"),
    "old_log_probs": ("actor", "inference", "actor_logp"),
    "reference": ("reference", "inference", "ref_logp"),
    "values": ("critic", "inference", "critic_values"),
    "reward": ("reward", "inference", "reward"),
    "cost": ("cost", "inference", "cost"),
    "cost_values": ("cost_critic", "inference", "cost_critic_values"),
    "update_critic": ("critic", "train", "critic_train"),
    "update_actor": ("actor", "train", "actor_train"),
}
VALUE_ROLES = ("critic", "reward", "cost", "cost_critic")


class DeriveError(ValueError):
    """The algorithm's step() is not in a form the planner can read."""


def derive_dataflow(algorithm: type, name: str | None = None) -> Dataflow:
    """The dataflow of one iteration of `algorithm` (a subclass of algorithms.Algorithm)."""
    try:
        source = textwrap.dedent(inspect.getsource(algorithm.step))
    except (OSError, TypeError) as err:
        raise DeriveError(f"cannot read the source of {algorithm.__name__}.step: {err}") from None
    reader = _StepReader()
    reader.visit(ast.parse(source))
    if not reader.calls:
        raise DeriveError(f"{algorithm.__name__}.step makes no stage calls ({sorted(STAGE_CALLS)})")
    roles = {c.model for c in reader.calls}
    return Dataflow(
        name or algorithm.__name__.lower(), tuple(reader.calls), tuple(r for r in VALUE_ROLES if r in roles)
    )


class _StepReader(ast.NodeVisitor):
    def __init__(self):
        self.calls: list[Call] = []
        self.produced_by: dict[str, tuple[str, ...]] = {}  # variable -> calls its value came from

    def visit_Assign(self, node: ast.Assign) -> None:
        sources = self._sources(node.value)
        for target in node.targets:
            for name in _names(target):
                self.produced_by[name] = sources
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):  # batch["x"] = ...
                base = target.value.id
                self.produced_by[base] = tuple(dict.fromkeys(self.produced_by.get(base, ()) + sources))

    def visit_Expr(self, node: ast.Expr) -> None:
        self._sources(node.value)

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None:
            self._sources(node.value)

    def visit_If(self, node: ast.If) -> None:
        for statement in node.body + node.orelse:
            self.visit(statement)

    def _sources(self, node: ast.AST) -> tuple[str, ...]:
        """Record the stage calls inside `node` (innermost first); the calls its value comes from."""
        if isinstance(node, ast.Name):
            return self.produced_by.get(node.id, ())
        if isinstance(node, ast.Call) and _is_self_method(node.func) and node.func.attr in STAGE_CALLS:
            deps = self._arg_sources(node)
            return (self._add(node, deps),)
        out: tuple[str, ...] = ()
        for child in ast.iter_child_nodes(node):
            out += self._sources(child)
        return tuple(dict.fromkeys(out))

    def _arg_sources(self, node: ast.Call) -> tuple[str, ...]:
        deps: tuple[str, ...] = ()
        for arg in list(node.args) + [k.value for k in node.keywords]:
            deps += self._sources(arg)
        return tuple(dict.fromkeys(deps))

    def _add(self, node: ast.Call, deps: tuple[str, ...]) -> str:
        role, kind, call_name = STAGE_CALLS[node.func.attr]
        role = _role_argument(node) or role
        stage = next((k.value.value for k in node.keywords if k.arg == "stage" and isinstance(k.value, ast.Constant)), None)
        if stage:
            call_name = _call_name(role, stage)
        if any(c.name == call_name for c in self.calls):
            raise DeriveError(f"step() calls {call_name!r} twice; give one a stage=... name")
        if kind == "train":  # a model's updates apply in the order they were issued
            previous = [c.name for c in self.calls if c.model == role and c.kind == "train"]
            deps = tuple(dict.fromkeys(deps + tuple(previous[-1:])))
        self.calls.append(Call(call_name, role, kind, deps))
        return call_name


def _is_self_method(func: ast.AST) -> bool:
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"


def _role_argument(node: ast.Call) -> str | None:
    """A stage run on another group, e.g. update_critic(batch, self.groups.cost_critic, ...)."""
    for arg in list(node.args) + [k.value for k in node.keywords]:
        if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Attribute) and arg.value.attr == "groups":
            return arg.attr
    return None


def _call_name(role: str, stage: str) -> str:
    if stage.startswith("update_"):
        return f"{stage.removeprefix('update_')}_train"
    return stage if stage.startswith(role) else f"{role}_{stage}"


def _names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for element in target.elts for n in _names(element)]
    return []


def dataflow_preset(name: str) -> Dataflow:
    """The dataflow of a built-in algorithm (`algorithms.ALGORITHMS`: ppo, grpo, remax,
    safe_rlhf, rloo, reinforce_pp), read off its `step()` so plan and code cannot drift."""
    import algorithms  # on first use: the planner's other pieces load without the model stack

    key = name.lower().replace("-", "_")
    if key not in algorithms.ALGORITHMS:
        raise UnknownPresetError("dataflow", name, list(algorithms.ALGORITHMS))
    return derive_dataflow(algorithms.ALGORITHMS[key], key)
