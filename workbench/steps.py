"""The steps of one RLHF iteration: one table, one name per step.

A step is one thing an algorithm does per iteration: a call on a worker group (generate, a
forward, an update) or a piece of driver-side numerics (KL shaping, advantages). Its name is
used everywhere the step shows: the step clock's labels and metrics (`timing_s/<name>`), the
trace tag (`extra["step"]`), the planner's model function calls, the widgets and the
finite-value guard's messages. The names are verl's timing names where verl has the step.

Each row names the `algorithms.Algorithm` method that runs the step (or a subclass's:
Safe-RLHF's `cost`, `cost_values`). A method that runs several steps takes the step's name
(`self.generate(prompts, greedy, step="gen_greedy", new_iteration=False)`); its first row
here is the step it runs by default. `table()` prints the table. Pure data: nothing here
imports the rest of the workbench.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StepKind = Literal["generate", "inference", "train", "driver"]
DRIVER = "driver"
"""The role of driver-side steps (numerics in the controller's process, no worker group)."""


@dataclass(frozen=True)
class Step:
    """One row of the table: a step of an RLHF iteration."""

    name: str
    """The one name: clock label, `timing_s/<name>`, trace tag `extra["step"]`, planner call name."""
    algorithm_method: str
    """The Algorithm method that runs it, e.g. "generate"."""
    role: str
    """The worker group's role ("actor", "critic", ...), or "driver" for driver-side numerics."""
    kind: StepKind
    """generate (decoding), inference (forward only), train (forward, backward, optimizer step), driver."""
    worker_method: str | None
    """The registered worker method it calls, e.g. "generate_sequences"; None for driver steps."""
    produces: tuple[str, ...] = ()
    """The fields it adds to the iteration's batch (its result's fields as `Algorithm.collect`
    joins them, or what the driver step writes); updates give metrics only."""
    about: str = ""


_GENERATED = (
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rollout_log_probs",
    "response_text",
)

STEPS: tuple[Step, ...] = (
    #    name                  Algorithm method  role           kind         worker method
    #    produces, about
    Step("gen",                "generate",       "actor",       "generate",  "generate_sequences",
         _GENERATED, "sample responses to the prompts (the hybrid engine's rollout)"),
    Step("gen_greedy",         "generate",       "actor",       "generate",  "generate_sequences",
         (), "ReMax: the greedy response to each prompt, scored for its baseline, then dropped"),
    Step("old_log_prob",       "old_log_probs",  "actor",       "inference", "compute_log_prob",
         ("old_log_probs", "entropy"),
         "log pi_old of the sampled tokens under the training weights (skipped when the rollout's are reused)"),
    Step("ref",                "reference",      "reference",   "inference", "compute_ref_log_prob",
         ("ref_log_probs",), "log-probs under the frozen reference policy"),
    Step("values",             "values",         "critic",      "inference", "compute_values",
         ("values",), "the critic's V_old per response token"),
    Step("reward",             "reward",         "reward",      "inference", "compute_reward",
         ("scores", "token_level_scores"), "score each response (reward model or rule)"),
    Step("reward_greedy",      "reward",         "reward",      "inference", "compute_reward",
         ("reward_baselines",), "ReMax: score the greedy responses; each prompt's score is its samples' baseline"),
    Step("cost",               "cost",           "cost",        "inference", "compute_cost",
         ("costs", "token_level_costs"), "Safe-RLHF: the cost of each response (cost model or rule)"),
    Step("cost_values",        "cost_values",    "cost_critic", "inference", "compute_values",
         ("cost_values",), "Safe-RLHF: the cost critic's values"),
    Step("reward_shaping",     "shape_rewards",  DRIVER,        "driver",    None,
         ("token_level_rewards", "token_level_kl", "token_level_cost_rewards"),
         "fold the KL to the reference into the rewards (Safe-RLHF: into the costs too)"),
    Step("adv",                "advantages",     DRIVER,        "driver",    None,
         ("advantages", "returns", "cost_advantages", "cost_returns"),
         "advantages and returns from the registered estimator (Safe-RLHF: for the costs too)"),
    Step("update_critic",      "update_critic",  "critic",      "train",     "update_critic",
         (), "the critic's update"),
    Step("update_cost_critic", "update_critic",  "cost_critic", "train",     "update_critic",
         (), "Safe-RLHF: the cost critic's update"),
    Step("update_actor",       "update_actor",   "actor",       "train",     "update_actor",
         (), "the policy's update"),
    Step("update_ptx",         "update_actor",   "actor",       "train",     "update_actor",
         (), "Safe-RLHF's PPO-ptx: an actor update on pre-training rows"),
)  # fmt: skip

BY_NAME: dict[str, Step] = {s.name: s for s in STEPS}


def get(name: str) -> Step:
    """The row named `name`; a KeyError naming the known steps otherwise."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no step {name!r}; the steps are {list(BY_NAME)}") from None


def default_step(algorithm_method: str) -> Step | None:
    """The step an Algorithm method runs when no step name is given (its first row), or None."""
    return next((s for s in STEPS if s.algorithm_method == algorithm_method), None)


def producer_of(field: str) -> str | None:
    """The step that first makes `field` in an iteration (table order), or None."""
    return next((s.name for s in STEPS if field in s.produces), None)


def table() -> str:
    """The table as text, one row per step."""
    head = ("name", "Algorithm method", "role", "kind", "worker method", "produces")
    rows = [head] + [
        (s.name, s.algorithm_method, s.role, s.kind, s.worker_method or "-", ", ".join(s.produces) or "-")
        for s in STEPS
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


# The rows the shared Algorithm methods run by default, for code that names a step.
GEN, OLD_LOG_PROB, REF, VALUES, REWARD = (BY_NAME[n] for n in ("gen", "old_log_prob", "ref", "values", "reward"))
GEN_GREEDY, REWARD_GREEDY = BY_NAME["gen_greedy"], BY_NAME["reward_greedy"]
COST, COST_VALUES, REWARD_SHAPING, ADV = (BY_NAME[n] for n in ("cost", "cost_values", "reward_shaping", "adv"))
UPDATE_CRITIC, UPDATE_COST_CRITIC = BY_NAME["update_critic"], BY_NAME["update_cost_critic"]
UPDATE_ACTOR, UPDATE_PTX = BY_NAME["update_actor"], BY_NAME["update_ptx"]
