"""Per-device memory of a model under a parallel strategy.

Precision as in the HybridFlow testbed (§8.1): bf16 weights, fp32 gradients, Adam with fp32
master weights and two moments. Optimizer states are sharded over data-parallel ranks too
(ZeRO-1 / Megatron distributed optimizer). Static memory (kept between calls) vs dynamic
memory (only while a call runs) follows ReaLHF's MaxMem (§2 of the reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workbench.planner.specs import ModelSpec, Workload
from workbench.planner.strategy import ParallelStrategy

WEIGHT_BYTES = 2          # bf16 parameters
GRAD_BYTES = 4            # fp32 gradients
ADAM_BYTES = 12           # fp32 master copy + first and second moments

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

    def __add__(self, other: "MemoryBreakdown") -> "MemoryBreakdown":
        return MemoryBreakdown(*(a + b for a, b in zip(self._t(), other._t())))

    def _t(self) -> tuple[float, ...]:
        return (self.params, self.grads, self.optimizer, self.activations, self.kv_cache,
                self.extra_params)


def static_memory(spec: ModelSpec, s: ParallelStrategy, trained: bool) -> MemoryBreakdown:
    """Weights (and, if trained, gradients and optimizer states) kept on each device."""
    shard = spec.param_count / s.model_parallel
    if not trained:
        return MemoryBreakdown(params=shard * WEIGHT_BYTES)
    return MemoryBreakdown(params=shard * WEIGHT_BYTES, grads=shard * GRAD_BYTES,
                           optimizer=shard / s.dp * ADAM_BYTES)


def train_activations(spec: ModelSpec, s: ParallelStrategy, wl: Workload) -> float:
    """Peak activations of 1F1B training on the first stage, which holds `pp` micro-batches
    of its L/pp layers (so L layers' worth), sequence-parallel over TP, plus the last stage's
    fp32 logits. With recomputation only each layer's bf16 input (2·b·s·h) is kept, plus one
    layer's full working set."""
    bsh = wl.micro_batch_size * wl.seq_len * spec.hidden
    if wl.recompute:
        layers = 2 * bsh * spec.n_layers + ACT_BYTES_PER_TOKEN_H * bsh
    else:
        layers = ACT_BYTES_PER_TOKEN_H * bsh * spec.n_layers
    logits = 4 * wl.micro_batch_size * wl.seq_len * (1 if spec.value_head else spec.vocab)
    return (layers + logits) / s.tp


def inference_activations(spec: ModelSpec, s: ParallelStrategy, wl: Workload) -> float:
    """One layer's forward working set plus fp32 logits of a micro-batch."""
    bsh = wl.micro_batch_size * wl.seq_len * spec.hidden
    logits = 4 * wl.micro_batch_size * wl.seq_len * (1 if spec.value_head else spec.vocab)
    return (FWD_BYTES_PER_TOKEN_H * bsh + logits) / s.tp


def kv_bytes_per_sequence(spec: ModelSpec, s: ParallelStrategy, wl: Workload) -> float:
    """KV cache of one full-length sequence on one device of a generation replica."""
    return spec.kv_bytes_per_token * wl.seq_len / s.model_parallel


def generation_weights(spec: ModelSpec, s: ParallelStrategy) -> float:
    """bf16 weights of one generation shard (HybridFlow keeps a separate buffer)."""
    return spec.param_count * WEIGHT_BYTES / s.model_parallel


def min_static_memory(spec: ModelSpec, n_devices: int, trained: bool) -> float:
    """Static bytes per device with every weight sharded over all n devices (the floor any
    strategy can reach); used to reserve room for colocated models."""
    return static_memory(spec, ParallelStrategy(1, n_devices, 1), trained).static


def generation_concurrency(spec: ModelSpec, s: ParallelStrategy, wl: Workload,
                           kv_budget: float) -> int:
    """Sequences a generation replica can decode at once within `kv_budget` bytes/device."""
    per_seq = kv_bytes_per_sequence(spec, s, wl)
    return max(0, math.floor(kv_budget / per_seq)) if per_seq > 0 else 1 << 30
