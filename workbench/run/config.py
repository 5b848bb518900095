"""The run config: every setting of a headless run in one tree of typed dataclasses.

    config = load_config("configs/ppo.yaml", ["sampling.n=4", "actor.optim.lr=3e-5"])

Sections reuse the components' own configs (`ActorConfig`, `CriticConfig`, `SamplingConfig`,
`PromptLoaderConfig`, `ArithmeticConfig`, the algorithms' `*Config`), so a field means the same
here as in a notebook. YAML gives a mapping per section; overrides are `dotted.name=value`
with the value read as a YAML scalar (`4`, `3e-5`, `null`, `[+, -]`). An unknown or
mistyped field, at any depth, is a `ConfigError` naming the full dotted field and the nearest
valid name; a value of the wrong type names the field and the type expected (the loader is
workbench.config_loader, shared with every other config; `RunLoader` adds the run's rules).

The `algorithm` section is chosen by its `name` (one of `algorithms.ALGORITHMS`): its other
keys are fields of that algorithm's config (`PPOConfig`, `GRPOConfig`, ...), apart from
`sampling`, which is the run's own top-level section.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from algorithms import ALGORITHMS, AlgoConfig, PPOConfig
from workbench import checks
from workbench.config_loader import Loader, read, to_plain, unknown_field
from workbench.controller.resource_pool import LOST_HOST
from workbench.data.arithmetic import ArithmeticConfig, CostConfig
from workbench.data.prompts import PromptLoaderConfig
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError
from workbench.workers.actor import ActorConfig
from workbench.workers.critic import CriticConfig

HELD_OUT = ("same", "harder")
SOURCES = ("", "reasoning_gym")
CRITIC_BESIDE = ("actor", "rollout")
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
class RewardSection:
    """One reward function of `data.rewards` (a plain string is `function` alone)."""

    function: str | Callable = ""
    """`path/to/file.py:function`, `package.module:function`, or a built-in: math_verify,
    reasoning_gym, or a registered task's name (workbench.data.rewards); in Python, the function."""
    name: str = ""
    """Its name in the metrics (`reward/<name>/mean`); empty: the function's name."""
    weight: float = 1.0
    """Its weight in the score (the weighted sum of every reward's value)."""
    fallback: float | None = None
    """What a row scores when the function raises, returns no number or runs out of time (counted
    in `reward/fallbacks`); null: the failure stops the iteration (see faults.reward_retries)."""


@dataclass
class JudgeSection:
    """An LLM judge as a reward (data.judge): a local chat model reads each response through a
    rubric and its verdict is the score (workbench.workers.judge)."""

    model_path: str = ""
    """The judge's chat model directory; empty: the policy's starting model (frozen)."""
    template: str = ""
    """The rubric, with {prompt}, {response} and {ground_truth} places; empty: the default (does
    the answer agree with the reference answer? yes or no)."""
    verdict: str = "yes_no"
    """How a verdict becomes a score: "yes_no" (1 or 0) or "score" (the first number, on 0-10)."""
    fallback: float | None = None
    """What an unreadable verdict scores (counted in reward/fallbacks); null: it is an error."""
    system: str = ""
    """A system message before the rubric."""
    max_new_tokens: int = 16
    """Tokens of a verdict (greedy)."""
    max_prompt_length: int = 512
    """Tokens of a rubric filled in; a longer one loses its beginning."""
    weight: float = 1.0
    """The judge's weight in the score, beside data.rewards (each with its own)."""
    devices: int = 0
    """Devices of the judge's own pool; 0: in the actor's processes (colocated, time-shared)."""


@dataclass
class DataSection:
    """The task: prompts, held-out prompts, and the rewards (and cost) that judge responses."""

    task: str = "arithmetic"
    """A task registered in workbench.data.tasks: its `score` is the reward (unless `rewards` are
    given), its `cost` the Safe-RLHF cost (unless `cost_function` is), its `prompt` how generated
    problems are put (`arithmetic_chat`: as chat messages, for models with a chat template)."""
    source: str = ""
    """Where the prompts come from: "" (`train_file`, or else the task's generated problems) or
    "reasoning_gym" (the reasoning-gym dataset `name`, scored by its own scorer unless `rewards`
    are given)."""
    name: str = ""
    """The reasoning-gym dataset (source: reasoning_gym), e.g. "basic_arithmetic", "chain_sum"."""
    options: dict = field(default_factory=dict)
    """The reasoning-gym dataset's settings (its config's fields, e.g. {min_terms: 2, max_terms: 2})."""
    system_prompt: str = ""
    """A system message put before each reasoning-gym question (empty: the question alone)."""
    train_file: str = ""
    """Training prompts: a JSONL or Parquet file (verl's format as it is), or a Hugging Face
    dataset (a `save_to_disk` directory, or files `datasets.load_dataset` reads); empty:
    `train_size` arithmetic problems drawn with `arithmetic` (none shares an expression with the
    held-out set)."""
    eval_file: str = ""
    """Held-out prompts, same forms (the same dataset directory with another `eval_split` too);
    with a train_file, give this or `eval_fraction`."""
    eval_fraction: float = 0.0
    """Hold out this fraction of the train_file's rows instead of an eval_file (seeded by `seed`)."""
    train_split: str = "train"
    """The split of a Hugging Face dataset with several (train_file)."""
    eval_split: str = "test"
    """The split of a Hugging Face dataset with several (eval_file)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Where the prompt and the ground truth are in the files' rows, dotted for nested columns:
    {prompt: question, ground_truth: reward_model.ground_truth}. Empty: `prompt` and
    `ground_truth` (else verl's `reward_model.ground_truth`). Every other column reaches the
    reward functions and rollouts.jsonl."""
    rewards: list[RewardSection | str] = field(default_factory=list)
    """Reward functions by reference, weighted into the score, each logged as `reward/<name>/mean`
    (a string, or {function, name, weight, fallback}); empty: the task's (or reasoning-gym's)."""
    cost_function: str = ""
    """The Safe-RLHF cost by reference (called as a reward is; > 0 is unsafe); empty: the task's."""
    judge: JudgeSection | None = None
    """An LLM judge as a reward (alone, or beside `rewards`); null: none."""
    environment: str = ""
    """Multi-turn episodes in this environment, which scores them: `skyrl:<env id>` (skyrl-gym's
    text environments, run in the tool jail) or `path/to/file.py:make_env` / `module:make_env`
    (a factory returning a workbench.agents.Environment); turn limits in algorithm.episode.
    Empty: one response per prompt, scored by the rewards."""
    environment_options: dict = field(default_factory=dict)
    """Keyword arguments of the environment (skyrl: env_config, max_turns)."""
    train_size: int = 256
    """Generated training problems (when `train_file` is empty)."""
    eval_size: int = 32
    """Generated held-out problems (when `eval_file` is empty)."""
    held_out: str = "same"
    """Difficulty of the generated held-out problems: "same" as training (none shares an
    expression with a training problem), or "harder" (every operand one digit longer than
    training's longest, workbench.data.arithmetic.harder: disjoint by construction)."""
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
    rollout_devices: int = 0
    """Devices of a rollout group of its own (generation only; the actor then does not generate
    and its weights are pushed to it after each update); 0: the actor generates (hybrid engine).
    Needed by `asynchronous`."""
    critic_devices: int = 1
    """Devices of the critic pool (the critic, and for Safe-RLHF the cost critic fused with it);
    0 puts the critics beside another model (colocated: time-shared, in call order): see
    `critic_beside`."""
    critic_beside: str = "actor"
    """With critic_devices 0, whose processes the critics share: "actor" (the actor's pool), or
    "rollout" (the rollout group's, placement.rollout_devices >= 1: the critic then scores and
    trains while the actor trains, which balances an asynchronous PPO run whose generation is
    short)."""
    hosts: dict[str, list[str]] = field(default_factory=dict)
    """On a cluster, the hosts of a pool (actor, rollout, critic, judge -> node addresses or
    ids); its devices spread evenly over them, e.g. {actor: [10.0.0.1, 10.0.0.2]} with
    actor_devices 2 puts one rank on each. A pool not named fills nodes in order."""
    num_devices: int = 0
    """Logical devices of the embedded Ray; 0: as many as the pools need. Ignored when the run
    is given a session or RAY_ADDRESS names a cluster."""
    threads_per_worker: int = 1
    """torch threads in each worker process."""
    plan: Any = None
    """Place the models by a planner plan instead of the fields above (which then keep their
    defaults): "automap" (the auto-mapper's plan for the run's models and workload on this
    machine's cluster: the calibrated local cluster when `calibration` exists, else the
    placeholder preset), "search" (ReaLHF's search on the same cluster, over the per-call plans
    this runtime deploys: every call on its own mesh), a plan written as a mapping (model-level:
    `sets:` with `devices` and, per model, pp/tp/dp and the actor's `generation` layout,
    workbench.planner.plan_io; per-call: `calls:`, workbench.planner.call_plan_io), or the path
    of a YAML file holding one. null: the hand-written pools above."""
    calibration: str = ".cache/planner/local-calibration.json"
    """This machine's planner calibration (`bench/calibration.py --save PATH`, or
    `workbench.deploy.profiler.calibrate(session, models).save(PATH)`); used to price a plan when
    the file exists."""


@dataclass
class AsynchronousSection:
    """Generation of the next batches overlapping training on this one (algorithms.asynchronous)."""

    enabled: bool = False
    """Launch generations ahead on the rollout group (placement.rollout_devices >= 1)."""
    max_staleness: int = 1
    """How many updates old the weights that generated a batch may be when it is trained
    (0: launch nothing ahead, the synchronous run)."""


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
    lost_host: str = "remaining"
    """When a host of the dead group's pool is gone: "remaining" reserves the pool again on the
    cluster's remaining capacity, "rejoin" waits (rejoin_wait_s) for the host to be back."""
    rejoin_wait_s: float = 300.0
    """How long a recovery waits for the pool's devices (lost_host "rejoin": for the lost hosts)."""
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
    time_limit_s: float = 0.0
    """Stop after the first iteration that ends this many seconds into the run (training and
    evaluation, `run/elapsed_s` in the metrics), evaluated and saved as the last; 0: no limit."""
    seed: int = 0
    """Seeds the driver's random generators (the other seeds are in their sections)."""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    asynchronous: AsynchronousSection = field(default_factory=AsynchronousSection)
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
        for where, low in _COUNTS.items():
            section, _, name = where.rpartition(".")
            checks.whole(section, name, _field(self, where), low)
        if self.checkpoint.every:
            checks.whole("checkpoint", "keep", self.checkpoint.keep, 1, fix="keep at least 1 checkpoint")
        if self.faults.max_recoveries and not self.checkpoint.every:
            raise ConfigError(
                "faults.max_recoveries",
                self.faults.max_recoveries,
                "recovery reloads the last checkpoint: set checkpoint.every >= 1, or faults.max_recoveries=0",
            )
        if self.asynchronous.enabled and not self.placement.rollout_devices:
            raise ConfigError(
                "placement.rollout_devices",
                0,
                "asynchronous.enabled generates on a rollout group of its own: give it >= 1 device",
            )
        self.check_critic_beside()
        self.check_hosts()
        checks.one_of("faults", "lost_host", self.faults.lost_host, LOST_HOST)
        checks.real("faults", "rejoin_wait_s", self.faults.rejoin_wait_s, 0, low_open=True, fix="give seconds > 0")
        if self.checkpoint.resume and not self.checkpoint.every:
            raise ConfigError("checkpoint.resume", True, "resuming needs checkpoints: set checkpoint.every >= 1")
        if self.logging.wandb:
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "logging.wandb",
                    True,
                    "the wandb package is not installed (pip install wandb), or set logging.wandb=false",
                ) from None
        self.check_plan()
        checks.one_of("data", "held_out", self.data.held_out, HELD_OUT)
        self.check_data()
        checks.real("", "time_limit_s", self.time_limit_s, 0, fix="give seconds >= 0 (0: no limit)")
        checks.real(
            "data", "reward_timeout", self.data.reward_timeout, 0, low_open=True, fix="give the seconds allowed, > 0"
        )

    def check_data(self) -> None:
        """Where the prompts come from, and held-out prompts for a training file."""
        data = self.data
        checks.one_of("data", "source", data.source, SOURCES)
        if data.source == "reasoning_gym" and not data.name:
            raise ConfigError("data.name", "", "name the reasoning-gym dataset, e.g. data.name=basic_arithmetic")
        if data.source and data.train_file:
            raise ConfigError(
                "data.train_file", data.train_file, f"data.source={data.source} makes its own prompts: drop one"
            )
        checks.real("data", "eval_fraction", data.eval_fraction, 0, 1, high_open=True, fix="give a fraction in [0, 1)")
        if data.train_file and not data.eval_file and not data.eval_fraction:
            raise ConfigError(
                "data.eval_file",
                "",
                "a train_file needs held-out prompts of the same task: give data.eval_file, or hold out "
                "part of the training rows with data.eval_fraction=0.1",
            )
        if data.judge is not None and self.placement.plan is not None:
            raise ConfigError("data.judge", "...", "a judge runs with hand-written pools: set placement.plan=null")
        if data.environment and (data.judge is not None or data.rewards):
            raise ConfigError(
                "data.environment", data.environment, "an environment scores its own episodes: drop data.rewards/judge"
            )
        if data.source and (data.eval_file or data.eval_fraction or data.columns):
            raise ConfigError(
                "data.source",
                data.source,
                "makes its own prompts and held-out set (eval_size, seed): drop data.eval_file, eval_fraction, columns",
            )
        if data.eval_file and data.eval_fraction:
            raise ConfigError("data.eval_fraction", data.eval_fraction, "data.eval_file is the held-out set: drop one")
        if data.judge is not None:
            checks.whole("data.judge", "devices", data.judge.devices, 0)
            checks.real("data.judge", "weight", data.judge.weight, fix="give a finite weight")
        for key in data.columns:
            if key not in ("prompt", "ground_truth"):
                raise ConfigError(
                    f"data.columns.{key}",
                    data.columns[key],
                    "map prompt and ground_truth (the other columns come as they are)",
                )

    def check_critic_beside(self) -> None:
        place = self.placement
        checks.one_of("placement", "critic_beside", place.critic_beside, CRITIC_BESIDE)
        if place.critic_beside == "rollout" and not place.rollout_devices:
            raise ConfigError(
                "placement.critic_beside",
                "rollout",
                "the critics share the rollout group's processes: give it devices (placement.rollout_devices "
                '>= 1) or use critic_beside="actor"',
            )
        if place.critic_beside == "rollout" and place.critic_devices:
            raise ConfigError(
                "placement.critic_devices",
                place.critic_devices,
                'critic_beside="rollout" puts the critics in the rollout group\'s processes: set '
                "placement.critic_devices=0 (or drop critic_beside for a critic pool of its own)",
            )

    def check_hosts(self) -> None:
        place = self.placement
        devices = {"actor": place.actor_devices, "rollout": place.rollout_devices, "critic": place.critic_devices}
        devices["judge"] = self.data.judge.devices if self.data.judge is not None else 0
        if not isinstance(place.hosts, dict):
            fix = "give {pool: [host address, ...]}, e.g. {actor: [10.0.0.1]}"
            raise ConfigError("placement.hosts", place.hosts, fix)
        for pool, hosts in place.hosts.items():
            field_name = f"placement.hosts.{pool}"
            if pool not in devices:
                raise ConfigError(field_name, hosts, f"name a pool of the run: {sorted(devices)}")
            if not (isinstance(hosts, list) and hosts and all(isinstance(h, str) and h for h in hosts)):
                raise ConfigError(field_name, hosts, "give a list of host addresses (or Ray node ids)")
            if not devices[pool] or devices[pool] % len(hosts):
                raise ConfigError(
                    field_name,
                    hosts,
                    f"the {pool} pool's {devices[pool]} device(s) must spread evenly over {len(hosts)} host(s)",
                )
        if place.hosts and place.plan is not None:
            raise ConfigError("placement.hosts", place.hosts, "placement.plan places every model: drop one of them")

    def check_plan(self) -> None:
        """placement.plan's form (the plan itself is read and checked by build.run_plan)."""
        place, plan = self.placement, self.placement.plan
        if plan is None:
            return
        if not isinstance(plan, (str, dict)) or plan == "":
            raise ConfigError(
                "placement.plan",
                plan,
                'give "automap", "search", a plan mapping (sets: ... or calls: ...) or the path of a YAML plan '
                "file; or null for the hand-written pools",
            )
        hand = {
            name: getattr(place, name)
            for name, default in (
                ("actor_devices", 1),
                ("critic_devices", 1),
                ("rollout_devices", 0),
                ("critic_beside", "actor"),
            )
            if getattr(place, name) != default
        }
        if hand:
            name, value = next(iter(hand.items()))
            raise ConfigError(
                f"placement.{name}",
                value,
                "placement.plan places every model: give the plan or the hand-written pools "
                "(actor_devices, critic_devices, rollout_devices), not both",
            )
        if self.asynchronous.enabled:
            raise ConfigError(
                "asynchronous.enabled",
                True,
                "a planned run is synchronous for now (an asynchronous plan needs a rollout set the YAML "
                "form does not have yet): set asynchronous.enabled=false or drop placement.plan",
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain values (YAML-writable) that `from_dict` turns back into this config."""
        out = to_plain(self)
        out["algorithm"] = {
            "name": self.algorithm_name,
            **{k: v for k, v in out["algorithm"].items() if k != "sampling"},
        }
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        config = RUN_LOADER.build(cls, values, "")
        config.validate()
        return config


_COUNTS = {
    "iterations": 1,
    "placement.actor_devices": 1,
    "placement.threads_per_worker": 1,
    **dict.fromkeys(
        (
            "placement.critic_devices",
            "placement.rollout_devices",
            "asynchronous.max_staleness",
            "placement.num_devices",
            "checkpoint.every",
            "checkpoint.keep",
            "evaluation.every",
            "evaluation.max_new_tokens",
            "logging.rollouts_every",
            "logging.rollout_rows",
            "logging.print_every",
            "faults.max_recoveries",
            "faults.reward_retries",
            "data.train_size",
            "data.eval_size",
            "model.sft_steps",
        ),
        0,
    ),
}
"""The run's whole-number fields and the least each may be (checked again by `validate`, so a
config edited in Python is checked like one read from YAML)."""


def _field(config: RunConfig, where: str) -> Any:
    value = config
    for part in where.split("."):
        value = getattr(value, part)
    return value


# ---- loading ----------------------------------------------------------------------------------
class RunLoader(Loader):
    """The workbench's loader with the run config's two rules: the `algorithm` section's class is
    chosen by its `name`, and its `sampling` is the run's own top-level section."""

    def choose(self, cls: type, values: dict, path: str, base: Any) -> tuple[type, Any]:
        if not (isinstance(cls, type) and issubclass(cls, AlgoConfig)):
            return cls, base
        name = values.pop("name", None)
        if name is None:
            return (type(base) if base is not None else PPOConfig), base
        if name not in ALGORITHMS:
            raise unknown_field(f"{path}.name", name, list(ALGORITHMS), path, what="algorithm")
        chosen = ALGORITHMS[name].Config
        return chosen, (base if type(base) is chosen else None)

    def hidden(self, cls: type) -> dict[str, str]:
        if isinstance(cls, type) and issubclass(cls, AlgoConfig):
            return {"sampling": "sampling is the run's own top-level section: write sampling.<field> instead"}
        return {}


RUN_LOADER = RunLoader()


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A RunConfig from a YAML file (or the defaults) with `dotted.name=value` overrides applied."""
    return RunConfig.from_dict(read(path, overrides, what="sections (model:, data:, ...)"))


def algorithm_name(config: AlgoConfig) -> str:
    for name, cls in ALGORITHMS.items():
        if type(config) is cls.Config:
            return name
    raise ConfigError("algorithm", type(config).__name__, f"not the config of one of {sorted(ALGORITHMS)}")
