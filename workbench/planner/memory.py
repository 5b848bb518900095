"""Per-device memory of a model under a parallel strategy.

Precision as in the HybridFlow testbed (§8.1): bf16 weights, fp32 gradients, Adam with fp32
master weights and two moments. Optimizer states are sharded over data-parallel ranks too
(ZeRO-1 / Megatron distributed optimizer). Static memory (kept between calls) vs dynamic
memory (only while a call runs) follows ReaLHF's MaxMem (§2 of the reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from workbench.layouts import rank_transfer
from workbench.mesh import TRANSITION_METHODS, Mesh
from workbench.planner.specs import ModelSpec, Workload
from workbench.planner.strategy import is_generation_layout

WEIGHT_BYTES = 2  # bf16 parameters
GRAD_BYTES = 4  # fp32 gradients
ADAM_BYTES = 12  # fp32 master copy + first and second moments

# Bytes of saved activations per token per layer without recomputation, in units of h:
# 34·s·b·h per layer (Korthikanti et al. 2022, "Reducing activation recomputation", eq. 2,
# without the attention-score term, which flash attention does not store).
ACT_BYTES_PER_TOKEN_H = 34
# A forward-only pass keeps about half of one layer's working set alive at a time.
FWD_BYTES_PER_TOKEN_H = 16


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device, by kind. `static` survives between calls; the rest is per call."""

    params: float = 0.0
    """Weights resident between calls."""
    grads: float = 0.0
    """Gradients of trained models (static, as in ReaLHF)."""
    optimizer: float = 0.0
    """Adam states of trained models."""
    activations: float = 0.0
    """Saved activations / logits while a train or inference call runs."""
    kv_cache: float = 0.0
    """KV cache while generating."""
    extra_params: float = 0.0
    """A second copy of the weights in another layout (generation shards, reallocated
    parameters) while a call runs."""

    @property
    def static(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def dynamic(self) -> float:
        return self.activations + self.kv_cache + self.extra_params

    @property
    def total(self) -> float:
        return self.static + self.dynamic

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(*(a + b for a, b in zip(self._t(), other._t())))

    def _t(self) -> tuple[float, ...]:
        return (self.params, self.grads, self.optimizer, self.activations, self.kv_cache, self.extra_params)


def frozen_keep_in(frozen_keep: str, s: Mesh) -> str:
    """How a frozen model laid out as `s` is kept under the workload's `frozen_keep`: FSDP shards
    data-parallel layouts only (workbench.engines.frozen.check_keep), so tp/pp > 1 keep whole."""
    if frozen_keep == "auto":
        raise ValueError(
            "Workload.frozen_keep='auto' is a choice automap and search make; price a layout with "
            "'whole', 'sharded' or 'host'"
        )
    return frozen_keep if s.model_parallel == 1 else "whole"


def static_memory(
    spec: ModelSpec, s: Mesh, trained: bool, sharding: str = "optimizer", frozen_keep: str = "whole"
) -> MemoryBreakdown:
    """Weights (and, if trained, gradients and optimizer states) kept on each device.

    sharding "optimizer" (Megatron distributed optimizer, ZeRO-1): weights and gradients are
    replicated over data-parallel ranks, Adam states sharded. "full" (FSDP / ZeRO-3, what the
    workbench's workers train with): everything sharded over all devices. Frozen models are
    kept as `frozen_keep` says (Workload.frozen_keep, `frozen_keep_in`): "whole" on every
    data-parallel rank, cut only by tensor and pipeline parallelism; "sharded" 1/dp of that (FSDP
    shards); "host" none on the device (a layer's gathered weights while it runs are left out, as
    FSDP's are). A LoRA-trained model (spec.lora_rank > 0) keeps gradients and Adam states for its
    adapters only."""
    shard = spec.param_count / s.model_parallel
    if not trained:
        kept = {"whole": 1.0, "sharded": 1 / s.dp, "host": 0.0}[frozen_keep_in(frozen_keep, s)]
        return MemoryBreakdown(params=shard * kept * WEIGHT_BYTES)
    # Under LoRA (spec.lora_rank) only the adapters have gradients and Adam states; the frozen
    # base is kept like the trained weights (sharded the same way), plus the adapters themselves.
    trained_shard = spec.trainable_params / s.model_parallel
    adapters = spec.adapter_params / s.model_parallel
    per_dp = 1 / s.dp if sharding == "full" else 1.0
    return MemoryBreakdown(
        params=(shard + adapters) * per_dp * WEIGHT_BYTES,
        grads=trained_shard * per_dp * GRAD_BYTES,
        optimizer=trained_shard / s.dp * ADAM_BYTES,
    )


TransitionMethod = Literal["deepspeed_chat", "vanilla", "hybridflow"]


@dataclass(frozen=True)
class Transition:
    """The actor's training -> generation switch on its devices (HybridFlow Table 2), per
    device, in bytes. M is the bf16 model size."""

    method: str
    comm_bytes: float
    """Bytes each device receives in the all-gather."""
    peak_params: float
    """Parameter bytes on a device at the peak of the switch."""
    redundant: float
    """Training weights kept beside the generation shard while generating."""
    generation_params: float
    """The generation shard, M/(t_g·p_g)."""

    @property
    def resident_params(self) -> float:
        """Parameter bytes on a device while generating: the generation shard + redundancy."""
        return self.generation_params + self.redundant


def transition(spec: ModelSpec, train: Mesh, gen: Mesh, method: str = "hybridflow") -> Transition:
    """The actor's training -> generation switch per device: HybridFlow Table 2's bytes for
    a model of M bf16 bytes, as the hybrid engine counts them from the gather groups the
    runtime forms (`workbench.layouts.transition_bytes`, where the table is written
    out; the planner keeps no formula of its own)."""
    if method not in TRANSITION_METHODS:
        raise ValueError(f"transition method {method!r}: use one of {', '.join(TRANSITION_METHODS)}")
    if not is_generation_layout(train, gen):
        raise ValueError(
            f"generation layout {gen.short()} is not one the hybrid engine can switch "
            f"{train.short()} to: it needs the same devices, p_g | p and t_g | t"
        )
    return _switch(train.pp, train.tp, train.dp, gen.pp, gen.tp, method, spec.param_count * WEIGHT_BYTES)


@lru_cache(maxsize=4096)  # keyed by plain numbers: the planner asks for the same switch often
def _switch(pp: int, tp: int, dp: int, gen_pp: int, gen_tp: int, method: str, model_bytes: int) -> Transition:
    """Rank 0's bytes, which are every rank's in these layouts (`tests/hybrid/test_layouts.py`
    checks it)."""
    row = rank_transfer(Mesh(pp, tp, dp, gen_pp, gen_tp, method), model_bytes, 0)
    return Transition(
        method, float(row.received), float(row.peak_params), float(row.redundant), float(row.generation_params)
    )


def train_activations(spec: ModelSpec, s: Mesh, wl: Workload) -> float:
    """Peak activations of 1F1B training on the first stage, which holds `pp` micro-batches
    of its L/pp layers (so L layers' worth), sequence-parallel over TP, plus the last stage's
    fp32 logits. With recomputation only each layer's bf16 input (2·b·s·h) is kept, plus one
    layer's full working set."""
    bsh = wl.micro_batch_size * wl.seq_len * spec.hidden
    if wl.gradient_checkpointing:
        layers = 2 * bsh * spec.n_layers + ACT_BYTES_PER_TOKEN_H * bsh
    else:
        layers = ACT_BYTES_PER_TOKEN_H * bsh * spec.n_layers
    logits = 4 * wl.micro_batch_size * wl.seq_len * (1 if spec.value_head else spec.vocab)
    return (layers + logits) / s.tp


def inference_activations(spec: ModelSpec, s: Mesh, wl: Workload) -> float:
    """One layer's forward working set plus fp32 logits of a micro-batch."""
    bsh = wl.micro_batch_size * wl.seq_len * spec.hidden
    logits = 4 * wl.micro_batch_size * wl.seq_len * (1 if spec.value_head else spec.vocab)
    return (FWD_BYTES_PER_TOKEN_H * bsh + logits) / s.tp


def kv_bytes_per_sequence(spec: ModelSpec, s: Mesh, wl: Workload) -> float:
    """KV cache of one full-length sequence on one device of a generation replica."""
    return spec.kv_bytes_per_token * wl.seq_len / s.model_parallel


def generation_weights(spec: ModelSpec, s: Mesh) -> float:
    """bf16 weights of one generation shard (HybridFlow keeps a separate buffer)."""
    return spec.param_count * WEIGHT_BYTES / s.model_parallel


def min_static_memory(spec: ModelSpec, n_devices: int, trained: bool) -> float:
    """Static bytes per device with every weight sharded over all n devices (the floor any
    strategy can reach); used to reserve room for colocated models."""
    return static_memory(spec, Mesh(1, n_devices, 1), trained).static


def generation_concurrency(spec: ModelSpec, s: Mesh, wl: Workload, kv_budget: float) -> int:
    """Sequences a generation replica can decode at once within `kv_budget` bytes/device."""
    per_seq = kv_bytes_per_sequence(spec, s, wl)
    return max(0, math.floor(kv_budget / per_seq)) if per_seq > 0 else 1 << 30


@dataclass(frozen=True)
class GenerationMemory:
    """The actor's dynamic memory while it generates in the 3D-HybridEngine, per device."""

    transition: Transition
    extra_params: float
    """Parameter bytes beyond the static training weights while generating (shard + redundancy
    minus the training weights it replaces)."""
    peak_extra: float
    """The same at the peak of the switch (before the KV cache is allocated)."""
    kv_per_sequence: float
    concurrency: int
    """Sequences decoded at once: the replica's batch, or what the KV budget holds."""

    @property
    def kv_cache(self) -> float:
        return self.concurrency * self.kv_per_sequence

    @property
    def dynamic(self) -> float:
        return max(self.peak_extra, self.extra_params + self.kv_cache)


def generation_memory(
    spec: ModelSpec,
    train: Mesh,
    gen: Mesh,
    wl: Workload,
    static_params: float,
    free: float,
    method: str = "hybridflow",
    batch_factor: float = 1.0,
) -> GenerationMemory | None:
    """Generation memory when `free` bytes per device are left after every colocated model's
    static memory (`static_params`: the actor's own training weights among them). The KV
    cache takes what the weights leave; None when not one sequence fits."""
    t = transition(spec, train, gen, method)
    extra = max(0.0, t.resident_params - static_params)
    peak_extra = max(0.0, t.peak_params - static_params)
    per_seq = kv_bytes_per_sequence(spec, gen, wl)
    batch = math.ceil(wl.sequences * batch_factor / gen.dp)
    fit = math.floor((free - extra) / per_seq) if per_seq > 0 else batch
    conc = min(batch, fit)
    if conc < 1 or peak_extra > free:
        return None
    return GenerationMemory(t, extra, peak_extra, per_seq, conc)
