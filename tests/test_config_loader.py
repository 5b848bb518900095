"""The one config loader (workbench.config_loader): mappings, YAML and dotted overrides into typed
dataclasses, with errors naming the full dotted field; algorithm configs load through it with the
same error shape as a headless run. Pure: no Ray, no models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from algorithms import GRPOConfig, PPOConfig
from workbench import checks
from workbench.config_loader import Loader, apply_override, build, load, read_yaml, to_plain
from workbench.errors import ConfigError
from workbench.run.config import load_config


@dataclass(frozen=True)
class Inner:
    rate: float = 0.1
    mode: Literal["fast", "slow"] = "fast"
    limit: int | None = None

    def __post_init__(self):
        checks.real("Inner", "rate", self.rate, 0, low_open=True, fix="use a rate > 0")


@dataclass
class Outer:
    name: str
    inner: Inner = field(default_factory=lambda: Inner(rate=0.5))
    pair: tuple[float, float] = (0.0, 1.0)
    tags: tuple[str, ...] = ()
    sizes: list[int] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)
    flag: bool = False


def test_a_mapping_builds_nested_typed_fields():
    config = build(
        Outer,
        {
            "name": "x",
            "inner": {"mode": "slow", "limit": None},
            "pair": [1, "3e-5"],
            "tags": ["a", "b"],
            "sizes": [1, 2],
            "weights": {"a": 1},
            "flag": True,
        },
    )
    assert config.inner == Inner(rate=0.5, mode="slow")  # untouched nested fields keep the field's default
    assert config.pair == (1.0, 3e-5) and isinstance(config.pair[0], float)  # ints widen, YAML 1.1 text is read
    assert config.tags == ("a", "b") and config.sizes == [1, 2] and config.weights == {"a": 1.0}
    assert build(Outer, to_plain(config)) == config


@pytest.mark.parametrize(
    "values, message",
    [
        ({"name": "x", "inner": {"rte": 1}}, r"^inner\.rte=1: no such field in 'inner'; did you mean 'inner\.rate'\?"),
        ({"name": "x", "inner": {"mode": "medium"}}, r"^inner\.mode='medium': use one of \['fast', 'slow'\]"),
        ({"name": "x", "inner": {"limit": 2.5}}, r"^inner\.limit=2\.5: expected int \| None"),
        ({"name": "x", "inner": {"rate": -1}}, r"^inner\.rate=-1\.0: use a rate > 0"),  # the class's own check, placed
        ({"name": "x", "pair": [1]}, r"^pair=\[1\]: expected 2 values"),
        ({"name": "x", "sizes": [1, "two"]}, r"^sizes\[1\]='two': expected a whole number"),
        ({"name": "x", "weights": {"a": "heavy"}}, r"^weights\.a='heavy': expected a number"),
        ({"name": "x", "flag": "yes"}, r"^flag='yes': expected true or false"),
        ({"name": "x", "inner": 3}, r"^inner=3: expected a mapping of Inner's fields"),
        ({"inner": {}}, r"required field\(s\) missing: set name"),
    ],
)
def test_every_error_names_the_dotted_field(values, message):
    with pytest.raises(ConfigError, match=message):
        build(Outer, values)


def test_yaml_files_and_overrides(tmp_path):
    path = tmp_path / "outer.yaml"
    path.write_text("name: x\ninner:\n  rate: 0.2\n")
    config = load(Outer, path, ["inner.mode=slow", "tags=[a, b]", "pair=[0, 3e-5]"], root="Outer")
    assert config.inner == Inner(rate=0.2, mode="slow") and config.tags == ("a", "b") and config.pair == (0.0, 3e-5)
    with pytest.raises(ConfigError, match=r"^Outer\.inner\.rat=1: .*did you mean 'Outer\.inner\.rate'"):
        load(Outer, path, ["inner.rat=1"], root="Outer")
    with pytest.raises(ConfigError, match=r"^name='x': is a value, not a section; cannot set name\.first"):
        apply_override({"name": "x"}, "name.first=y")
    path.write_text("name: [x\n")
    with pytest.raises(ConfigError, match=r"^config file=.*not valid YAML .*line 2"):
        read_yaml(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="the YAML must be a mapping of fields"):
        read_yaml(path)
    with pytest.raises(ConfigError, match="no such file"):
        read_yaml(tmp_path / "missing.yaml")


def test_a_loader_subclass_adds_rules():
    class NoFlags(Loader):
        def hidden(self, cls):
            return {"flag": "flags are set elsewhere"}

    with pytest.raises(ConfigError, match=r"^flag=True: flags are set elsewhere"):
        NoFlags().build(Outer, {"name": "x", "flag": True})


def test_algorithm_configs_load_like_the_run_config(tmp_path):
    """The same nested section, wrong type or unknown key gives the same error shape in a
    notebook (PPOConfig.from_dict / from_yaml) as in a headless run (algorithm.*, sampling.*)."""
    cases = [  # (notebook dict, its field, nearest), (run override, its field, nearest)
        (
            (
                {"sampling": {"max_new_token": 4}},
                "PPOConfig.sampling.max_new_token",
                "PPOConfig.sampling.max_new_tokens",
            ),
            ("sampling.max_new_token=4", "sampling.max_new_token", "sampling.max_new_tokens"),
        ),
        (
            ({"kl_coeff": 0.1}, "PPOConfig.kl_coeff", "PPOConfig.kl_coef"),
            ("algorithm.kl_coeff=0.1", "algorithm.kl_coeff", "algorithm.kl_coef"),
        ),
    ]
    for (values, where, nearest), (override, run_where, run_nearest) in cases:
        with pytest.raises(ConfigError) as notebook:
            PPOConfig.from_dict(values)
        with pytest.raises(ConfigError) as run:
            load_config(None, [override])
        for error, named, near in ((notebook, where, nearest), (run, run_where, run_nearest)):
            assert str(error.value).startswith(f"{named}=") and "no such field" in str(error.value)
            assert f"did you mean {near!r}" in str(error.value)
    with pytest.raises(ConfigError, match=r"^PPOConfig\.sampling\.n='four': expected a whole number"):
        PPOConfig.from_dict({"sampling": {"n": "four"}})
    with pytest.raises(ConfigError, match=r"^sampling\.n='four': expected a whole number"):
        load_config(None, ["sampling.n=four"])
    with pytest.raises(ConfigError, match=r"^GRPOConfig\.sampling\.n=1: GRPO compares n >= 2"):
        GRPOConfig.from_dict({"sampling": {"n": 1}})


def test_algorithm_config_sections_update_the_algorithms_defaults(tmp_path):
    config = GRPOConfig.from_dict({"sampling": {"temperature": 0.7}, "estimator": lambda data, **_: data})
    assert config.sampling.n == 4 and config.sampling.max_new_tokens == 16  # GRPO's default sampling, updated
    assert callable(config.estimator)  # a function in a cell's dict stays a function
    path = tmp_path / "grpo.yaml"
    path.write_text("sampling: {n: 8}\nclip_ratio_high: 0.28\n")
    config = GRPOConfig.from_yaml(path, ["kl_loss_coef=0.02"])
    assert config.sampling.n == 8 and config.clip_ratio_high == 0.28 and config.kl_loss_coef == 0.02


def test_generic_checks_name_fields_with_or_without_an_owner():
    with pytest.raises(ConfigError, match=r"^placement\.actor_devices=0: use a whole number >= 1"):
        checks.whole("placement", "actor_devices", 0)
    with pytest.raises(ConfigError, match=r"^iterations=0: use a whole number >= 1"):
        checks.whole("", "iterations", 0)
    checks.whole("Session", "num_devices", None, none_ok=True)
    with pytest.raises(ConfigError, match=r"^Session\.num_devices=True"):
        checks.whole("Session", "num_devices", True, none_ok=True)
    assert checks.is_whole(3, 1) and not checks.is_whole(0, 1)
    assert not checks.is_whole(True) and not checks.is_whole(2.0)
    assert checks.is_real(0.5) and not checks.is_real(float("nan")) and not checks.is_real(False)
