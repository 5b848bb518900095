"""The actor's generation strategy is chosen from its config and mesh alone, one way per case
(workbench.workers.generation); the strategies themselves run in the worker tests
(test_hybrid_engine, test_pipeline_workers, test_actor, test_lora)."""

import pytest

from workbench import Mesh
from workbench.workers import ActorConfig
from workbench.workers.generation import generation_kind


@pytest.mark.parametrize(
    ("backend", "rollout", "mesh", "kind"),
    [
        ("fsdp", "hf", Mesh(dp=2), "copy"),  # shared or synced: decided by the engine's shards
        ("fsdp", "vllm", Mesh(dp=1), "copy"),
        ("3d", None, Mesh(tp=2), "copy"),  # nothing generates
        ("3d", "hf", Mesh(tp=2), "switch"),
        ("3d", "hf", Mesh(tp=2, gen_tp=1), "switch"),
        ("3d", "vllm", Mesh(tp=2), "copy"),
        ("3d", "hf", Mesh(pp=2), "stages"),
        ("3d", "hf", Mesh(pp=2, tp=2), "stages"),
        ("3d", "hf", Mesh(pp=2, tp=2, gen_tp=1, transition="hybridflow"), "switched stages"),
        ("3d", "hf", Mesh(pp=2, gen_pp=1, gen_tp=1), "copy"),  # whole weights on every rank
        ("3d", "hf", Mesh(pp=2, tp=2, gen_pp=1, gen_tp=1), "copy"),
    ],
)
def test_each_config_and_mesh_generates_one_way(backend, rollout, mesh, kind):
    config = ActorConfig(model_path="unused", backend=backend, rollout=rollout, train=True)
    assert generation_kind(config, mesh) == kind
