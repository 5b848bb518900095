"""The run config: every setting of a headless run in one tree of typed dataclasses.

    config = load_config("configs/ppo.yaml", ["sampling.n=4", "actor.optim.lr=3e-5"])

Sections reuse the components' own configs (`ActorConfig`, `CriticConfig`, `SamplingConfig`,
`PromptLoaderConfig`, `ArithmeticConfig`, the algorithms' `*Config`), so a field means the same
here as in a notebook. YAML gives a mapping per section; overrides are `dotted.name=value`
with the value read as a YAML scalar (`4`, `3e-5`, `null`, `[+, -]`). An unknown or
mistyped field, at any depth, is a `ConfigError` naming the full dotted field and the nearest
valid name; a value of the wrong type names the field and the type expected.

The `algorithm` section is chosen by its `name` (one of `algorithms.ALGORITHMS`): its other
keys are fields of that algorithm's config (`PPOConfig`, `GRPOConfig`, ...), apart from
`sampling`, which is the run's own top-level section.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from algorithms import ALGORITHMS, AlgoConfig, PPOConfig
from workbench.data.arithmetic import ArithmeticConfig, CostConfig
from workbench.data.prompts import PromptLoaderConfig
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError
from workbench.workers.actor import ActorConfig
from workbench.workers.critic import CriticConfig

FROM_MODEL = "<model>"
"""actor.model_path / critic.model_path placeholder: take the directory from the model section."""


@dataclass
class ModelSection:
    """Where the policy (and the critics) start from."""

    path: str = ""
    """A local Hugging Face causal-LM directory for the actor and reference. Empty: the
    arithmetic kit's starting policy (the `tiny_size` model after `sft_steps` of SFT), made
    and cached in `cache_dir` on first use."""
    critic_path: str = ""
    """The critics' starting model (a value head is added); empty: the policy's."""
    tiny_size: str = "1m"
    """Kit size when `path` is empty: "1m", "10m" or "30m"."""
    sft_steps: int = 200
    """SFT steps of the kit's starting policy when `path` is empty."""
    cache_dir: str = ""
    """Where the kit's models are cached; empty: ~/.cache/hybridflow-workbench."""


@dataclass
class DataSection:
    """The task: prompts, held-out prompts, and the rule reward (and cost) that judge responses."""

    task: str = "arithmetic"
    """A task registered in workbench.data.tasks: its `score` is the reward, its `cost` the
    Safe-RLHF cost."""
    train_file: str = ""
    """Training prompts, JSONL or Parquet (columns prompt, ground_truth); empty: `train_size`
    arithmetic problems drawn with `arithmetic` (none shares an expression with the held-out set)."""
    eval_file: str = ""
    """Held-out prompts, same format; empty: `eval_size` arithmetic problems."""
    train_size: int = 256
    """Generated training problems (when `train_file` is empty)."""
    eval_size: int = 32
    """Generated held-out problems (when `eval_file` is empty)."""
    seed: int = 0
    """Seed of the generated problems (held-out ones use seed + 1)."""
    arithmetic: ArithmeticConfig = field(default_factory=lambda: ArithmeticConfig(digits=1))
    """Difficulty of the generated arithmetic problems."""
    cost: CostConfig = field(default_factory=CostConfig)
    """What the arithmetic task's cost counts as unsafe (Safe-RLHF)."""
    loader: PromptLoaderConfig = field(default_factory=lambda: PromptLoaderConfig(batch_size=8, max_prompt_length=32))
    """Prompts per iteration, order and length limit."""
    reward_timeout: float = 30.0
    """Seconds the reward (or cost) function may take on one chunk of rows before its process is killed."""


@dataclass
class PlacementSection:
    """Which devices each model runs on."""

    actor_devices: int = 1
    """Devices of the actor pool: actor, rollout and reference share one process per device
    (the hybrid engine), data parallel over them."""
    critic_devices: int = 1
    """Devices of the critic pool (the critic, and for Safe-RLHF the cost critic fused with it);
    0 puts the critics on the actor's pool (colocated: time-shared, in call order)."""
    num_devices: int = 0
    """Logical devices of the embedded Ray; 0: as many as the pools need. Ignored when the run
    is given a session or RAY_ADDRESS names a cluster."""
    threads_per_worker: int = 1
    """torch threads in each worker process."""


@dataclass
class LoggingSection:
    """What the run writes, and where."""

    output_dir: str = ""
    """Everything the run writes goes here; empty: runs/<name>. A fresh run (checkpoint.resume
    false) replaces the run files a previous run left there."""
    tensorboard: bool = True
    """TensorBoard event files under <output_dir>/tensorboard."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package)."""
    wandb_project: str = "hybridflow-workbench"
    rollouts_every: int = 1
    """Every k iterations, the iteration's prompts, responses, rewards/costs and per-token
    advantages go to <output_dir>/rollouts.jsonl (0 = never)."""
    rollout_rows: int = 16
    """Rows of each logged iteration written (the first ones); 0 = all."""
    progress: bool = True
    """A tqdm progress bar (on stderr)."""
    print_every: int = 0
    """Print one metrics line every k iterations (0 = never; the progress bar shows the latest)."""


@dataclass
class CheckpointSection:
    """Whole-run checkpoints (workbench.run.checkpoint): weights, optimizers, RNGs, algorithm state."""

    every: int = 10
    """Save every k iterations and after the last one (0 = never)."""
    directory: str = ""
    """Where checkpoints go; empty: <output_dir>/checkpoints."""
    keep: int = 3
    """Newest checkpoints kept."""
    resume: bool = False
    """Continue from the newest checkpoint in `directory` (a fresh run when there is none)."""
    export_hf: bool = False
    """At the end, export the actor (and critic) as plain Hugging Face directories under <output_dir>/hf."""


@dataclass
class EvaluationSection:
    """Held-out evaluation: greedy responses to the held-out prompts, scored by the task's rules."""

    every: int = 0
    """Evaluate every k iterations and after the last one (0 = never)."""
    at_start: bool = True
    """Also evaluate before the first iteration (when `every` > 0)."""
    max_new_tokens: int = 0
    """Response length for evaluation; 0: sampling.max_new_tokens."""


@dataclass
class FaultSection:
    """What the run does when something fails mid-iteration."""

    max_recoveries: int = 2
    """Times a dead worker group is restarted on its pool (session.recover), every group reloaded
    from the last checkpoint, and the failed iteration redone; 0 = stop at the first death.
    Needs checkpoint.every >= 1."""
    reward_retries: int = 0
    """Times an iteration whose reward or cost function raised or ran out of time is retried
    before the run stops with the error naming the row (0 = stop at once)."""


@dataclass
class RunConfig:
    """A headless run: `python -m workbench run config.yaml [field=value ...]`."""

    name: str = "run"
    """Names the run (and its default output directory runs/<name>)."""
    iterations: int = 10
    """Algorithm steps to run (one prompt batch each)."""
    seed: int = 0
    """Seeds the driver's random generators (the other seeds are in their sections)."""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    algorithm: AlgoConfig = field(default_factory=PPOConfig)
    """Chosen by `name` (ppo, grpo, remax, safe_rlhf, rloo, reinforce_pp); the other keys are
    that algorithm's config fields, except `sampling` (the top-level section)."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=6, n=2, seed=0))
    """How responses are sampled during training (evaluation is greedy)."""
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(model_path=FROM_MODEL))
    """The policy's optimisation (optim, batch sizes, epochs, backend) and rollout; model_path
    "<model>" (the default) means the model section's, and temperature follows sampling.temperature."""
    critic: CriticConfig = field(default_factory=lambda: CriticConfig(model_path=FROM_MODEL))
    """The critics' optimisation (for algorithms with a critic); model_path "<model>" (the
    default) means model.critic_path, or else the policy's."""
    logging: LoggingSection = field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    faults: FaultSection = field(default_factory=FaultSection)

    @property
    def algorithm_name(self) -> str:
        return algorithm_name(self.algorithm)

    @property
    def output_dir(self) -> Path:
        return Path(self.logging.output_dir or Path("runs") / self.name)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.directory) if self.checkpoint.directory else self.output_dir / "checkpoints"

    def validate(self) -> None:
        """Checks across sections (each section's own fields were checked when it was built)."""
        for where in ("iterations", "placement.actor_devices", "placement.threads_per_worker"):
            _at_least(self, where, 1)
        for where in ("placement.critic_devices", "placement.num_devices", "checkpoint.every", "checkpoint.keep",
                      "evaluation.every", "evaluation.max_new_tokens", "logging.rollouts_every", "logging.rollout_rows",
                      "logging.print_every", "faults.max_recoveries", "faults.reward_retries",
                      "data.train_size", "data.eval_size", "model.sft_steps"):
            _at_least(self, where, 0)
        if self.checkpoint.keep < 1 and self.checkpoint.every:
            raise ConfigError("checkpoint.keep", self.checkpoint.keep, "keep at least 1 checkpoint")
        if self.faults.max_recoveries and not self.checkpoint.every:
            raise ConfigError("faults.max_recoveries", self.faults.max_recoveries,
                              "recovery reloads the last checkpoint: set checkpoint.every >= 1, or faults.max_recoveries=0")
        if self.checkpoint.resume and not self.checkpoint.every:
            raise ConfigError("checkpoint.resume", True, "resuming needs checkpoints: set checkpoint.every >= 1")
        if self.logging.wandb:
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise ConfigError("logging.wandb", True, "the wandb package is not installed (pip install wandb), "
                                                         "or set logging.wandb=false") from None
        if self.data.reward_timeout <= 0:
            raise ConfigError("data.reward_timeout", self.data.reward_timeout, "give the seconds allowed, > 0")

    def to_dict(self) -> dict[str, Any]:
        """Plain values (YAML-writable) that `from_dict` turns back into this config."""
        out = _plain(self)
        out["algorithm"] = {"name": self.algorithm_name, **{k: v for k, v in out["algorithm"].items() if k != "sampling"}}
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        config = build(cls, values, "")
        config.validate()
        return config


# ---- loading ----------------------------------------------------------------------------------
def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A RunConfig from a YAML file (or the defaults) with `dotted.name=value` overrides applied."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError("config file", str(path), "no such file")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ConfigError("config file", str(path), "the YAML must be a mapping of sections (model:, data:, ...)")
    for override in overrides:
        apply_override(values, override)
    return RunConfig.from_dict(values)


def apply_override(values: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in nested dicts (value parsed as a YAML scalar)."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError("override", override, "write overrides as dotted.field=value, e.g. sampling.n=4")
    parts = key.strip().split(".")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(key, text, f"not a YAML value ({error.problem})") from None
    node = values
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), child, f"is a value, not a section; cannot set {key}")
        node = child
    node[parts[-1]] = value


def algorithm_name(config: AlgoConfig) -> str:
    for name, cls in ALGORITHMS.items():
        if type(config) is cls.Config:
            return name
    raise ConfigError("algorithm", type(config).__name__, f"not the config of one of {sorted(ALGORITHMS)}")


def build(cls: type, values: Any, path: str, base: Any = None):
    """An instance of dataclass `cls` from a mapping, on top of `base` (default: cls's defaults):
    nested sections recurse, values are checked against the fields' types, and the class's own
    checks (__post_init__) run with their errors placed at `path`."""
    if dataclasses.is_dataclass(values) and isinstance(values, cls):
        return values
    if not isinstance(values, dict):
        raise ConfigError(path or "config", values, f"expected a mapping of {cls.__name__}'s fields")
    values = dict(values)
    if cls is AlgoConfig or (isinstance(cls, type) and issubclass(cls, AlgoConfig)):
        cls, base = _algorithm_class(values, path, base)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    hidden = {"sampling"} if issubclass(cls, AlgoConfig) else set()
    changes = {}
    for key, value in values.items():
        where = f"{path}.{key}" if path else str(key)
        if key in hidden:
            raise ConfigError(where, value, f"{key} is the run's own top-level section: write {key}.<field> instead")
        if key not in fields:
            raise unknown_field(where, value, list(fields), path)
        current = getattr(base, key) if base is not None else _default(fields[key])
        changes[key] = convert(value, hints[key], where, current)
    try:
        if base is not None:
            return dataclasses.replace(base, **changes)
        return cls(**changes)
    except ConfigError as error:  # the class's own check: name the field by its run-config path
        head, _, rest = error.where.partition(".")
        where = f"{path}.{rest}" if path and rest and head == cls.__name__ else f"{path} ({error.where})" if path else error.where
        raise ConfigError(where, error.value, error.fix) from None
    except (TypeError, ValueError) as error:
        raise ConfigError(path or cls.__name__, values, str(error)) from None


def _algorithm_class(values: dict, path: str, base: Any) -> tuple[type, Any]:
    name = values.pop("name", None)
    if name is None:
        return type(base) if base is not None else PPOConfig, base
    if name not in ALGORITHMS:
        raise unknown_field(f"{path}.name", name, list(ALGORITHMS), path, what="algorithm")
    cls = ALGORITHMS[name].Config
    return cls, (base if type(base) is cls else None)


def unknown_field(where: str, value: Any, valid: list[str], section: str, what: str = "field") -> ConfigError:
    last = where.rsplit(".", 1)[-1]
    near = difflib.get_close_matches(str(last) if what == "field" else str(value), valid, n=1, cutoff=0.5)
    prefix = f"{section}." if section and what == "field" else ""
    hint = f"did you mean {prefix + near[0]!r}? " if near else ""
    listing = ", ".join(sorted(valid))
    return ConfigError(where, value, f"no such {what}{' in ' + repr(section) if section else ''}; {hint}valid: {listing}")


def convert(value: Any, hint: Any, where: str, current: Any = None) -> Any:
    """`value` checked against the type `hint` (ints widen to floats, lists to tuples)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return convert(value, arm, where, current)
            except ConfigError as error:
                errors.append(error)
        raise ConfigError(where, value, f"expected {_name(hint)}") from None
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(where, value, f"use one of {list(args)}")
    if dataclasses.is_dataclass(hint):
        base = current if isinstance(current, hint) else None
        return build(hint, value, where, base)
    if origin in (tuple, list) or hint in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(where, value, f"expected a list ({_name(hint)})")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(where, value, f"expected {len(args)} values ({_name(hint)})")
            items = [convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            item = args[0] if args else Any
            items = [convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or hint) is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(where, value, "expected a mapping")
        return value
    if origin is not None and callable(value):  # e.g. Callable[...]
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(where, value, "expected true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(where, value, "expected a whole number")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-5 (no dot) as text
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(where, value, "expected a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(where, value, "expected text (quote it in YAML)")
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ConfigError(where, value, f"expected {_name(hint)}")
    return value


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _at_least(config: RunConfig, where: str, low: int) -> None:
    value = config
    for part in where.split("."):
        value = getattr(value, part)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(where, value, f"use a whole number >= {low}")


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    return value
