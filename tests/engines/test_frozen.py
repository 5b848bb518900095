"""Refusals of the ways to keep a frozen model (workbench.engines.frozen), on the driver. The
kept models run in tests/workers/test_actor.py (the reference sharded and host-kept) and
tests/workers/test_critic_reward.py (reward and cost models)."""

import pytest

from workbench import Mesh
from workbench.engines.frozen import check_keep
from workbench.errors import ConfigError
from workbench.models.load import LoadConfig
from workbench.models.lora import LoRAConfig
from workbench.workers import ActorConfig
from workbench.workers.reward import ScoreModelConfig


def test_an_unknown_keep_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"ActorConfig.reference_keep='disk'.*'whole', 'sharded', 'host'"):
        ActorConfig(model_path="m", reference=True, reference_keep="disk")
    with pytest.raises(ConfigError, match=r"ScoreModelConfig.keep='gpu'"):
        ScoreModelConfig(model_path="m", keep="gpu")


def test_shards_need_a_data_parallel_layout():
    check_keep("ScoreModelConfig.keep", "sharded", Mesh(dp=4), "reward")
    check_keep("ScoreModelConfig.keep", "whole", Mesh(tp=2), "reward")
    for mesh in (Mesh(tp=2), Mesh(pp=2, dp=2)):
        with pytest.raises(ConfigError, match=rf"ScoreModelConfig.keep='host'.*reward runs {mesh.short()}.*p1t1d"):
            check_keep("ScoreModelConfig.keep", "host", mesh, "reward")


def test_lora_and_compiled_forwards_keep_the_reference_whole():
    with pytest.raises(ConfigError, match=r"reference_keep='sharded'.*LoRA.*base"):
        ActorConfig(model_path="m", reference=True, reference_keep="sharded", lora=LoRAConfig())
    with pytest.raises(ConfigError, match=r"reference_keep='host'.*compiled"):
        ActorConfig(model_path="m", reference=True, reference_keep="host", load=LoadConfig(compile=True), train=False)
    with pytest.raises(ConfigError, match=r"ScoreModelConfig.keep='sharded'.*compiled"):
        ScoreModelConfig(model_path="m", keep="sharded", load=LoadConfig(compile=True))
    # A template without a reference (a rollout group cut from the actor's config) takes the field.
    ActorConfig(model_path="m", train=False, reference=False, reference_keep="host")
