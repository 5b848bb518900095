"""Names renamed in issue 22 keep working for one release, each with a DeprecationWarning
naming its new home; no Ray."""

import importlib

import pytest

from workbench.clock import StepClock
from workbench.controller.protocols import ONE_TO_ALL_KEEP_RANK0
from workbench.errors import NonFiniteError
from workbench.planner import Workload, automap, cluster_preset, dataflow_preset
from workbench.stages import StageConfig


@pytest.mark.parametrize(
    "module, old, new",
    [
        ("workbench", "RANK_ZERO", ONE_TO_ALL_KEEP_RANK0),
        ("workbench.controller", "RANK_ZERO", ONE_TO_ALL_KEEP_RANK0),
        ("workbench.controller.protocols", "RANK_ZERO", ONE_TO_ALL_KEEP_RANK0),
        ("algorithms.metrics", "StageClock", StepClock),
        ("workbench.stages", "SFTConfig", StageConfig),
        ("workbench.stages", "RewardModelConfig", StageConfig),
        ("workbench.stages.sft", "SFTConfig", StageConfig),
        ("workbench.stages.reward_model", "RewardModelConfig", StageConfig),
    ],
)
def test_old_module_names(module, old, new):
    with pytest.warns(DeprecationWarning, match=old):
        assert getattr(importlib.import_module(module), old) is new


def test_old_attribute_names():
    flow = dataflow_preset("ppo")
    with pytest.warns(DeprecationWarning, match=r"levels\(\)"):
        assert flow.stages() == flow.levels()
    with pytest.warns(DeprecationWarning, match="n_levels"):
        assert flow.n_stages == flow.n_levels == 3
    plan = automap(dataflow_preset("grpo"), "tiny-1m", Workload.tiny(), cluster_preset("local"))
    with pytest.warns(DeprecationWarning, match="level_times"):
        assert plan.stage_times == plan.level_times
    error = NonFiniteError("scores", "reward", ["a"], "update_actor")
    with pytest.warns(DeprecationWarning, match="NonFiniteError.step"):
        assert error.stage == error.step == "reward"
    clock = StepClock()
    with pytest.warns(DeprecationWarning, match="measure"), clock.stage("adv"):
        pass
    assert "adv" in clock.seconds


def test_the_old_protocol_name_still_registers():
    from workbench.controller.protocols import BUILTIN

    assert BUILTIN["RANK_ZERO"] is BUILTIN["ONE_TO_ALL_KEEP_RANK0"] is ONE_TO_ALL_KEEP_RANK0
