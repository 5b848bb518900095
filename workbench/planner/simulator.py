"""Analytical time of one model function call under a parallel strategy (HybridFlow §6).

Training and inference are compute-bound: FLOPs over achieved throughput, plus tensor-parallel
collectives per layer, the pipeline bubble as the runtime runs it (workbench.engines.pipeline:
a training step's m micro-batches go through one GPipe schedule, (p-1)/m extra, the bubble
being (p-1)/(m+p-1) of the step; a scoring forward takes one micro-batch at a time through the
stages, p-1 extra) and, for training, the
data-parallel gradient reduce-scatter + parameter all-gather of a distributed optimizer, and
the optimizer step itself (memory-bound: Adam streams its states once per step).
Generation is memory-bound: every decoding step reads the weights and the KV cache once
(over HBM bandwidth) plus two tensor-parallel all-reduces per layer; the prompt prefill is
compute-bound. When the KV cache of a replica's whole batch does not fit the memory left,
the batch is decoded in several waves (as a paged-attention engine would).

Small per-device work is less efficient, which is what stops "more tensor parallelism" from
always winning: every kernel costs `kernel_latency` beyond its bytes and FLOPs (Hockney's
n½ model; `KERNELS_PER_LAYER` per layer), every tensor-parallel all-reduce pays
`collective_latency` (2 per layer per decoding step), and every forward pass or decoding step
pays `step_overhead` (sampling, scheduling). `calibrate` fits them on this machine; the GPU
presets document their defaults.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

from workbench import transfers
from workbench.layouts import gather_groups
from workbench.mesh import Mesh
from workbench.planner.errors import PlannerError
from workbench.planner.memory import (
    ADAM_BYTES,
    GRAD_BYTES,
    WEIGHT_BYTES,
    frozen_keep_in,
    generation_concurrency,
    transition,
)
from workbench.planner.specs import ClusterSpec, ModelSpec, Workload

if TYPE_CHECKING:
    from workbench.planner.dataflow import Call, Dataflow

INF = float("inf")
OPTIMIZER_STEP_BYTES = GRAD_BYTES + 2 * ADAM_BYTES + WEIGHT_BYTES
# Kernels of one Llama block in a forward pass or decoding step: 2 RMSNorms, fused QKV,
# rotary, attention, output projection, 2 residual adds, gate+up, SiLU·mul, down.
KERNELS_PER_LAYER = 11


def pipeline_bubble(pp: int, micro_batches: int) -> float:
    """A GPipe schedule's time over the bubble-free time: (m + p - 1) / m for m micro-batches
    on p stages, so the bubble is (p - 1) / (m + p - 1) of the step."""
    return (micro_batches + pp - 1) / micro_batches


class Simulator:
    """Estimates call times for one cluster and workload; results are memoised."""

    def __init__(self, cluster: ClusterSpec, workload: Workload):
        if workload.frozen_keep == "auto":
            raise PlannerError(
                "Workload.frozen_keep='auto' is a choice automap and search make; a Simulator (and the "
                "evaluators and mappers built on one) prices 'whole', 'sharded' or 'host'"
            )
        self.cluster, self.wl = cluster, workload
        self.dtype_bytes = cluster.dtype_bytes
        self._widen = cluster.dtype_bytes / WEIGHT_BYTES  # bf16 byte counts -> the cluster's dtype
        self._memo: dict[tuple, float] = {}

    # --- links and collectives -------------------------------------------------------------
    def _intra(self) -> float:
        return self.cluster.intra_node_bandwidth * self.cluster.comm_efficiency

    def _inter_per_device(self) -> float:
        c = self.cluster
        return c.inter_node_bandwidth / c.devices_per_node * c.comm_efficiency

    def allreduce(self, nbytes: float, group: int, n_ops: float = 1, *, members_per_node: int | None = None) -> float:
        """Ring all-reduce of `nbytes` total over `group` ranks, as `n_ops` collectives:
        2(g-1)/g·bytes over the link (Patarasuk & Yuan 2009). A group spanning machines
        reduces inside each machine first, so the network carries 1/k of the data per device
        for k members per machine."""
        if group <= 1:
            return 0.0
        k = group if members_per_node is None else members_per_node
        ring = 2 * (group - 1) / group * nbytes
        if k >= group:
            return ring / self._intra() + n_ops * self.cluster.collective_latency
        intra = 2 * (k - 1) / k * nbytes / self._intra() if k > 1 else 0.0
        return intra + ring / (k * self._inter_per_device()) + 2 * n_ops * self.cluster.collective_latency

    def link_bandwidth(self, crosses_nodes: bool) -> float:
        return self._inter_per_device() if crosses_nodes else self._intra()

    # --- the three call kinds --------------------------------------------------------------
    def train(self, spec: ModelSpec, s: Mesh, batch_factor: float = 1.0) -> float:
        key = ("train", spec, s, batch_factor)
        if key not in self._memo:
            self._memo[key] = self._pass(spec, s, batch_factor, train=True)
        return self._memo[key]

    def inference(self, spec: ModelSpec, s: Mesh, batch_factor: float = 1.0, trained: bool = True) -> float:
        """A forward-only call; `trained=False` for a frozen model, kept as the workload's
        `frozen_keep` says: whole (its forward gathers nothing), sharded (it gathers as FSDP
        does) or in host memory (it also copies its shards in)."""
        key = ("inference", spec, s, batch_factor, trained)
        if key not in self._memo:
            self._memo[key] = self._pass(spec, s, batch_factor, train=False, trained=trained)
        return self._memo[key]

    def _pass(self, spec: ModelSpec, s: Mesh, bf: float, *, train: bool, trained: bool = True) -> float:
        c, wl = self.cluster, self.wl
        seqs = wl.sequences * bf
        epochs = wl.epochs if train else 1
        steps = wl.epochs * wl.mini_batches if train else 1
        tokens = seqs * wl.forward_tokens(train, s.pp, spec.param_count) * epochs
        # fwd = 1, bwd = 2 forward-equivalents, recomputation one more forward.
        passes = (4 if wl.gradient_checkpointing else 3) if train else 1
        eff = c.train_efficiency if train else c.inference_efficiency
        flops = tokens * spec.forward_flops_per_token(wl.seq_len / 2) * passes
        compute = flops / (s.world_size * c.peak_flops * eff)

        # Micro-batches per optimizer step per replica: m in the GPipe bubble (p-1)/m.
        per_step = seqs * epochs / steps / s.dp
        micro = max(1, math.ceil(per_step / wl.micro_batch_size))
        n_micro = micro * steps
        tokens_replica = tokens / s.dp
        act_bytes = tokens_replica * spec.hidden * self.dtype_bytes
        # Megatron TP: 2 all-reduces per layer per forward, 2 per backward.
        ar_per_layer = 2 * passes if train else 2
        layers = spec.n_layers / s.pp
        tp = self.allreduce(act_bytes * layers * ar_per_layer, s.tp, n_ops=layers * ar_per_layer * n_micro)
        bubble = pipeline_bubble(s.pp, micro if train else 1)
        # Fixed framework cost per forward-equivalent of each micro-batch (0 on GPU presets).
        overhead = n_micro * (
            passes * (c.step_overhead + self.kernel_time(spec, s))
            + (c.train_overhead if train else c.inference_overhead)
        )
        total = (compute + tp + overhead) * bubble
        if s.pp > 1:  # activations forward (and their gradients backward) between stages
            hops = 2 if train else 1
            total += (
                hops * act_bytes / self.link_bandwidth(s.replica_spans_nodes(c.devices_per_node))
                + hops * n_micro * c.collective_latency
            )
        if train:
            # Adam is memory-bound: every optimizer step reads this device's gradients, reads
            # and writes its master weights and both moments, and writes the weights.
            params = spec.trainable_params / s.world_size  # under LoRA: the adapters only
            total += steps * params * OPTIMIZER_STEP_BYTES / (c.memory_bandwidth * c.bandwidth_efficiency)
        # Frozen models kept as FSDP shards (or their shards in host memory).
        keep = "whole" if trained else frozen_keep_in(wl.frozen_keep, s)
        frozen_sharded = keep != "whole"
        # Sharing prompts makes two model calls per micro-batch: each gathers (and copies in) again.
        calls = 2 if wl.shares_prompts(train, s.pp, spec.param_count) else 1
        if keep == "host":  # every forward copies this rank's shards in
            kept = spec.param_count / s.dp * self.dtype_bytes
            total += calls * n_micro * kept / c.host_bandwidth
        if s.dp > 1 and ((wl.param_sharding == "full" and trained) or frozen_sharded):
            # FSDP / ZeRO-3: per micro-batch, one all-gather of every layer's parameters per
            # forward (two when training: the backward gathers again) and, when training, one
            # gradient reduce-scatter; each moves half an all-reduce's volume.
            weights = spec.param_count / s.model_parallel
            gathers = (2 if train else 1) * calls
            volume = weights * (gathers * self.dtype_bytes + (GRAD_BYTES if train else 0)) / 2
            units = spec.n_layers / s.pp + 1  # one FSDP unit per decoder layer, plus the root
            n_ops = (gathers + train) * units * n_micro
            total += n_ops * c.shard_overhead + self.allreduce(
                volume * n_micro, s.dp, n_ops=n_ops, members_per_node=s.dp_peers_per_node(c.devices_per_node)
            )
        elif train and s.dp > 1:
            # Distributed optimizer: reduce-scatter fp32 grads + all-gather the params,
            # the volume of half an all-reduce each.
            shard = spec.param_count / s.model_parallel * (GRAD_BYTES + self.dtype_bytes) / 2
            total += self.allreduce(
                shard * steps, s.dp, n_ops=2 * steps, members_per_node=s.dp_peers_per_node(c.devices_per_node)
            )
        return total

    def kernel_time(self, spec: ModelSpec, s: Mesh) -> float:
        """Fixed kernel costs of one forward pass or decoding step on one pipeline stage's
        layers (the stages run one after another for one micro-batch)."""
        return KERNELS_PER_LAYER * spec.n_layers * self.cluster.kernel_latency

    def generate(self, spec: ModelSpec, s: Mesh, kv_budget: float = INF, batch_factor: float = 1.0) -> float:
        """Prefill + max_new_tokens decoding steps per wave; INF if not one sequence fits."""
        wl = self.wl
        batch = math.ceil(wl.sequences * batch_factor / s.dp)
        conc = generation_concurrency(spec, s, wl, kv_budget) if kv_budget < INF else batch
        return self.generate_waves(spec, s, batch, min(batch, conc))

    def generate_waves(self, spec: ModelSpec, s: Mesh, batch: int, conc: int) -> float:
        """Seconds to generate `batch` sequences per replica, `conc` at a time."""
        if conc < 1:
            return INF
        key = ("generate", spec, s, batch, conc)
        if key in self._memo:
            return self._memo[key]
        c, wl = self.cluster, self.wl
        waves = math.ceil(batch / conc)
        b = math.ceil(batch / waves)
        # A step streams every weight once per replica (the pipeline stages take turns on one
        # batch, so PP saves memory but not time) plus the KV cache at the mean context.
        ctx = wl.prompt_len + wl.max_new_tokens / 2
        read = (spec.param_count * self.dtype_bytes + b * spec.kv_bytes_per_token * self._widen * ctx) / s.tp
        mem = read / (c.memory_bandwidth * c.bandwidth_efficiency)
        comp = 2 * spec.matmul_params * b / (s.tp * c.peak_flops * c.inference_efficiency)
        fixed = c.step_overhead + self.kernel_time(spec, s)
        step = (max(mem, comp) if c.decode_overlap else mem + comp) + fixed + b * c.sequence_overhead
        if s.tp > 1:
            step += self.allreduce(
                b * spec.hidden * self.dtype_bytes * spec.n_layers * 2, s.tp, n_ops=2 * spec.n_layers
            )
        prefill_flops = b * wl.prompt_len * spec.forward_flops_per_token(wl.prompt_len / 2)
        prefill = prefill_flops / (s.tp * c.peak_flops * c.inference_efficiency) + fixed
        if s.tp > 1:
            prefill += self.allreduce(
                b * wl.prompt_len * spec.hidden * self.dtype_bytes * spec.n_layers * 2, s.tp, n_ops=2 * spec.n_layers
            )
        if s.pp > 1:
            # The stages run in turn (workbench.engines.pipelined_rollout): the hidden states hop
            # down them, and the last stage's logits (the last position's) go back to every stage
            # by a tree broadcast, so that each samples alike. Hops cross machines when a replica
            # (pp*tp consecutive ranks of `s`) spans them; the hybrid engine's hybridflow grouping
            # strides a generation replica over its training replica instead, not modelled here.
            link = self.link_bandwidth(s.replica_spans_nodes(c.devices_per_node))
            logits = math.ceil(math.log2(s.pp)) * (c.collective_latency + b * spec.vocab * self.dtype_bytes / link)
            hop = c.collective_latency + b * spec.hidden * self.dtype_bytes / link
            step += (s.pp - 1) * hop + logits
            prefill += (s.pp - 1) * (hop + (wl.prompt_len - 1) * b * spec.hidden * self.dtype_bytes / link) + logits
        t = waves * (prefill + wl.max_new_tokens * step)
        self._memo[key] = t
        return t

    def call_time(self, call: Call, spec: ModelSpec, s: Mesh, kv_budget: float = INF, trained: bool = True) -> float:
        """Seconds of one call as the driver sees it: its work plus `call_overhead`
        (`trained`: whether the call's model is trained, see `inference`)."""
        if call.kind == "train":
            work = self.train(spec, s, call.batch_factor)
        elif call.kind == "inference":
            work = self.inference(spec, s, call.batch_factor, trained)
        else:
            work = self.generate(spec, s, kv_budget, call.batch_factor)
        return work + self.cluster.call_overhead

    # --- moving parameters and data ---------------------------------------------------------
    def reshard_time(self, spec: ModelSpec, train: Mesh, gen: Mesh, method: str | None = None) -> float:
        """3D-HybridEngine train->generation switch as the runtime runs it
        (`Workload.transition_executor`): by default a reallocation, each device moving the bytes
        the engine's transfer plan counts (`switch_bytes`); with "allgather", Table 2's bytes
        (`memory.transition`) over the links its all-gather group spans."""
        method = method or self.wl.transition
        key = ("reshard", spec, train, gen, method)
        if key not in self._memo:
            self._memo[key] = self._reshard(spec, train, gen, method)
        return self._memo[key]

    def _reshard(self, spec: ModelSpec, train: Mesh, gen: Mesh, method: str) -> float:
        t = transition(spec, train, gen, method)
        # Under LoRA only the adapters move (ModelSpec.synced_params), gathered in one collective
        # (the engines' gather_weights); the frozen base stays in the generation engine.
        share = spec.synced_params / spec.param_count
        gather = 0.0
        if self.wl.param_sharding == "full" and train.dp > 1:
            # Table 2 assumes data-parallel replicas hold whole training shards; FSDP / ZeRO-3
            # ranks hold 1/dp of one, so each first all-gathers its generation shard: tensor by
            # tensor, as the workers' sync does (`iter_full_weights`; the LoRA adapters in one
            # collective), half an all-reduce's volume in all.
            shard = spec.synced_params / gen.model_parallel * self.dtype_bytes
            n_ops = 1 if spec.lora_rank else synced_tensors(spec)
            gather = n_ops * self.cluster.gather_overhead + self.allreduce(
                shard / 2,
                train.dp,
                n_ops=n_ops,
                members_per_node=train.dp_peers_per_node(self.cluster.devices_per_node),
            )
        copy = self.weight_copy_time(t.generation_params * share * self._widen)
        u = self.cluster.devices_per_node
        if self.wl.transition_executor == "reallocate":
            per_rank = switch_bytes(spec, train, gen, method, self.dtype_bytes)
            busiest = max(max(b) for b in per_rank.values()) * share
            # Every rank of the switch is a source rank, so its sender is in its own training
            # replica (realloc's rule 2): the bytes cross machines only where a replica does.
            return gather + copy + self._moved_time(busiest, train.replica_spans_nodes(u), spec.n_layers)
        crosses = _gather_crosses(train.with_generation(gen, method), u)
        return (
            gather
            + copy
            + (
                0.0
                if t.comm_bytes <= 0
                else t.comm_bytes * share * self._widen / self.link_bandwidth(crosses) + self.cluster.collective_latency
            )
        )

    def _moved_time(self, busiest: float, crosses: bool, n_layers: int) -> float:
        """A reallocation's time: the busiest device's bytes over its link plus one collective
        latency per layer unit (the runtime moves one layer at a time); 0 when nothing moves."""
        if busiest <= 0:
            return 0.0
        return busiest / self.link_bandwidth(crosses) + (n_layers + 2) * self.cluster.collective_latency

    def rollout_push_time(
        self, spec: ModelSpec, trainer: Mesh, rollout: Mesh, crosses_nodes: bool, model: str | None = None
    ) -> float:
        """A rollout group brought up to date after an update, as the workload's runtime moves it
        (`Workload.rollout_weights`): reallocated into from every trainer rank
        (`replica_realloc_time`) where `rollout_reallocates`, else broadcast from rank 0
        (`weight_push_time`). `model`: the trained model's name in the workload."""
        if self.rollout_reallocates(spec, trainer, model):
            return self.replica_realloc_time(spec, trainer, rollout, crosses_nodes)
        return self.weight_push_time(spec, trainer, rollout, crosses_nodes)

    def rollout_reallocates(self, spec: ModelSpec, trainer: Mesh, model: str | None = None) -> bool:
        """Whether the runtime reallocates into a rollout group (`reallocatable`): asked for by
        the workload, whole weights (no LoRA) out of an FSDP trainer (tp = pp = 1, `model` not
        among `Workload.broadcast_homes`); else the broadcast."""
        flat = trainer.tp == 1 and trainer.pp == 1 and model not in self.wl.broadcast_homes
        return self.wl.rollout_weights == "reallocate" and not spec.lora_rank and flat

    def weight_push_time(self, spec: ModelSpec, trainer: Mesh, rollout: Mesh, crosses_nodes: bool) -> float:
        """Asynchronous RL's weight push (`workbench.hybrid.channel`), after every update: the
        trainer's rank 0 collects what the rollout holds (every weight, or under LoRA the
        adapters: `ModelSpec.synced_params`) from its model-parallel or FSDP peers, broadcasts it
        tensor by tensor to every rollout rank (pipelined, as NCCL's ring and tree broadcasts
        are: every link carries the bytes once), and each rank loads it in place. Each tensor
        pays one `collective_latency` (per level of gloo's broadcast tree, `broadcast_tree`, as do
        the bytes): its two header broadcasts are a few bytes, and the fitted
        latency is a whole all-reduce's (a ring of messages); charging three per tensor made the
        measured push of bench/async_rl.py's first run (84 ms, tiny-10m, this machine) twice the
        estimate, one per tensor within about 20%. `crosses_nodes`: the pools are on different
        machines (the network's share of one device carries the bytes)."""
        nbytes, tensors = spec.synced_params * self.dtype_bytes, synced_tensors(spec)
        gather = self._gather_time(spec, trainer)
        send = nbytes / self.link_bandwidth(crosses_nodes) + tensors * self.cluster.collective_latency
        if self.cluster.broadcast_tree:  # gloo: the tree's levels send in turn
            send *= math.ceil(math.log2(rollout.world_size + 1))
        return gather + send + self.weight_copy_time(nbytes / rollout.model_parallel)

    def replica_realloc_time(self, spec: ModelSpec, home: Mesh, copy: Mesh, crosses_nodes: bool) -> float:
        """A trained model's data- or tensor-parallel copy brought up to date by reallocation, as the
        runtime moves a critic's replica or a reallocated rollout group (`WeightLink`,
        reallocate): one layer unit at a time,
        every home rank gathers the unit from the FSDP shards (the push's gather) and sends it
        whole, point to point, to its share of the copy's ranks (copy rank i from home rank
        i mod n: the busiest sends ceil(m/n) copies, in turn), and each copy rank loads it in
        place (a tensor-parallel copy rank: its pieces). A tensor-parallel home (pp = 1) sends
        straight from its pieces, with no gather. One `collective_latency` per layer unit and per
        tensor, as the push pays."""
        nbytes, tensors = spec.synced_params * self.dtype_bytes, synced_tensors(spec)
        # The busiest source's bytes by the runtime's own transfer plan: from a tensor-parallel
        # home's own pieces, else whole weights on the home's n ranks (after the FSDP gather),
        # to the copy's layout on the next ranks.
        n, pieces = home.world_size, home.tp > 1
        src = Mesh(1, home.tp, home.dp) if pieces else Mesh(1, 1, n)
        per_rank = realloc_bytes(spec, src, 0, Mesh(copy.pp, copy.tp, copy.dp), n, self.dtype_bytes)
        busiest = max(moved.sent for moved in per_rank.values())
        units = spec.n_layers + 2
        send = busiest / self.link_bandwidth(crosses_nodes) + (units + tensors) * self.cluster.collective_latency
        gather = 0.0 if pieces else self._gather_time(spec, home)
        return gather + send + self.weight_copy_time(nbytes / copy.model_parallel)

    def _gather_time(self, spec: ModelSpec, trainer: Mesh) -> float:
        """Whole weights out of a trained group's shards before they travel to a copy: an
        all-gather per tensor over the FSDP ranks (or the model-parallel peers)."""
        nbytes, tensors = spec.synced_params * self.dtype_bytes, synced_tensors(spec)
        sharded = self.wl.param_sharding == "full" and trainer.dp > 1
        group = trainer.world_size if sharded else trainer.model_parallel
        return self.allreduce(
            nbytes / 2, group, n_ops=tensors, members_per_node=min(group, self.cluster.devices_per_node)
        ) + (tensors * self.cluster.gather_overhead if group > 1 else 0.0)

    def weight_copy_time(self, nbytes: float) -> float:
        """Writing the generation weights into their separate buffer (HybridFlow keeps one
        for training and one for generation): read + write at memory bandwidth."""
        c = self.cluster
        return 2 * nbytes / (c.memory_bandwidth * c.bandwidth_efficiency)

    def realloc_time(
        self, spec: ModelSpec, src: Mesh, src_devs: tuple[int, int], dst: Mesh, dst_devs: tuple[int, int]
    ) -> float:
        """ReaLHF parameter reallocation between two layouts: the busiest device's bytes (the
        larger of what it sends and receives: links are full duplex), as the runtime's transfer
        plan counts them (`realloc_bytes`), over the link the two meshes span, plus one
        collective latency per layer unit (the runtime moves one layer at a time). 0 when
        nothing moves (same layout on the same devices, or every device already holds its
        destination shard)."""
        if src == dst and src_devs == dst_devs:
            return 0.0
        per_rank = realloc_bytes(spec, src, src_devs[0], dst, dst_devs[0], self.dtype_bytes)
        # Under LoRA only the adapters move (the base was moved once): scale the weights' bytes.
        busiest = max(max(b) for b in per_rank.values()) * spec.synced_params / spec.param_count
        lo, hi = min(src_devs[0], dst_devs[0]), max(src_devs[1], dst_devs[1])
        u = self.cluster.devices_per_node
        return self._moved_time(busiest, lo // u != (hi - 1) // u, spec.n_layers)

    def output_bytes(self, call: Call) -> float:
        """Bytes a call hands to its dependants: generated token ids (int64) and log-probs
        for generation; one fp32 per response token for inference; nothing for training."""
        wl = self.wl
        seqs = wl.sequences * call.batch_factor
        if call.kind == "generate":
            return seqs * (wl.seq_len * 8 + wl.max_new_tokens * 4)
        if call.kind == "inference":
            return seqs * wl.max_new_tokens * 4
        return 0.0

    def driver_time(self, gathered: list[Call], n_trained: int) -> float:
        """The driver-side steps: gather the outputs of `gathered` calls (advantages are
        computed on the driver) and send the assembled batch to each of `n_trained` models."""
        batch = sum(self.output_bytes(c) for c in gathered)
        return (1 + n_trained) * batch / self.cluster.driver_bandwidth

    def driver_step_time(self, flow: Dataflow) -> float:
        """`driver_time` of one iteration of `flow`: its `driver_inputs` gathered, the batch sent
        to each of its trained models."""
        n_trained = sum(c.kind == "train" for c in flow.calls)
        return self.driver_time([flow.call(d) for d in flow.driver_inputs()], n_trained)

    def data_transfer_time(self, nbytes: float, crosses_nodes: bool) -> float:
        if nbytes <= 0:
            return 0.0
        c = self.cluster
        bw = (c.inter_node_bandwidth * c.comm_efficiency) if crosses_nodes else self._intra()
        return nbytes / bw + c.collective_latency


def synced_tensors(spec: ModelSpec) -> int:
    """Tensors a weight push sends: per block the 7 projections and 2 norms, plus the embedding,
    the final norm and the head; under LoRA the A and B matrices of each adapted projection."""
    return 14 * spec.n_layers if spec.lora_rank else 9 * spec.n_layers + 3


_DTYPES = {2: "bfloat16", 4: "float32", 8: "float64"}


def realloc_bytes(
    spec: ModelSpec, src: Mesh, src_first: int, dst: Mesh, dst_first: int, dtype_bytes: int = 2
) -> dict[int, transfers.RankBytes]:
    """Bytes each device sends and receives when `spec`'s weights move from `src` on devices
    src_first.. to `dst` on dst_first.. (layer units split evenly over pipeline stages): the
    runtime's own transfer plan (`workbench.transfers.rank_bytes`) over the model's Llama
    shapes, so the planner and `workbench.hybrid.reallocate` count the same bytes."""
    if dtype_bytes not in _DTYPES:
        raise ValueError(f"realloc_bytes: dtype_bytes={dtype_bytes!r}; use one of {sorted(_DTYPES)}")
    return _realloc_bytes(spec, src.pp, src.tp, src.dp, src_first, dst.pp, dst.tp, dst.dp, dst_first, dtype_bytes)


def switch_bytes(
    spec: ModelSpec, train: Mesh, gen: Mesh, method: str, dtype_bytes: int = 2
) -> dict[int, transfers.RankBytes]:
    """Bytes each device sends and receives in the hybrid engine's switch from `train` to the
    generation layout `gen` by `method`, run as a reallocation: the runtime's own count
    (`workbench.transfers.switch_bytes`) over the model's Llama shapes."""
    if dtype_bytes not in _DTYPES:
        raise ValueError(f"switch_bytes: dtype_bytes={dtype_bytes!r}; use one of {sorted(_DTYPES)}")
    return _switch_bytes(spec, train.pp, train.tp, train.dp, gen.pp, gen.tp, method, dtype_bytes)


@lru_cache(maxsize=4096)
def _switch_bytes(spec: ModelSpec, pp, tp, dp, gen_pp, gen_tp, method, dtype_bytes) -> dict:
    return transfers.switch_bytes(_llama_params(spec, dtype_bytes), Mesh(pp, tp, dp, gen_pp, gen_tp, method))


@lru_cache(maxsize=64)
def _llama_params(spec: ModelSpec, dtype_bytes: int) -> list[transfers.Param]:
    shapes = transfers.llama_shapes(
        spec.hidden, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.intermediate, spec.vocab, spec.value_head
    )
    return transfers.llama_params(shapes, spec.n_layers, _DTYPES[dtype_bytes])


@lru_cache(maxsize=4096)  # the search asks for the same pairs of layouts many times
def _realloc_bytes(spec: ModelSpec, p1, t1, d1, first1, p2, t2, d2, first2, dtype_bytes) -> dict:
    return transfers.rank_bytes(
        _llama_params(spec, dtype_bytes),
        transfers.Placement(Mesh(p1, t1, d1), first1),
        transfers.Placement(Mesh(p2, t2, d2), first2),
    )


@lru_cache(maxsize=4096)
def _gather_crosses(mesh: Mesh, devices_per_node: int) -> bool:
    """Whether any of the switch's all-gather groups (the hybrid engine's own, members in rank
    order) spans machines."""
    u = devices_per_node
    return any(g[0] // u != g[-1] // u for g in gather_groups(mesh))
