"""The run config: YAML plus overrides into typed sections; every wrong field or value is named
with its full dotted path (and the nearest valid name). Pure: no Ray, no models."""

from pathlib import Path

import pytest
import yaml

from algorithms import GRPOConfig, PPOConfig, SafeRLHFConfig
from workbench.errors import ConfigError
from workbench.run.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, values) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_yaml_and_overrides_build_typed_sections(tmp_path):
    path = write(
        tmp_path,
        {
            "name": "t",
            "algorithm": {"name": "grpo", "kl_loss_coef": 0.02},
            "sampling": {"n": 4, "max_new_tokens": 5},
            "actor": {"optim": {"lr": 1e-4}},
        },
    )
    config = load_config(
        path,
        [
            "sampling.n=8",
            "actor.optim.lr=3e-5",
            "data.arithmetic.operations=[+, -]",
            "iterations=7",
            "sampling.seed=null",
            "critic.optim.betas=[0.8, 0.9]",
        ],
    )
    assert isinstance(config.algorithm, GRPOConfig) and config.algorithm.kl_loss_coef == 0.02
    assert config.algorithm_name == "grpo"
    assert config.sampling.n == 8 and config.sampling.max_new_tokens == 5 and config.sampling.seed is None
    assert config.actor.optim.lr == 3e-5 and isinstance(config.actor.optim.lr, float)  # "3e-5" is text in YAML 1.1
    assert config.actor.optim.betas == (0.9, 0.999)  # untouched nested fields keep their defaults
    assert config.critic.optim.betas == (0.8, 0.9)
    assert config.data.arithmetic.operations == ("+", "-") and config.iterations == 7
    assert config.output_dir == Path("runs/t") and config.checkpoint_dir == Path("runs/t/checkpoints")


def test_round_trip_through_yaml(tmp_path):
    config = load_config(None, ["algorithm.name=safe_rlhf", "algorithm.cost_budget=0.1", "data.cost.forbidden=['7']"])
    again = RunConfig.from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict())))
    assert again == config and isinstance(again.algorithm, SafeRLHFConfig)


@pytest.mark.parametrize(
    "override, field, nearest",
    [
        ("sampling.max_new_token=4", "sampling.max_new_token", "sampling.max_new_tokens"),
        ("algorithm.kl_coeff=0.1", "algorithm.kl_coeff", "algorithm.kl_coef"),
        ("actor.optim.learning_rate=1e-4", "actor.optim.learning_rate", None),
        ("actor.optim.lrr=1e-4", "actor.optim.lrr", "actor.optim.lr"),
        ("evalution.every=5", "evalution", "evaluation"),
        ("data.loader.batchsize=4", "data.loader.batchsize", "data.loader.batch_size"),
    ],
)
def test_unknown_fields_are_named_with_the_nearest_valid_name(override, field, nearest):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    message = str(error.value)
    assert message.startswith(f"{field}=") and "no such field" in message
    if nearest:
        assert f"did you mean {nearest!r}" in message
    else:
        assert "valid: " in message and "lr" in message


def test_unknown_field_in_yaml_is_named_at_depth(tmp_path):
    path = write(tmp_path, {"critic": {"optim": {"weight_decai": 0.1}}})
    with pytest.raises(
        ConfigError, match=r"^critic\.optim\.weight_decai=0\.1: .*did you mean 'critic\.optim\.weight_decay'"
    ):
        load_config(path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("sampling.n=four", r"^sampling\.n='four': expected a whole number"),
        ("iterations=2.5", r"^iterations=2\.5: expected a whole number"),
        ("logging.tensorboard=maybe", r"^logging\.tensorboard='maybe': expected true or false"),
        ("actor.optim.lr=fast", r"^actor\.optim\.lr='fast': expected a number"),
        ("sampling=3", r"^sampling=3: expected a mapping of SamplingConfig's fields"),
        ("algorithm.name=ppo2", r"^algorithm\.name='ppo2': no such algorithm.*did you mean 'ppo'"),
        ("sampling.temperature=-1", r"^sampling\.temperature=-1\.0: temperature must be > 0"),
        ("data.loader.overlong=cut", r"^data\.loader\.overlong='cut': use one of \['refuse', 'truncate'\]"),
        ("iterations=0", r"^iterations=0: use a whole number >= 1"),
    ],
)
def test_wrong_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_sampling_belongs_to_the_top_level_section():
    with pytest.raises(ConfigError, match=r"^algorithm\.sampling=.*top-level section: write sampling\.<field>"):
        load_config(None, ["algorithm.sampling.n=4"])


def test_cross_section_rules():
    with pytest.raises(ConfigError, match=r"^faults\.max_recoveries=2: .*checkpoint\.every >= 1"):
        load_config(None, ["checkpoint.every=0"])
    assert load_config(None, ["checkpoint.every=0", "faults.max_recoveries=0"]).checkpoint.every == 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["placement.critic_beside=reward"], r"^placement\.critic_beside='reward': .*\['actor', 'rollout'\]"),
        (
            ["placement.critic_beside=rollout", "placement.critic_devices=0"],
            r"^placement\.critic_beside='rollout': .*placement\.rollout_devices >= 1",
        ),
        (
            ["placement.critic_beside=rollout", "placement.rollout_devices=1"],
            r"^placement\.critic_devices=1: .*set placement\.critic_devices=0",
        ),
    ],
)
def test_critic_beside_the_rollout_needs_a_rollout_group_and_no_critic_pool(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    ok = load_config(
        None, ["placement.critic_beside=rollout", "placement.critic_devices=0", "placement.rollout_devices=1"]
    )
    assert ok.placement.critic_beside == "rollout"


def test_algorithm_switch_keeps_its_own_defaults():
    config = load_config(None, ["algorithm.name=grpo"])
    assert isinstance(config.algorithm, GRPOConfig) and config.algorithm.estimator == "grpo"
    assert isinstance(load_config(None).algorithm, PPOConfig)


def test_grpo_sampling_rule_is_named_by_the_run_field():
    from workbench.run.build import algorithm_config

    config = load_config(None, ["algorithm.name=grpo", "sampling.n=1"])
    with pytest.raises(ConfigError, match=r"^sampling\.n=1: GRPO compares n >= 2"):
        algorithm_config(config)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="dotted.field=value"):
        load_config(None, ["sampling.n"])


@pytest.mark.parametrize("name", ["ppo", "grpo", "safe_rlhf"])
def test_shipped_configs_load(name):
    config = load_config(ROOT / "configs" / f"{name}.yaml")
    assert config.algorithm_name == name and config.name == name
    rows = 8 * config.sampling.n
    assert config.actor.mini_batch_size == rows  # one optimizer step per iteration


@pytest.mark.parametrize("name, algorithm", [("smollm2_grpo", "grpo"), ("smollm2_ppo", "ppo")])
def test_smollm2_configs_load_and_validate_without_the_model(name, algorithm, tmp_path):
    from workbench.models.gguf_import import DEFAULT_CACHE, PACKAGES
    from workbench.run import build

    config = load_config(ROOT / "configs" / f"{name}.yaml")
    assert config.algorithm_name == algorithm and config.name == name and config.data.task == "arithmetic_chat"
    stem = Path(PACKAGES["smollm2"][1]).stem
    assert build.model_dir(config) == DEFAULT_CACHE / stem  # where `import-model smollm2` puts it
    assert config.actor.mini_batch_size == config.data.loader.batch_size * config.sampling.n  # one step
    build.algorithm_config(config)  # sampling against the algorithm
    assert ("critic" in build.required_roles(config)) == (algorithm == "ppo")
    train, held_out = build.prompt_rows(config)
    assert all(isinstance(row["prompt"], list) for row in train + held_out)
    assert config.data.loader.max_prompt_length >= 48  # SmolLM2's template makes these prompts ~38 tokens
    moved = load_config(ROOT / "configs" / f"{name}.yaml", [f"model.path={tmp_path}"])
    assert build.model_dir(moved) == tmp_path
    with pytest.raises(ConfigError, match=r"actor\.load\.compute_dtype=.*'float32', 'bfloat16'"):
        load_config(ROOT / "configs" / f"{name}.yaml", ["actor.load.compute_dtype=bf16"])


def test_model_specs_carry_the_actor_and_critic_lora_to_the_planner(tmp_path):
    """The planner's shapes of a run's models: LoRA ranks from actor.lora / critic.lora, so the
    memory estimate keeps gradients and Adam states for the adapters only and a weight sync
    moves just them."""
    from workbench.mesh import Mesh
    from workbench.models import make_tiny
    from workbench.planner import specs_from_models
    from workbench.planner.memory import static_memory
    from workbench.run import build

    policy = make_tiny("1m", tmp_path / "policy")
    config = load_config(ROOT / "configs" / "ppo.yaml", ["actor.lora={rank: 8}", "critic.lora={rank: 4}"])
    assert build.planner_models(config, policy)["critic"] == (str(policy), 4, True)
    specs = specs_from_models(build.planner_models(config, policy))
    assert specs["actor"].lora_rank == 8 and not specs["actor"].value_head
    assert specs["critic"].lora_rank == 4 and specs["critic"].value_head
    assert specs["reference"].lora_rank == 0  # frozen: nothing to train
    full = specs_from_models(build.planner_models(load_config(ROOT / "configs" / "ppo.yaml"), policy))
    assert full["actor"].lora_rank == 0 and full["actor"].vocab == specs["actor"].vocab == 262
    one = Mesh(1, 1, 1)
    lora_mem, full_mem = static_memory(specs["actor"], one, True), static_memory(full["actor"], one, True)
    assert lora_mem.grads == specs["actor"].adapter_params * full_mem.grads / full["actor"].param_count
    assert lora_mem.optimizer < full_mem.optimizer / 10 and lora_mem.params > full_mem.params  # + the adapters
