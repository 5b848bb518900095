"""Tensor-parallel training of Llama-architecture models (HybridFlow's 3D-parallel worker, p = 1):
the training layout of the hybrid engine.

Within a tensor-parallel group each rank holds 1/t of every projection, cut Megatron-style with
PyTorch's own tensor-parallel API (`parallelize_module`, DTensor): q/k/v, gate and up are cut by
output features (column-wise), o and down by input features (row-wise), the embedding and the
LM head by the hidden dimension, so every rank gets whole logits back from one all-reduce. Norm
weights stay whole on every rank (they are 0.02% of a model).

Data-parallel replicas keep the same shards (as Megatron does) and average their gradients after
the backward: the all-reduce over the dp group is written here because torch's DDP does not take
DTensor parameters. The gradient norm for clipping is written here too: it must count a sharded
gradient's pieces once each and a whole (replicated) gradient once in total.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from workbench.data.batch import Batch
from workbench.engines.accumulation import NonFiniteStep, accumulate_gradients, all_reduce_small
from workbench.engines.checkpoint import load_sharded, save_sharded
from workbench.engines.contract import Forward, LossFn, OptimConfig
from workbench.engines.fsdp import decoder_layers
from workbench.engines.pipeline_stages import check_pipeline
from workbench.errors import ConfigError
from workbench.models.load import read_config

COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


def check_tensor_parallel(config, tp: int, field: str = "model") -> None:
    """The model's heads and widths divide evenly over `tp` ranks (clear error otherwise)."""
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for name, value in (
        ("num_attention_heads", config.num_attention_heads),
        ("num_key_value_heads", kv),
        ("hidden_size", config.hidden_size),
        ("intermediate_size", config.intermediate_size),
    ):
        if value % tp:
            raise ConfigError(
                f"{field}.{name}",
                value,
                f"must divide by the tensor-parallel size tp={tp}; choose a tp that divides {value}",
            )


def pipelined_generation(mesh) -> bool:
    """Whether a pipeline-parallel mesh generates on pipeline stages of its own training stages
    (gen_pp = pp: workbench.engines.pipelined_rollout), in the training tensor layout (gen_tp =
    tp: on the training weights themselves) or a smaller one (the 3D-HybridEngine's switch
    inside each stage), rather than with whole weights."""
    return mesh.pp > 1 and (mesh.gen_pp or mesh.pp) == mesh.pp


def check_tensor_parallel_layout(
    owner: str, mesh, role: str, model_path, trust_remote_code: bool = False, rollout: str | None = None
) -> None:
    """backend="3d": pipeline, tensor and data parallelism; a generation layout that only
    shrinks tensor parallelism (with pipeline stages: inside each stage, hybridflow's grouping,
    the stages generating as a pipeline), or whole weights on every rank; a model whose heads
    and widths split evenly over tp and whose layers over pp; an HF rollout when the
    generation layout is cut or pipelined."""
    gen_pp, gen_tp = (mesh.gen_pp or mesh.pp), (mesh.gen_tp or mesh.tp)
    if mesh.pp > 1 and rollout is not None and (gen_pp, gen_tp) != (1, 1) and not pipelined_generation(mesh):
        raise ConfigError(
            f"{role} mesh",
            str(mesh),
            f"{owner} with pipeline parallelism (pp={mesh.pp}) generates in pipeline stages of its own "
            f"(gen_pp={mesh.pp}, gen_tp dividing tp={mesh.tp}) or with whole weights on every rank "
            f"(gen_pp=1, gen_tp=1); other generation layouts of pipeline stages are not built",
        )
    if pipelined_generation(mesh) and rollout is not None and gen_tp < mesh.tp and mesh.transition != "hybridflow":
        raise ConfigError(
            f"{role} mesh",
            str(mesh),
            f"pipeline stages switch to gen_tp={gen_tp} inside each stage with transition='hybridflow' "
            f"(the other methods gather across stages); use transition='hybridflow'",
        )
    if pipelined_generation(mesh) and rollout not in ("hf", None):
        raise ConfigError(
            f"{owner}.rollout",
            rollout,
            f"pipelined generation (gen_pp={mesh.pp}) runs the HF rollout on each rank's stage; use "
            f"rollout='hf', or gen_pp=1, gen_tp=1 for whole weights on every rank",
        )
    gen_tp = gen_tp if mesh.pp == 1 or pipelined_generation(mesh) else 1  # whole weights: 1
    if gen_tp > 1 and rollout not in ("hf", None):
        raise ConfigError(
            f"{owner}.rollout",
            rollout,
            f"a tensor-parallel generation layout (gen_tp={gen_tp}) runs the "
            f"HF rollout; use rollout='hf', or gen_tp=1 for vLLM",
        )
    config = read_config(model_path, trust_remote_code)  # a saved value model too
    for size in {mesh.tp, gen_tp}:
        check_tensor_parallel(config, size, f"{owner}.model_path ({model_path})")
    check_pipeline(config, mesh.pp, f"{owner}.model_path ({model_path})")


def llama_tp_plan(model: torch.nn.Module) -> dict:
    """parallelize_module plan for an HF Llama-style causal LM (or value model: `score` head)."""
    plan = {"model.embed_tokens": ColwiseParallel(output_layouts=Replicate())}
    for i, _ in enumerate(decoder_layers(model)):
        plan.update({f"model.layers.{i}.{n}": ColwiseParallel() for n in COLUMN})
        plan.update({f"model.layers.{i}.{n}": RowwiseParallel() for n in ROW})
    for head in ("lm_head", "score"):
        if isinstance(getattr(model, head, None), torch.nn.Linear):
            plan[head] = RowwiseParallel(input_layouts=Replicate())
    return plan


def adamw(params, optim: OptimConfig) -> torch.optim.AdamW:
    # foreach kernels refuse lists that mix DTensor and plain tensors (norms are plain).
    return torch.optim.AdamW(
        params, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay, foreach=False
    )


def parallelize(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    """Cut `model` over the ranks of `tp_mesh` in place (a no-op for one rank)."""
    if tp_mesh is None or tp_mesh.size() == 1:
        return model
    check_tensor_parallel(model.config, tp_mesh.size())
    return parallelize_module(model, tp_mesh, llama_tp_plan(model))


def shard_dim(param: torch.Tensor) -> int | None:
    """The dim a tensor-parallel parameter is cut along (None: whole on every rank)."""
    if isinstance(param, DTensor):
        for placement in param.placements:
            if placement.is_shard():
                return placement.dim
    return None


def local(param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a parameter (the parameter itself when it is whole)."""
    return param._local_tensor if isinstance(param, DTensor) else param


class TensorParallelEngine:
    """Tensor parallel inside `tp_mesh`, data-parallel replicas over `dp_group` (pp = 1)."""

    def __init__(self, model: torch.nn.Module, optim: OptimConfig, tp_mesh, dp_group=None):
        self.model, self.optim = parallelize(model, tp_mesh), optim
        self.tp_group = tp_mesh.get_group() if tp_mesh is not None and tp_mesh.size() > 1 else None
        self.dp_group = dp_group
        self.pp_group = None  # stages of a pipeline (PipelineEngine): the norm sums over them
        self.optimizer = adamw(model.parameters(), optim)

    def train_step(self, loss_fn: LossFn, micro_batches: list[Batch], forward: Forward) -> dict[str, float]:
        """One optimizer step over micro-batches, weighted as workbench.engines.accumulation says."""
        self.optimizer.zero_grad(set_to_none=True)
        totals = accumulate_gradients(self.model, loss_fn, micro_batches, forward, self.dp_group)
        return self._step(totals)

    def _step(self, totals: dict[str, float]) -> dict[str, float]:
        """Average the replicas' gradients, clip, and step (or skip, on every rank, when the
        global norm is not finite); the step's metrics."""
        self._average_over_replicas()
        grad_norm = self._clip(self.optim.grad_clip if self.optim.grad_clip > 0 else math.inf)
        if not math.isfinite(grad_norm):  # the norm is global: every rank skips together
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteStep(
                f"the gradient norm is {grad_norm} (loss metrics {totals}); this optimizer step was skipped"
            )
        self.optimizer.step()
        return {**totals, "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"]}

    def _grads(self):
        return [(p, local(p.grad)) for p in self.model.parameters() if p.grad is not None]

    def _average_over_replicas(self) -> None:
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1:
            return
        size = dist.get_world_size(self.dp_group)
        grads = [g for _, g in self._grads()]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce, not one per tensor
        dist.all_reduce(flat, group=self.dp_group)
        flat /= size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @torch.no_grad()
    def _clip(self, max_norm: float) -> float:
        sharded = torch.zeros((), dtype=torch.float64)
        whole = torch.zeros((), dtype=torch.float64)
        for p, g in self._grads():
            square = g.double().pow(2).sum().cpu()
            if shard_dim(p) is None:
                whole += square
            else:
                sharded += square
        if self.tp_group is not None:
            sharded = all_reduce_small(sharded, self.tp_group)
        total = sharded + whole  # this stage's; each parameter lives on one stage
        if self.pp_group is not None:
            total = all_reduce_small(total, self.pp_group)
        norm = float(total.sqrt())
        if math.isfinite(norm) and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for _, g in self._grads():
                g.mul_(scale)
        return norm

    @torch.no_grad()
    def iter_full_weights(self):
        """(name, unsharded tensor) of every parameter and buffer, one at a time (collectives:
        every rank must consume the iterator to the end)."""
        for name, value in self.model.state_dict().items():
            yield name, (value.full_tensor() if isinstance(value, DTensor) else value).detach()

    def full_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.iter_full_weights())

    def shared_full_weights(self) -> dict[str, torch.Tensor] | None:
        """The live parameters when they are whole on this rank (tp = 1), else None."""
        if self.tp_group is not None:
            return None
        return {name: local(p).detach() for name, p in self.model.named_parameters()}

    def save(self, path: str) -> None:
        """Sharded model + optimizer state (torch.distributed.checkpoint; each rank its shard)."""
        save_sharded(self.model, self.optimizer, path)

    def load(self, path: str) -> None:
        load_sharded(self.model, self.optimizer, path)
