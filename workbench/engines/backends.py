"""The one place a training backend is chosen: FSDP2 (default), DeepSpeed ZeRO, or "3d"
(pipeline stages and tensor parallel inside each replica, data-parallel replicas: the hybrid
engine's training layout).

The engines share one interface — `model`, `train_step(loss_fn, micro_batches, forward)`,
`full_weights()`, `save(path)`, `load(path)` — so workers and algorithms never branch on it.
"""

from __future__ import annotations

import math

import torch

from workbench.engines.contract import OptimConfig
from workbench.engines.fsdp import FSDPEngine
from workbench.errors import ConfigError

BACKENDS = ("fsdp", "deepspeed", "3d")


def check_data_parallel_only(owner: str, mesh, role: str) -> None:
    """Workers that shard with FSDP/ZeRO over data-parallel ranks implement no tp/pp: a tp or
    pp mesh would silently run full replicas."""
    gen = [x for x in (mesh.gen_tp, mesh.gen_pp) if x not in (None, 1)]
    if mesh.tp != 1 or mesh.pp != 1 or gen:
        raise ConfigError(
            f"{role} mesh",
            str(mesh),
            f"{owner} runs data parallelism only (FSDP/ZeRO shards over the ranks); use "
            f"Mesh(dp={mesh.world_size}) or leave mesh=None",
        )


def make_engine(
    model: torch.nn.Module,
    optim: OptimConfig,
    dp_mesh,
    backend: str = "fsdp",
    zero_stage: int = 2,
    micro_batch_size: int = 1,
    mini_batch_size: int = 1,
    tp_mesh=None,
    compute_dtype: torch.dtype | None = None,
    pp_mesh=None,
):
    """A training engine over `model` for the data-parallel ranks of `dp_mesh` (and, for "3d",
    the tensor-parallel ranks of `tp_mesh` and the pipeline stages of `pp_mesh`).

    micro_batch_size / mini_batch_size (rows per rank) only fill DeepSpeed's batch bookkeeping;
    the arithmetic of a step is the same in both engines (rows-weighted gradient accumulation).
    compute_dtype: torch.bfloat16 for bf16 mixed precision (FSDP2, DeepSpeed); None: each
    engine's default (bf16 on GPUs that have it).
    """
    if backend == "fsdp":
        return FSDPEngine(model, optim, dp_mesh, compute_dtype)
    if backend == "3d":
        from workbench.engines.tensor_parallel import TensorParallelEngine

        dp_group = dp_mesh.get_group() if dp_mesh is not None else None
        if pp_mesh is not None and pp_mesh.size() > 1:
            from workbench.engines.pipeline import PipelineEngine

            return PipelineEngine(model, optim, pp_mesh, tp_mesh, dp_group)
        return TensorParallelEngine(model, optim, tp_mesh, dp_group)
    if backend == "deepspeed":
        from workbench.engines.deepspeed_engine import DeepSpeedEngine  # imports deepspeed: slow

        steps = max(1, math.ceil(mini_batch_size / micro_batch_size))
        bf16 = None if compute_dtype is None else compute_dtype == torch.bfloat16
        return DeepSpeedEngine(
            model, optim, zero_stage, dp_mesh, micro_batch_size=micro_batch_size, accumulation_steps=steps, bf16=bf16
        )
    raise ValueError(f"unknown training backend {backend!r}; use one of {', '.join(map(repr, BACKENDS))}")
