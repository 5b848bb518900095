"""Transfer protocols: how a call's inputs go out to a group's ranks and how outputs return.

A protocol is a pair of functions of the group's Mesh (HybridFlow Table 3):
  distribute(mesh, value) -> one value per rank
  collect(mesh, outputs)  -> the call's result, from the outputs of `collect_ranks(mesh)`
`num_chunks(mesh)` says how many data-parallel pieces a Batch is split into, so the group
can pad (or refuse) a batch whose rows do not divide.

Splitting understands two kinds of inputs: a Batch on the driver (chunked here), and a
DataFuture from another group's call (each rank receives a RemoteSlice and fetches only its
own rows from the source ranks). Anything else (configs, numbers) goes to every rank as is.

A user protocol is just `Protocol("mine", distribute=..., collect=...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workbench.controller.future import DataFuture
from workbench.data.batch import Batch
from workbench.mesh import Mesh


def all_ranks(mesh: Mesh) -> list[int]:
    return list(range(mesh.world_size))


def concat(mesh: Mesh, outputs: list[Any]) -> Any:
    """Concatenate Batches (dropping padding) or tensors; other outputs come back as a list."""
    if outputs and all(isinstance(o, Batch) for o in outputs):
        return Batch.concat(outputs).unpad()
    if outputs and all(isinstance(o, torch.Tensor) for o in outputs):
        return torch.cat(outputs)
    return list(outputs)


concat.joins_rows = True  # type: ignore[attr-defined]  # a RemoteSlice may fetch just the chunks holding its rows


def as_list(mesh: Mesh, outputs: list[Any]) -> list[Any]:
    return list(outputs)


def first(mesh: Mesh, outputs: list[Any]) -> Any:
    return outputs[0]


def scatter(chunk_of: Callable[[Mesh, int], int]) -> Callable[[Mesh, Any], list[Any]]:
    """A distribute function that gives rank r chunk `chunk_of(mesh, r)` of a Batch."""

    def distribute(mesh: Mesh, value: Any) -> list[Any]:
        owners = [chunk_of(mesh, r) for r in range(mesh.world_size)]
        count = max(owners) + 1
        if isinstance(value, DataFuture):
            slices = [value.slice(k, count) for k in range(count)]
            return [slices[k] for k in owners]
        if isinstance(value, Batch):
            chunks = value.chunk(count)
            return [chunks[k] for k in owners]
        return [value] * mesh.world_size

    distribute.chunk_of = chunk_of  # type: ignore[attr-defined]  # lets num_chunks and the tests see the layout
    return distribute


def broadcast(mesh: Mesh, value: Any) -> list[Any]:
    if isinstance(value, DataFuture):
        value = value.slice(0, 1)
    return [value] * mesh.world_size


def one_per_rank(mesh: Mesh, value: Any) -> list[Any]:
    if not isinstance(value, (list, tuple)) or len(value) != mesh.world_size:
        raise ValueError(
            f"ALL_TO_ALL takes one input per rank: a list of {mesh.world_size} items, "
            f"got {type(value).__name__}" + (f" of length {len(value)}" if isinstance(value, (list, tuple)) else "")
        )
    return list(value)


@dataclass(frozen=True)
class Protocol:
    """A (distribute, collect) pair; see the module docstring."""

    name: str
    distribute: Callable[[Mesh, Any], list[Any]]
    collect: Callable[[Mesh, list[Any]], Any]
    collect_ranks: Callable[[Mesh], list[int]] = all_ranks

    def num_chunks(self, mesh: Mesh) -> int | None:
        chunk_of = getattr(self.distribute, "chunk_of", None)
        if chunk_of is None:
            return None
        return max(chunk_of(mesh, r) for r in range(mesh.world_size)) + 1

    def __repr__(self) -> str:
        return f"Protocol({self.name})"


def _last_pp_first_tp(mesh: Mesh) -> list[int]:
    return [mesh.rank(pp=mesh.pp - 1, tp=0, dp=d) for d in range(mesh.dp)]


def _gen_replica_heads(mesh: Mesh) -> list[int]:
    heads: dict[int, int] = {}
    gen_pp_last = (mesh.gen_pp or mesh.pp) - 1
    for r in range(mesh.world_size):
        g = mesh.gen_coord(r)
        if g.tp == 0 and g.pp == gen_pp_last:
            heads.setdefault(g.dp, r)
    return [heads[k] for k in sorted(heads)]


def _pp_stage_heads(mesh: Mesh) -> list[int]:
    return [mesh.rank(pp=p, tp=0, dp=0) for p in range(mesh.pp)]


ONE_TO_ALL = Protocol("ONE_TO_ALL", broadcast, as_list)
"""Same input to every rank; outputs of all ranks as a list (e.g. init_model)."""

ALL_TO_ALL = Protocol("ALL_TO_ALL", one_per_rank, as_list)
"""The caller gives one input per rank; outputs of all ranks as a list (debugging)."""

DP_PROTO = Protocol("DP_PROTO", scatter(lambda m, r: r), concat)
"""Plain data parallelism: one chunk per rank; outputs concatenated in rank order."""

THREE_D_PROTO = Protocol("THREE_D_PROTO", scatter(lambda m, r: m.coord(r).dp), concat, _last_pp_first_tp)
"""Split by DP size, broadcast inside each model-parallel group; collect from tp=0 of the
last pipeline stage of every DP group."""

THREE_D_ALL_MICRO_DP = Protocol(
    "THREE_D_ALL_MICRO_DP", scatter(lambda m, r: m.gen_replica(r)), concat, _gen_replica_heads
)
"""Hybrid-engine generation: split over every generation replica (dp * micro_dp of them),
broadcast inside a replica; collect one rank per replica."""

THREE_D_PP_ONLY = Protocol("THREE_D_PP_ONLY", broadcast, as_list, _pp_stage_heads)
"""Broadcast; collect tp=0, dp=0 of every pipeline stage (e.g. inspecting weight names)."""

DP_REDUCED = Protocol("DP_REDUCED", DP_PROTO.distribute, first, lambda m: [0])
"""Split like DP_PROTO; the ranks reduce their results among themselves (e.g. all-reduced
training metrics), so rank 0's output is the answer."""

THREE_D_REDUCED = Protocol("THREE_D_REDUCED", THREE_D_PROTO.distribute, first, lambda m: [0])
"""Split like THREE_D_PROTO; the ranks reduce their results among themselves, so rank 0's output
is the answer (the 3D twin of DP_REDUCED, e.g. training metrics)."""

ONE_TO_ALL_KEEP_RANK0 = Protocol("ONE_TO_ALL_KEEP_RANK0", broadcast, first, lambda m: [0])
"""Same input to every rank, and every rank runs (collectives stay matched); only rank 0's
output comes back. Unlike `@register(..., execute="rank_zero")`, where rank 0 alone runs."""

BUILTIN = {
    p.name: p
    for p in (
        ONE_TO_ALL,
        ALL_TO_ALL,
        DP_PROTO,
        DP_REDUCED,
        THREE_D_PROTO,
        THREE_D_REDUCED,
        THREE_D_ALL_MICRO_DP,
        THREE_D_PP_ONLY,
        ONE_TO_ALL_KEEP_RANK0,
    )
}
