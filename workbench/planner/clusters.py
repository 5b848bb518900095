"""Named clusters: the HybridFlow testbed (A100), H100, H200, and this machine (`local`), whose
figures come from a calibration (`calibrate`) when one is given, placeholders otherwise.

    cluster_preset("a100_80g", 16)                       # two 8-GPU machines
    cluster_preset("local", 4, calibration=".cache/planner/local-calibration.json")
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, TypedDict

from workbench.planner.calibrate import load_calibration
from workbench.planner.errors import NoMeshError, UnknownPresetError
from workbench.planner.specs import GIB, ClusterSpec


class _Latencies(TypedDict):
    """The per-operation costs every GPU preset shares (ClusterSpec fields)."""

    kernel_latency: float
    collective_latency: float
    step_overhead: float
    sequence_overhead: float
    allocation: Literal["aligned", "free"]


# Fixed costs of small work on GPU presets (defaults, not measured here):
#   kernel_latency 5 us: a CUDA kernel launch costs ~3-5 us of host time and a small kernel
#     about as much to ramp up (NVIDIA, "Getting Started with CUDA Graphs", 2019 dev blog);
#   collective_latency 20 us: small-message NCCL all-reduce inside an NVLink machine
#     (nccl-tests all_reduce_perf, 8 x A100, 8 B - 64 KiB: ~15-25 us);
#   step_overhead 2 ms: per decoding step/forward outside kernels (sampling, scheduling,
#     Python): an assumption of the order of an inference engine's CPU time per step.
#   sequence_overhead 50 us: host work per running sequence per decoding step (scheduling,
#     block tables, input preparation, sampling bookkeeping) in the vLLM of the papers' time
#     (0.3-0.5). vLLM's profile of 0.5.3 (blog, "vLLM v0.6.0: 2.7x Throughput Improvement",
#     2024-09-05; Llama-3-8B, one H100) puts scheduling at 29% of the time against 38% on the
#     GPU, i.e. tens of us per sequence at a few hundred sequences. With it the planner ranks
#     generation TP as HybridFlow measured (actor trained 1-8-2 on 16 A100s: 2 fastest for 7B,
#     4 for 13B); without it, 8 for both (tests/planner/test_simulator.py).
_GPU_LATENCIES = _Latencies(
    kernel_latency=5e-6, collective_latency=20e-6, step_overhead=2e-3, sequence_overhead=50e-6, allocation="aligned"
)
_GPU_LATENCY_NOTE = "kernel 5 us, collective 20 us, step 2 ms, 50 us per sequence-step (see clusters.py); ReaLHF meshes"


def _a100(n_nodes: int) -> ClusterSpec:
    return ClusterSpec(
        "a100_80g",
        n_nodes,
        8,
        device_memory=80e9,
        peak_flops=312e12,
        train_efficiency=0.45,
        inference_efficiency=0.5,
        memory_bandwidth=2.039e12,
        bandwidth_efficiency=0.7,
        intra_node_bandwidth=600e9,
        inter_node_bandwidth=200e9 / 8,
        **_GPU_LATENCIES,
        note="HybridFlow testbed: A100-80GB SXM, NVLink 600 GB/s, 200 Gbps between machines; " + _GPU_LATENCY_NOTE,
    )


def _h100(n_nodes: int) -> ClusterSpec:
    return ClusterSpec(
        "h100",
        n_nodes,
        8,
        device_memory=80e9,
        peak_flops=989e12,
        train_efficiency=0.4,
        inference_efficiency=0.45,
        memory_bandwidth=3.35e12,
        bandwidth_efficiency=0.7,
        intra_node_bandwidth=900e9,
        inter_node_bandwidth=8 * 400e9 / 8,
        **_GPU_LATENCIES,
        note="H100 SXM datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s, "
        "8x400 Gbps InfiniBand per machine; efficiencies assumed; " + _GPU_LATENCY_NOTE,
    )


def _h200(n_nodes: int) -> ClusterSpec:
    return ClusterSpec(
        "h200",
        n_nodes,
        8,
        device_memory=141e9,
        peak_flops=989e12,
        train_efficiency=0.4,
        inference_efficiency=0.45,
        memory_bandwidth=4.8e12,
        bandwidth_efficiency=0.7,
        intra_node_bandwidth=900e9,
        inter_node_bandwidth=8 * 400e9 / 8,
        **_GPU_LATENCIES,
        note="H200 SXM datasheet: H100 compute, 141 GB HBM3e at 4.8 TB/s; efficiencies assumed; " + _GPU_LATENCY_NOTE,
    )


def _local(n_nodes: int, devices_per_node: int = 4, calibration=None) -> ClusterSpec:
    """This machine: from a calibration (`workbench.planner.calibrate`) when given, else
    placeholder figures."""
    if calibration is not None:
        if not hasattr(calibration, "cluster"):
            calibration = load_calibration(calibration)
        return calibration.cluster(n_nodes, devices_per_node)
    # PLACEHOLDER figures for this 2-core CPU machine (logical "devices" = CPU slots sharing
    # two cores). Not measured: issue 4 item 5 (calibration) must fit them from real runs.
    return ClusterSpec(
        "local",
        n_nodes,
        devices_per_node,
        device_memory=4 * GIB,
        peak_flops=2e10,
        train_efficiency=0.3,
        inference_efficiency=0.3,
        memory_bandwidth=5e9,
        bandwidth_efficiency=0.5,
        intra_node_bandwidth=2e9,
        inter_node_bandwidth=1e9,
        collective_latency=200e-6,
        dtype_bytes=4,
        decode_overlap=False,
        broadcast_tree=True,
        calibrated=False,
        note="UNCALIBRATED placeholder for this CPU machine; run calibration before trusting",
    )


_CLUSTER_PRESETS = {"a100_80g": _a100, "h100": _h100, "h200": _h200, "local": _local}


def cluster_preset(
    name: str, n_devices: int | None = None, *, n_nodes: int | None = None, calibration=None
) -> ClusterSpec:
    """A cluster preset sized by `n_devices` (a divisor of one machine, or whole machines)
    or by `n_nodes`. Default: one machine. A sub-machine size gives a one-node cluster with
    that many devices. `calibration` (a `Calibration` or the path of a saved one) replaces
    the placeholder figures of the `local` preset with fitted ones."""
    try:
        make = _CLUSTER_PRESETS[name.lower()]
    except KeyError:
        raise UnknownPresetError("cluster", name, list(_CLUSTER_PRESETS)) from None
    if calibration is not None:
        if make is not _local:
            raise ValueError(f"cluster {name!r}: only the 'local' preset is built from a calibration of this machine")
        make = functools.partial(_local, calibration=calibration)
    one = make(1)
    u = one.devices_per_node
    if n_devices is None:
        return make(n_nodes or 1)
    if n_nodes is not None and n_nodes * u != n_devices:
        raise ValueError(f"n_devices={n_devices} and n_nodes={n_nodes} disagree ({u}/node)")
    if n_devices >= u and n_devices % u == 0:
        return make(n_devices // u)
    if 0 < n_devices < u and u % n_devices == 0:
        return dataclasses.replace(one, devices_per_node=n_devices)
    valid = one.mesh_sizes() + [k * u for k in range(2, 17)]
    raise NoMeshError(n_devices, u, sorted(set(valid)), what=f"cluster {name!r} size")


def cluster_presets() -> list[str]:
    return sorted(_CLUSTER_PRESETS)
