"""Training with DeepSpeed ZeRO (stage 1, 2 or 3) over the data-parallel ranks of a worker group:
the second training backend, with FSDPEngine's interface so the actor doesn't care which it has.

ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the parameters
(gathered layer by layer by DeepSpeed's hooks in forward and backward). The optimizer is a
plain torch AdamW handed to DeepSpeed as the client optimizer (DeepSpeedCPUAdam would need a
~100 s JIT build). DeepSpeed reuses the process group the worker host already formed.

Gradient accumulation: FSDPEngine takes a rows-weighted mean over a step's micro-batches, and a
step may hold fewer micro-batches than usual (the last mini-batch of a batch). DeepSpeed's
managed accumulation instead divides every loss by a fixed `gradient_accumulation_steps` and
steps after exactly that many backwards. So accumulation runs unmanaged
(`managed_gradient_accumulation: false`): backward only accumulates (without the 1/GAS
scaling), and `step()` is the boundary that reduces the gradients over ranks (a mean, like
FSDP's), clips and updates. The batch-size entries of the config are then bookkeeping only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from workbench import checks
from workbench.data.batch import Batch
from workbench.engines.accumulation import NonFiniteStep, combine_metrics, finite_everywhere, micro_batch_weights
from workbench.engines.contract import Forward, LossFn, OptimConfig
from workbench.models.lora import trainable_parameters

# DeepSpeed JIT-compiles a shared-memory comm op (~2 min on 2 cores) the first time a process
# builds its comm backend, into TORCH_EXTENSIONS_DIR (default: under the home directory, which
# fresh CI machines and private test HOMEs don't keep). The repo's ignored .cache/ keeps one
# build for every later run and every Ray actor: one per interpreter and torch, since the
# environments of `make test PYTHON=...` compile it with other flags and would rebuild over each
# other's at every switch. Set before deepspeed is imported anywhere in this process; a
# directory the user chose wins.
EXTENSIONS_DIR = (
    Path(__file__).resolve().parents[2]
    / ".cache"
    / "torch_extensions"
    / f"py{sys.version_info.major}.{sys.version_info.minor}-torch{torch.__version__}"
)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))

import deepspeed  # noqa: E402  (after TORCH_EXTENSIONS_DIR)

CHECKPOINT_TAG = "state"
"""DeepSpeed's checkpoint sub-directory name under the path given to save/load."""


def build_comm_op() -> None:
    """Build DeepSpeed's comm op for this machine now, into TORCH_EXTENSIONS_DIR, rather than in
    the first group that starts DeepSpeed (the environment step of the Makefile calls it, so a
    fresh checkout pays the build once, at install). Nothing to build where DeepSpeed has none."""
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


class DeepSpeedEngine:
    """`model` is the DeepSpeed engine (an nn.Module wrapping the HF model; its forward must be
    the one called, because it arms ZeRO's backward hooks). `full_weights()` gives HF names."""

    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig,
        zero_stage: int = 2,
        dp_mesh=None,
        micro_batch_size: int = 1,
        accumulation_steps: int = 1,
        bf16: bool | None = None,
    ):
        checks.one_of("DeepSpeedEngine", "zero_stage", zero_stage, (1, 2, 3), fix="use ZeRO stage 1, 2 or 3")
        if not dist.is_initialized():
            # A worker host has already formed the group; standalone use needs the usual
            # RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT variables.
            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        world = dist.get_world_size()
        if dp_mesh is not None and dp_mesh.size() != world:
            raise ValueError(
                f"DeepSpeedEngine: data parallelism only; the dp mesh has {dp_mesh.size()} of {world} ranks "
                f"(pp/tp > 1). Use backend='fsdp' or a mesh with pp = tp = 1"
            )
        # DeepSpeed reads the device index from LOCAL_RANK; a Ray actor sees one device (index 0).
        os.environ.setdefault("LOCAL_RANK", "0")
        if bf16 is None:
            bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        config = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": accumulation_steps,
            "train_batch_size": micro_batch_size * accumulation_steps * world,
            "managed_gradient_accumulation": False,
            # DeepSpeed's default clips at 1.0 when the key is missing; 0 turns clipping off.
            "gradient_clipping": float(optim.grad_clip),
            "zero_optimization": {"stage": zero_stage},
            "bf16": {"enabled": bool(bf16)},
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        # Only what trains: under LoRA the frozen base gets no gradients and no Adam states.
        self.frozen = any(not p.requires_grad for p in model.parameters())
        optimizer = torch.optim.AdamW(
            trainable_parameters(model), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
        )
        self.model, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.optim, self.zero_stage = optim, zero_stage
        self.dp_group = dp_mesh.get_group() if dp_mesh is not None else None

    def train_step(self, loss_fn: LossFn, micro_batches: list[Batch], forward: Forward) -> dict[str, float]:
        """One optimizer step over micro-batches (gradient accumulation, weighted as
        workbench.engines.accumulation says: by rows, or by what the loss weighs)."""
        self.model.train()
        weights, shares = micro_batch_weights(loss_fn, micro_batches, self.dp_group)
        parts, losses = [], []
        for mb, weight in zip(micro_batches, weights):
            loss, metrics = loss_fn(forward(self.model, mb), mb)
            losses.append(loss.detach())
            self.model.backward(loss * weight, scale_wrt_gas=False)
            parts.append(metrics)
        totals = combine_metrics(parts, shares)
        # ZeRO's step finds non-finite gradients itself and skips the update on every rank
        # (clearing the gradients); it only logs that, so say it here.
        self.model.step()  # reduce over ranks, clip, AdamW, zero the gradients
        if not finite_everywhere(torch.stack(losses).cpu(), self.dp_group):  # one sync per step
            raise NonFiniteStep(
                f"a loss is NaN/inf on some rank (here: {[float(x) for x in losses]}); "
                f"DeepSpeed skipped this optimizer step"
            )
        grad_norm = self.model.get_global_grad_norm()
        return {**totals, "grad_norm": float(grad_norm), "lr": self.model.get_lr()[0]}

    @torch.no_grad()
    def iter_full_weights(self, only: Callable[[str], bool] | None = None):
        """(name, unsharded tensor) under the HF names (those `only` accepts), one at a time.
        ZeRO-1/2 keep full parameters on every rank, so those tensors are the live weights (read
        them before the next step); ZeRO-3 gathers one parameter at a time (a collective: every
        rank must consume the iterator to the end) and yields copies."""
        module = self.model.module
        state = {name: value for name, value in module.state_dict().items() if only is None or only(name)}
        if self.zero_stage < 3:
            yield from ((name, value.detach()) for name, value in state.items())
            return
        params = dict(module.named_parameters())
        for name, value in state.items():
            if name in params:
                with deepspeed.zero.GatheredParameters([params[name]]):
                    yield name, params[name].detach().clone()
            else:
                yield name, value.detach()

    @torch.no_grad()
    def gather_weights(self, only: Callable[[str], bool]) -> dict[str, torch.Tensor]:
        """Whole copies of the few small parameters whose names `only` accepts (LoRA adapters), on
        every rank; under ZeRO-3 gathered together, not one collective per tensor."""
        params = [(name, p) for name, p in self.model.module.named_parameters() if only(name)]
        if self.zero_stage < 3:
            return {name: p.detach().clone() for name, p in params}
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {name: p.detach().clone() for name, p in params}

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer unsharded, on every rank, under the HF names."""
        return dict(self.iter_full_weights())

    def shared_full_weights(self) -> dict[str, torch.Tensor] | None:
        """The live parameters as whole tensors (ZeRO-1/2 keep them whole on every rank, and
        update them in place), for another module to alias; None under ZeRO-3."""
        if self.zero_stage == 3:
            return None
        return {name: p.detach() for name, p in self.model.module.named_parameters()}

    def save(self, path: str) -> None:
        """Model + optimizer state (DeepSpeed's layout: each rank writes its optimizer partition)."""
        # Under LoRA only what trains: the frozen base is the model directory's.
        self.model.save_checkpoint(path, tag=CHECKPOINT_TAG, exclude_frozen_parameters=self.frozen)

    def load(self, path: str) -> None:
        loaded, _ = self.model.load_checkpoint(path, tag=CHECKPOINT_TAG, load_module_strict=not self.frozen)
        if loaded is None:
            raise FileNotFoundError(
                f"DeepSpeedEngine.load: no DeepSpeed checkpoint under {path!r} (tag {CHECKPOINT_TAG!r})"
            )
