"""Training with FSDP2 (`fully_shard`) over the data-parallel ranks of a worker group.

Each decoder layer is its own FSDP unit (parameters gathered just for that layer's forward and
backward), the root holds the embeddings and head. Gradients are averaged over DP ranks by
FSDP's reduce-scatter, so with equal rows per rank one step equals a single-process step on the
whole batch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from workbench.data.batch import Batch
from workbench.engines.accumulation import NonFiniteStep, accumulate_gradients
from workbench.engines.checkpoint import load_sharded, save_sharded
from workbench.engines.contract import Forward, LossFn, OptimConfig  # noqa: F401  (re-exported: older imports)
from workbench.models.lora import trainable_parameters

# Value heads (AutoModelForTokenClassification) return a view; FSDP2 warns that an in-place
# op on it would skip its hooks. Losses here never modify model outputs in place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF causal LM (model.model.layers for Llama-style models)."""
    if hasattr(model, "get_base_model"):  # a peft-wrapped model: its blocks are the base's
        model = model.get_base_model()
    inner = getattr(model, "model", model)
    return list(getattr(inner, "layers", []))


class FSDPEngine:
    def __init__(
        self, model: torch.nn.Module, optim: OptimConfig, dp_mesh=None, compute_dtype: torch.dtype | None = None
    ):
        """compute_dtype: bf16 computes forwards and backwards in bf16 with the parameters (master
        weights) and the gradient reduction in their own dtype; None: bf16 where the GPU has it,
        the parameters' dtype on CPU (the CPU path is the correctness reference)."""
        if compute_dtype is None:
            gpu_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
            compute_dtype = torch.bfloat16 if gpu_bf16 else None
        mp = MixedPrecisionPolicy()
        if compute_dtype == torch.bfloat16:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        self.model, self.optim = model, optim
        self.dp_group = dp_mesh.get_group() if dp_mesh is not None else None
        # Only what trains: under LoRA the frozen base gets no gradients and no Adam states.
        self.optimizer = torch.optim.AdamW(
            trainable_parameters(model), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
        )

    def train_step(self, loss_fn: LossFn, micro_batches: list[Batch], forward: Forward) -> dict[str, float]:
        """One optimizer step over micro-batches (gradient accumulation, weighted as
        workbench.engines.accumulation says: by rows, or by what the loss weighs)."""
        self.optimizer.zero_grad(set_to_none=True)
        totals = accumulate_gradients(self.model, loss_fn, micro_batches, forward, self.dp_group)
        clip = self.optim.grad_clip if self.optim.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        if not torch.isfinite(grad_norm):  # the norm is global: every rank skips together
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteStep(
                f"the gradient norm is {float(grad_norm)} (loss metrics {totals}); this optimizer step was skipped"
            )
        self.optimizer.step()
        return {**totals, "grad_norm": float(grad_norm), "lr": self.optimizer.param_groups[0]["lr"]}

    @torch.no_grad()
    def iter_full_weights(self, only: Callable[[str], bool] | None = None):
        """(name, unsharded tensor) of every parameter and buffer (those whose name `only`
        accepts), one at a time: each is all-gathered when it is reached, so peak memory is one
        full tensor, not the model. Every rank must consume the iterator to the end (the gathers
        are collectives)."""
        for name, value in self.model.state_dict().items():
            if only is None or only(name):
                yield name, (value.full_tensor() if isinstance(value, DTensor) else value).detach()

    @torch.no_grad()
    def gather_weights(self, only: Callable[[str], bool]) -> dict[str, torch.Tensor]:
        """Whole copies of the few small tensors whose names `only` accepts (LoRA adapters), on
        every rank, in one collective: gathered one by one (`iter_full_weights`) they would pay a
        collective's latency each (~2 ms on gloo; 140 adapters of a 10-layer model took 0.3 s)."""
        state = {name: value for name, value in self.model.state_dict().items() if only(name)}
        sharded = {name: value for name, value in state.items() if isinstance(value, DTensor)}
        world = dist.get_world_size(self.dp_group) if self.dp_group is not None else 1
        if world == 1 or any(value.placements != (Shard(0),) for value in sharded.values()):
            return dict(self.iter_full_weights(only))
        pieces: list = [None] * world  # each rank's dim-0 shards, in rank order: cat gives the whole
        local = {name: value.to_local().detach().cpu() for name, value in sharded.items()}
        dist.all_gather_object(pieces, local, group=self.dp_group)
        device = next(iter(state.values())).device if state else torch.device("cpu")
        whole = {name: torch.cat([piece[name] for piece in pieces]).to(device) for name in sharded}
        return {name: whole.get(name, value.detach()) for name, value in state.items()}

    @torch.no_grad()
    def load_full_weights(self, named) -> None:
        """Load whole (name, tensor) pairs, one at a time, into this rank's shards in place: the
        inverse of `iter_full_weights`, for a copy of a model trained elsewhere. Each rank cuts
        its own piece locally (no collective)."""
        state = self.model.state_dict()
        for name, whole in named:
            if name not in state:
                raise KeyError(f"this model has no weight named {name!r}; is the sender the same model?")
            target = state[name]
            if isinstance(target, DTensor):
                piece = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(piece.to_local())
            else:
                target.copy_(whole)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer unsharded, on every rank."""
        return dict(self.iter_full_weights())

    def shared_full_weights(self) -> dict[str, torch.Tensor] | None:
        """The live parameters as whole tensors, when this rank holds them whole (one data-parallel
        rank: its shard is the full tensor). Another module can point its parameters at these and
        see every optimizer step without a copy. None when the parameters are sharded."""
        if self.dp_group is not None and torch.distributed.get_world_size(self.dp_group) > 1:
            return None
        return {
            name: (p.to_local() if isinstance(p, DTensor) else p).detach() for name, p in self.model.named_parameters()
        }

    def save(self, path: str) -> None:
        """Sharded model + optimizer state (torch.distributed.checkpoint; each rank its shard)."""
        save_sharded(self.model, self.optimizer, path)

    def load(self, path: str) -> None:
        load_sharded(self.model, self.optimizer, path)
