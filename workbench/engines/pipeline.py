"""Pipeline-parallel training and scoring of Llama-architecture models (backend "3d" with pp > 1),
composed with tensor parallelism inside each stage and data-parallel replicas, on PyTorch's own
`torch.distributed.pipelining` (PipelineStage + ScheduleGPipe).

The engine keeps the engines' interface. Its `model` is called like the HF model it was cut
from, so the workers' forwards (`response_log_probs`, `response_values`, `sequence_nll`) run
unchanged:
- a plain call (scoring, no grad) runs the stages one after another over the pp group and
  broadcasts the last stage's output to every rank of it, so any rank can return the result;
- in `train_step` the worker's forward runs twice per micro-batch: first against a recorder
  (zeros of the right shape) that captures the model calls it makes, then, on the last stage
  inside the schedule's loss, against the pipeline's real output for those calls. Between the
  two, every micro-batch's calls go through one GPipe schedule: all micro-batches' forwards,
  then all backwards, the loss weighted per micro-batch as workbench.engines.accumulation says.

A schedule's micro-batches must share one shape, so each call's columns are left-padded with
masked positions (explicit position ids: causal attention never sees them) and each
micro-batch's rows are padded with copies of its first row; the padding's outputs are dropped
before the loss sees them. Stages and schedules are built per call (shapes change between
calls); the shapes are given to PipelineStage, so it infers nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor

from workbench.data.batch import Batch
from workbench.engines.accumulation import combine_metrics, micro_batch_weights
from workbench.engines.checkpoint import load_sharded, save_sharded
from workbench.engines.contract import Forward, LossFn, OptimConfig
from workbench.engines.pipeline_stages import Stage, output_width
from workbench.engines.tensor_parallel import TensorParallelEngine, adamw, parallelize


@dataclass
class Call:
    """One model call a forward makes: its inputs, made explicit, and how many trailing
    positions it asked logits for (0: all)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    keep: int

    @classmethod
    def of(cls, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0) -> Call:
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:  # HF's default; explicit, since left padding would shift it
            position_ids = torch.arange(t, device=input_ids.device)
        return cls(input_ids, attention_mask, position_ids.expand(b, t), int(logits_to_keep))

    def padded(self, cols: int) -> tuple[torch.Tensor, ...]:
        left = (cols - self.input_ids.shape[1], 0)
        return tuple(F.pad(t, left, value=0) for t in (self.input_ids, self.attention_mask, self.position_ids))


@dataclass
class Packed:
    """Every micro-batch's calls as one schedule input: M micro-batches of `rows` x `cols`."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    rows: int
    cols: int
    calls: list[list[Call]]

    @classmethod
    def of(cls, calls: list[list[Call]]) -> Packed:
        cols = max(c.input_ids.shape[1] for group in calls for c in group)
        rows = max(sum(len(c.input_ids) for c in group) for group in calls)
        parts: list[list[torch.Tensor]] = [[], [], []]
        for group in calls:
            stacked = [torch.cat(ts) for ts in zip(*(c.padded(cols) for c in group))]
            for part, t in zip(parts, stacked):
                extra = t[:1].expand(rows - len(t), cols)  # copies of a real row: finite outputs
                part.append(torch.cat([t, extra]))
        ids, mask, pos = (torch.cat(p) for p in parts)
        return cls(ids, mask, pos, rows, cols, calls)

    def unpack(self, index: int, output: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of micro-batch `index`'s calls, padding dropped, as each call asked."""
        out, offset = [], 0
        for call in self.calls[index]:
            b, t = call.input_ids.shape
            piece = output[offset : offset + b, self.cols - t :]
            out.append(piece[:, -call.keep :] if call.keep else piece)
            offset += b
        return out


class PipelinedModel(torch.nn.Module):
    """This rank's stage, called like the whole HF model (see the module docstring)."""

    pipeline_parallel = True  # its calls take 2D masks and integer logits_to_keep: no packing

    def __init__(self, model: torch.nn.Module, pp_mesh):
        super().__init__()
        self.config = model.config
        self.width, self.hidden = output_width(model), model.config.hidden_size
        self.group = pp_mesh.get_group()
        self.index, self.pp = pp_mesh.get_local_rank(), pp_mesh.size()
        self.last_rank = dist.get_process_group_ranks(self.group)[-1]
        self.stage = Stage(model, self.index, self.pp)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._record: list[Call] | None = None
        self._replay: list[torch.Tensor] | None = None

    @property
    def hf(self) -> torch.nn.Module:
        """The HF model, holding only this stage's parts (global parameter names)."""
        return self.stage.hf

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, **_):
        call = Call.of(input_ids, attention_mask, position_ids, logits_to_keep)
        b, t = input_ids.shape
        shape = (b, call.keep or t, self.width)
        if self._record is not None:
            self._record.append(call)
            return SimpleNamespace(logits=torch.zeros(shape, dtype=self.dtype, device=self.device))
        if self._replay is not None:
            return SimpleNamespace(logits=self._replay.pop(0))
        with torch.no_grad():
            out = self.schedule(b, t, 1).step(
                call.input_ids, attention_mask=call.attention_mask, position_ids=call.position_ids
            )
            if self.stage.last:
                logits = (out[:, -call.keep :] if call.keep else out).contiguous()
            else:
                logits = torch.empty(shape, dtype=self.dtype, device=self.device)
            dist.broadcast(logits, src=self.last_rank, group=self.group)
        return SimpleNamespace(logits=logits)

    def schedule(self, rows: int, cols: int, n: int, loss_fn=None) -> ScheduleGPipe:
        """A GPipe schedule of n micro-batches of rows x cols over this rank's stage (a backward
        when loss_fn is given)."""
        grad = loss_fn is not None  # activations carry gradients back only when training

        def meta(*shape, dtype=self.dtype):
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad and dtype.is_floating_point)

        inputs = meta(rows, cols, dtype=torch.long) if self.stage.first else meta(rows, cols, self.hidden)
        outputs = meta(rows, cols, self.width if self.stage.last else self.hidden)
        stage = PipelineStage(
            self.stage, self.index, self.pp, self.device, input_args=inputs, output_args=outputs, group=self.group
        )
        return ScheduleGPipe(stage, n, loss_fn=loss_fn, scale_grads=False)

    def record(self, forward: Forward, micro_batch: Batch) -> list[Call]:
        """The model calls `forward` makes for `micro_batch` (no compute: zeros come back)."""
        self._record = []
        try:
            with torch.no_grad():
                forward(self, micro_batch)
            return self._record
        finally:
            self._record = None

    def replay(self, forward: Forward, micro_batch: Batch, logits: list[torch.Tensor]):
        """`forward`'s outputs for `micro_batch`, its model calls answered by `logits`."""
        self._replay = list(logits)
        try:
            return forward(self, micro_batch)
        finally:
            self._replay = None


class PipelineEngine(TensorParallelEngine):
    """Pipeline stages over `pp_mesh`, tensor parallel inside each stage over `tp_mesh`,
    data-parallel replicas over `dp_group`."""

    def __init__(self, model: torch.nn.Module, optim: OptimConfig, pp_mesh, tp_mesh=None, dp_group=None):
        model = parallelize(model, tp_mesh)  # the whole model's names fit the tensor-parallel plan
        self.model, self.optim = PipelinedModel(model, pp_mesh), optim
        self.tp_group = tp_mesh.get_group() if tp_mesh is not None and tp_mesh.size() > 1 else None
        self.pp_group, self.dp_group = self.model.group, dp_group
        self.optimizer = adamw(self.model.hf.parameters(), optim)

    def train_step(self, loss_fn: LossFn, micro_batches: list[Batch], forward: Forward) -> dict[str, float]:
        """One optimizer step: every micro-batch through one GPipe schedule, weighted as
        workbench.engines.accumulation says; loss metrics from the last stage, on every rank."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        weights, shares = micro_batch_weights(loss_fn, micro_batches, self.dp_group)
        packed = Packed.of([self.model.record(forward, mb) for mb in micro_batches])
        parts: list[dict] = []

        def stage_loss(output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            k = int(index)
            outputs = self.model.replay(forward, micro_batches[k], packed.unpack(k, output))
            loss, metrics = loss_fn(outputs, micro_batches[k])
            parts.append(metrics)
            return loss * weights[k]

        schedule = self.model.schedule(packed.rows, packed.cols, len(micro_batches), stage_loss)
        target = torch.arange(len(micro_batches), device=self.model.device)
        schedule.step(
            packed.input_ids.to(self.model.device),
            target=target,
            attention_mask=packed.attention_mask.to(self.model.device),
            position_ids=packed.position_ids.to(self.model.device),
        )
        totals = [combine_metrics(parts, shares) if self.model.stage.last else None]
        dist.broadcast_object_list(totals, src=self.model.last_rank, group=self.pp_group)
        return self._step(totals[0])

    @torch.no_grad()
    def iter_full_weights(self):
        """(name, unsharded tensor) of every parameter and buffer of every stage, on every rank,
        stage by stage (collectives: every rank must consume the iterator to the end)."""
        ranks = dist.get_process_group_ranks(self.pp_group)
        for stage, src in enumerate(ranks):
            mine = stage == self.model.index
            state = self.model.hf.state_dict() if mine else {}
            names = [[(n, tuple(v.shape), v.dtype) for n, v in state.items()] if mine else None]
            dist.broadcast_object_list(names, src=src, group=self.pp_group)
            for name, shape, dtype in names[0]:
                if mine:
                    value = state[name]
                    value = (value.full_tensor() if isinstance(value, DTensor) else value).detach().contiguous()
                else:
                    value = torch.empty(shape, dtype=dtype, device=self.model.device)
                dist.broadcast(value, src=src, group=self.pp_group)
                yield name, value

    def shared_full_weights(self) -> dict[str, torch.Tensor] | None:
        return None  # no rank holds every stage

    def save(self, path: str) -> None:
        """Sharded model + optimizer state under the HF model's names (each stage its layers)."""
        save_sharded(self.model.hf, self.optimizer, path, self._optim_key())

    def load(self, path: str) -> None:
        load_sharded(self.model.hf, self.optimizer, path, self._optim_key())

    def _optim_key(self) -> str:
        """The optimizer's state per stage (see checkpoint.save_sharded): a checkpoint loads
        into the same number of stages."""
        return f"optim_stage{self.model.index}_of{self.model.pp}"
