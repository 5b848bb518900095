"""Where a frozen model (the reference policy, a reward or cost model) keeps its weights between
forwards, and the layout it computes in.

  * "whole": every data-parallel rank keeps the whole model on its device (computes as kept);
  * "sharded": each rank keeps 1/dp of every layer as FSDP2 shards and all-gathers a layer's
    weights for its forward only (kept sharded, computed whole: ZeRO-3 for inference);
  * "host": those shards live in host memory and are copied to the device a layer at a time
    before its gather (FSDP2's CPUOffloadPolicy; pinned on CUDA). The device keeps nothing.

The gathered weights are the kept ones bit for bit; the forwards agree within fp32 rounding (a
CPU matmul may round differently on weights that are views into the gather's buffer: 3e-7 on
the tiny kit's logits). A sharded model's forward is a collective, so every data-parallel rank
runs the same number of them (the DP dispatch gives ranks equal rows; `forward.agreed` makes
them share prompts alike).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from workbench.engines.fsdp import decoder_layers
from workbench.errors import ConfigError
from workbench.models.load import LoadConfig, for_worker, resolve_dtype

KEEPS: tuple[str, ...] = ("whole", "sharded", "host")


def check_keep(field: str, keep: str, mesh=None, role: str | None = None) -> None:
    """`keep` is known and, when sharded, the layout is data-parallel only (the shards are
    FSDP's; tensor- and pipeline-parallel pieces are cut by those layouts instead)."""
    if keep not in KEEPS:
        raise ConfigError(field, keep, f"unknown way to keep a frozen model; use one of {KEEPS}")
    if keep != "whole" and mesh is not None and (mesh.tp > 1 or mesh.pp > 1):
        raise ConfigError(
            field,
            keep,
            f"{role or 'this group'} runs {mesh.short()}: FSDP shards a frozen model over data-parallel "
            f"ranks only; use {field.rsplit('.', 1)[-1]}='whole' with tensor or pipeline parallelism, or a "
            f"p1t1d{mesh.world_size} mesh",
        )


def keep_frozen(model: torch.nn.Module, keep: str, dp_mesh, device: torch.device | str) -> torch.nn.Module:
    """`model` (eval mode, no gradients) kept as `keep` says over `dp_mesh`'s ranks; in place."""
    check_keep("keep_frozen(keep)", keep)
    model.eval().requires_grad_(False)
    if keep == "whole":
        return model
    # Pinned host pages make the per-layer copies asynchronous; only CUDA has them.
    offload = CPUOffloadPolicy(pin_memory=torch.device(device).type == "cuda") if keep == "host" else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, offload_policy=offload)
    # The root too gives its gathered weights back after each forward: left to itself FSDP keeps
    # the root's (embeddings, head) whole until a backward, which a frozen model never runs.
    fully_shard(model, mesh=dp_mesh, offload_policy=offload, reshard_after_forward=True)
    return model


def frozen_load_config(cfg: LoadConfig, device: str | torch.device, trained: bool, keep: str) -> LoadConfig:
    """Where a frozen model is loaded: on the device when kept whole; else in host memory, in
    the dtype it would have on the device, so sharding it moves one layer's shard at a time to
    the device and the whole model never lands there."""
    on_device = for_worker(cfg, device, trained)
    if keep == "whole":
        return on_device
    dtype = str(resolve_dtype(on_device.dtype, str(device))).removeprefix("torch.")
    return replace(on_device, device="cpu", dtype=dtype)


def kept_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of `model`'s parameters and buffers this rank keeps, by device type ("cpu",
    "cuda"): its own shards for a sharded model."""
    out: dict[str, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        out[local.device.type] = out.get(local.device.type, 0) + local.numel() * local.element_size()
    return out
