"""In-memory snapshots of a training engine, held in its own process: a rewind without files.

What a step changes, each rank its own part: the model's local tensors (FSDP2 and
tensor-parallel shards through `to_local`, ZeRO-3's partitions), the optimizer's parameters
where they are its own copies (DeepSpeed's fp32 master partitions) and its per-parameter state
(Adam's moments and step), and its hyperparameters. Restoring copies them back in place, so the
engine, its optimizer and every reference to their tensors stay the same objects: the next step
is the one that followed the snapshot, bit for bit. A snapshot costs host memory of about the
model's trainable share plus the optimizer state (three times the weights for Adam), per rank.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from workbench.engines.tensor_parallel import TensorParallelEngine, local, shard_dim


@dataclass
class EngineSnapshot:
    tensors: list[torch.Tensor]
    """Clones of `state_tensors(engine)`, in its order."""
    optimizer_state: list[dict | None]
    """A clone of each of `master_weights(engine)`'s optimizer state, in its order (None: none
    yet, no step had been taken)."""
    hyper: list[dict] = field(default_factory=list)
    """Each param group's settings (lr, betas, ...), without its parameters."""

    def nbytes(self) -> int:
        """The bytes this rank holds for it."""
        state = [v for s in self.optimizer_state if s for v in s.values() if isinstance(v, torch.Tensor)]
        return sum(local(t).numel() * t.element_size() for t in [*self.tensors, *state])


def optimizer_of(engine) -> torch.optim.Optimizer:
    """The torch optimizer that holds the moments: DeepSpeed's ZeRO wrapper keeps its client
    optimizer (stepping fp32 partitions) as `.optimizer`."""
    optimizer = engine.optimizer
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def master_weights(engine) -> list[torch.Tensor]:
    """What the optimizer steps, in a fixed order: the parameters themselves, or DeepSpeed's fp32
    partitions (ZeRO-1/2 `single_partition_of_fp32_groups`; ZeRO-3 `fp32_partitioned_groups_flat`,
    which it hands its client optimizer only for the length of a step). Looked up afresh each
    time: loading a checkpoint may replace them with new tensors."""
    wrapper, optimizer = engine.optimizer, optimizer_of(engine)
    found = [p for group in optimizer.param_groups for p in group["params"]]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        found += list(getattr(wrapper, name, None) or [])
    return list({id(t): t for t in found}.values())


def settled(engine) -> torch.nn.Module:
    """The engine's module with every parameter in its sharded home: FSDP2 leaves the root's
    parameters gathered after a forward without a backward (a log-prob pass)."""
    module = getattr(engine.model, "hf", engine.model)  # a pipeline stage's model
    for part in module.modules():
        if isinstance(part, FSDPModule):
            part.reshard()
    return module


def state_tensors(engine) -> list[torch.Tensor]:
    """This rank's tensors a step can change, each storage once, in a fixed order: the module's
    trained parameters and its buffers (local shards; ZeRO-3's partition where the parameter
    itself is released) and the optimizer's master weights."""
    module = settled(engine)
    trained = [p for p in module.parameters() if p.requires_grad]  # a frozen base (LoRA's) never moves
    candidates = [*trained, *module.buffers(), *(getattr(p, "ds_tensor", None) for p in trained)]
    found: dict[tuple, torch.Tensor] = {}
    for t in [*candidates, *master_weights(engine)]:
        if t is None:
            continue
        piece = local(t).detach()
        if piece.numel() == 0:
            continue
        key = (piece.untyped_storage().data_ptr(), piece.storage_offset(), tuple(piece.shape))
        found.setdefault(key, piece)
    return list(found.values())


def owned(engine) -> list[torch.Tensor]:
    """This rank's pieces of the master weights that a sum over the group's ranks counts once:
    FSDP2 shards and DeepSpeed partitions are each on one rank; a tensor-parallel engine's
    data-parallel replicas count on their first replica only, and a parameter it keeps whole
    on every tensor-parallel rank on tensor-parallel rank 0 only (pipeline stages are disjoint).
    Dot products of update directions (replay's cosines) sum these over the ranks."""
    settled(engine)
    pieces = [local(w).detach() for w in master_weights(engine)]
    if not isinstance(engine, TensorParallelEngine):
        return [p for p in pieces if p.numel()]
    if engine.dp_group is not None and dist.get_rank(engine.dp_group) != 0:
        return []
    first_tp = engine.tp_group is None or dist.get_rank(engine.tp_group) == 0
    weights = master_weights(engine)
    return [p for w, p in zip(weights, pieces) if p.numel() and (first_tp or shard_dim(w) is not None)]


def take(engine) -> EngineSnapshot:
    state = optimizer_of(engine).state
    optimizer = optimizer_of(engine)
    return EngineSnapshot(
        tensors=[t.clone() for t in state_tensors(engine)],
        optimizer_state=[_clone(state[p]) if state.get(p) else None for p in master_weights(engine)],
        hyper=[{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
    )


@torch.no_grad()
def restore(engine, snapshot: EngineSnapshot) -> None:
    """Copy the snapshot back in place, onto the engine's tensors as they are now (a checkpoint
    loaded since may have replaced them)."""
    tensors, weights, optimizer = state_tensors(engine), master_weights(engine), optimizer_of(engine)
    if [t.shape for t in tensors] != [t.shape for t in snapshot.tensors] or len(weights) != len(
        snapshot.optimizer_state
    ):
        raise RuntimeError("this snapshot was taken of another engine: its tensors differ from this one's")
    for live, saved in zip(tensors, snapshot.tensors):
        live.copy_(saved)
    for p in [p for p in optimizer.state if all(p is not w for w in weights)]:
        del optimizer.state[p]  # stale keys (tensors a checkpoint load replaced)
    for p, state in zip(weights, snapshot.optimizer_state):
        if state is None:
            optimizer.state.pop(p, None)  # no step had been taken at the snapshot
        else:
            optimizer.state[p] = _clone(state)
    for group, hyper in zip(optimizer.param_groups, snapshot.hyper):
        group.update(copy.deepcopy(hyper))


def digest(engine) -> str:
    """A hash of every tensor a snapshot would hold, read in place (and the optimizer's state):
    equal digests, equal engines, bit for bit."""
    h = hashlib.sha256()
    state = optimizer_of(engine).state
    values = [*state_tensors(engine)]
    values += [v for p in master_weights(engine) for _, v in sorted(state.get(p, {}).items())]
    for t in values:
        if isinstance(t, torch.Tensor):
            h.update(local(t).detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(t).encode())
    return h.hexdigest()


def _clone(state: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}
