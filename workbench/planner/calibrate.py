"""Fit the `local` cluster preset to timings measured on this machine (ReaLHF §2: profile, then
estimate). The profiler (`workbench.deploy.profiler`) measures; this module only fits, saves
and loads, and needs neither torch nor Ray.

The fit keeps the simulator's formulas: every measured call is replayed through `Simulator`
with a one-device strategy and a workload of the measured shape, and the cluster figures are
chosen to minimise the squared *relative* error of those predictions. Each call time is
linear in (1 / achieved train FLOP/s, 1 / achieved inference FLOP/s, 1 / achieved decoding
bytes/s, seconds of fixed overhead per forward pass, seconds per training and per inference
micro-batch, seconds per running sequence per decoding step) — a CPU decoding step pays its
reads and its matmuls (`decode_overlap=False`); a preset that overlaps them makes it
piecewise linear — so Gauss-Newton with finite differences solves it exactly (inside one
branch) and converges in a few rounds. The rates are
kept inside physical bounds (`EFFICIENCY_BOUNDS`):
a fit that would need a matmul faster than the measured peak GEMM, or decoding faster than a
few times the measured streaming copy, is pinned at the bound instead of going degenerate.
Two fixed costs are measured directly rather than fitted: the time of one tiny kernel
(`kernel_latency`) and of one empty model-function call from the driver (`call_overhead`).

    cal = fit(timings, collectives, peak_flops=..., memory_bandwidth=..., cores=...)
    cal.save(".cache/planner/local.json")
    cluster = cluster_preset("local", 4, calibration=".cache/planner/local.json")
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from workbench import config_loader
from workbench.mesh import Mesh
from workbench.planner.simulator import Simulator
from workbench.planner.specs import GIB, ClusterSpec, ModelSpec, Workload

ONE = Mesh(1, 1, 1)
# Largest achieved fraction of the measured single-thread figures a fit may claim: matmuls in
# a model do not beat the peak GEMM they are measured against (1.25 leaves room for noise in
# that one measurement); decoding reads weights and KV cache from caches as well as memory,
# so it may reach a few times the streaming-copy rate, not 1000 times.
EFFICIENCY_BOUNDS = {"train_efficiency": 1.25, "inference_efficiency": 1.25, "bandwidth_efficiency": 4.0}
DEFAULT_PATH = Path(".cache/planner/local-calibration.json")
CPU_DTYPE_BYTES = 4  # the workers compute and communicate in fp32 on a CPU


@dataclass(frozen=True)
class Timing:
    """One measured model function call on one device (one process, one thread), or on `dp`
    devices holding FSDP shards of the model; "sync" is a sharded model's weights gathered
    tensor by tensor into a whole copy (the actor's weight sync into its rollout)."""

    kind: Literal["train", "inference", "generate", "sync"]
    model: ModelSpec
    batch: int
    """Sequences in the call."""
    prompt_len: int
    """Prompt tokens (the whole sequence for train/inference when response_len is 0)."""
    response_len: int
    """Generated tokens (decoding steps) for generate; response part of the sequence otherwise."""
    micro_batch_size: int
    """Sequences per forward/backward."""
    mini_batches: int = 1
    """Optimizer steps (train)."""
    seconds: float = 0.0
    """Measured median."""
    dp: int = 1
    """Devices the call ran on, each with 1/dp of the sequences and of the weights (FSDP)."""

    def workload(self) -> Workload:
        return Workload(
            batch_size=self.batch,
            prompt_len=self.prompt_len,
            max_new_tokens=self.response_len,
            epochs=1,
            mini_batch_size=-(-self.batch // self.mini_batches),  # the steps the call took
            micro_batch_size=self.micro_batch_size,
            gradient_checkpointing=False,
            param_sharding="full",
        )

    def predict(self, cluster: ClusterSpec) -> float:
        """The simulator's time for this call on `cluster`."""
        sim, mesh = Simulator(cluster, self.workload()), Mesh(1, 1, self.dp)
        if self.kind == "train":
            return sim.train(self.model, mesh)
        if self.kind == "inference":
            return sim.inference(self.model, mesh)
        if self.kind == "sync":
            return sim.reshard_time(self.model, mesh, mesh)
        return sim.generate(self.model, mesh)


@dataclass(frozen=True)
class CollectiveTiming:
    """A measured all-reduce of `nbytes` over `group` workers of one machine."""

    nbytes: float
    group: int
    seconds: float

    def predict(self, cluster: ClusterSpec) -> float:
        return Simulator(cluster, Workload.tiny()).allreduce(self.nbytes, self.group)


@dataclass
class Calibration:
    """Fitted figures of this machine, with the measurements they come from."""

    peak_flops: float
    """Single-thread fp32 matmul FLOP/s of one large GEMM (the 'peak' efficiencies refer to)."""
    train_efficiency: float
    inference_efficiency: float
    step_overhead: float
    """Seconds per forward pass / decoding step outside the FLOP count."""
    memory_bandwidth: float
    """Bytes/s of one thread streaming a large tensor copy."""
    bandwidth_efficiency: float
    """Fitted fraction of it that decoding achieves (reading fp32 weights: `CPU_DTYPE_BYTES`)."""
    intra_node_bandwidth: float
    """Effective all-reduce link bandwidth between workers (bytes/s, efficiency 1)."""
    collective_latency: float
    cores: float
    """Effective cores the logical devices share (from concurrent workers' slowdown)."""
    device_memory: float = 4 * GIB
    timings: list[Timing] = field(default_factory=list)
    collectives: list[CollectiveTiming] = field(default_factory=list)
    machine: dict = field(default_factory=dict)
    """Where and when: cpu count, load average, seconds spent profiling."""
    kernel_latency: float = 0.0
    """Measured seconds of one tiny tensor op in a worker (the per-kernel fixed cost)."""
    call_overhead: float = 0.0
    """Measured seconds of an empty model-function call from the driver (dispatch, collect)."""
    driver_bandwidth: float = float("inf")
    """Measured bytes/s of data sent through the driver to a worker and back."""
    train_overhead: float = 0.0
    """Seconds per training micro-batch beyond its FLOPs (see ClusterSpec.train_overhead)."""
    inference_overhead: float = 0.0
    """Seconds per forward-only micro-batch beyond its FLOPs (ClusterSpec.inference_overhead)."""
    shard_overhead: float = 0.0
    """Seconds per collective of an FSDP unit beyond its bytes (ClusterSpec.shard_overhead)."""
    gather_overhead: float = 0.0
    """Seconds per tensor gathered whole from shards beyond its bytes (ClusterSpec.gather_overhead)."""
    sequence_overhead: float = 0.0
    """Seconds per running sequence per decoding step beyond its FLOPs and bytes: sampling and
    the response log-prob over the vocabulary, row by row (ClusterSpec.sequence_overhead)."""
    inter_node_bandwidth: float = 0.0
    """Measured bytes/s between two hosts of a cluster (`fit_link`, from an all-reduce with a
    rank on each: `profiler.measure_link`); 0: not measured, taken as intra_node_bandwidth."""
    links: list[CollectiveTiming] = field(default_factory=list)
    """The cross-host all-reduces inter_node_bandwidth was fitted to."""

    def cluster(self, n_nodes: int = 1, devices_per_node: int = 4) -> ClusterSpec:
        """The `local` preset with these figures."""
        return ClusterSpec(
            "local",
            n_nodes,
            devices_per_node,
            device_memory=self.device_memory,
            peak_flops=self.peak_flops,
            train_efficiency=self.train_efficiency,
            inference_efficiency=self.inference_efficiency,
            memory_bandwidth=self.memory_bandwidth,
            bandwidth_efficiency=self.bandwidth_efficiency,
            intra_node_bandwidth=self.intra_node_bandwidth,
            inter_node_bandwidth=self.inter_node_bandwidth or self.intra_node_bandwidth,
            comm_efficiency=1.0,
            collective_latency=self.collective_latency,
            step_overhead=self.step_overhead,
            train_overhead=self.train_overhead,
            inference_overhead=self.inference_overhead,
            shard_overhead=self.shard_overhead,
            gather_overhead=self.gather_overhead,
            sequence_overhead=self.sequence_overhead,
            kernel_latency=self.kernel_latency,
            call_overhead=self.call_overhead,
            driver_bandwidth=self.driver_bandwidth,
            host_bandwidth=float("inf"),  # the device is the host: a host-kept shard is not copied
            cores_per_node=self.cores,
            dtype_bytes=CPU_DTYPE_BYTES,
            decode_overlap=False,
            broadcast_tree=True,
            calibrated=True,
            note=f"calibrated on this machine ({self.machine.get('cpu_count', '?')} cores, "
            f"load {self.machine.get('loadavg', '?')})",
        )

    def residuals(self) -> list[tuple[str, float, float]]:
        """(label, measured s, predicted s) of every profiled call under the fit."""
        c = self.cluster()
        return [
            (
                f"{t.kind} {t.model.name} b{t.batch} p{t.prompt_len} r{t.response_len}"
                + (f" dp{t.dp}" if t.dp > 1 else ""),
                t.seconds,
                t.predict(c),
            )
            for t in self.timings
        ]

    # ---- persistence -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        """The calibration `to_dict` wrote (checked field by field, as every config is)."""
        return config_loader.build(cls, d, "calibration")

    def save(self, path: str | Path = DEFAULT_PATH) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path


def load_calibration(path: str | Path = DEFAULT_PATH) -> Calibration:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"no calibration at {path}; run `python bench/calibration.py` "
            f"(or workbench.deploy.profiler.calibrate) to make one"
        )
    return Calibration.from_dict(json.loads(path.read_text()))


# ---- fitting -------------------------------------------------------------------------------------
def fit_piecewise_linear(
    predict: Callable[[np.ndarray], np.ndarray],
    measured: np.ndarray,
    starts: list[np.ndarray],
    rounds: int = 30,
    lower: np.ndarray | None = None,
) -> np.ndarray:
    """Least squares in relative error of `predict(x) ≈ measured`, x >= lower (default 0),
    for a predict that is linear in x within each branch: Gauss-Newton with exact
    finite-difference columns and bounded solves, from each start; the best fit wins
    (branches make it non-convex)."""
    if lower is not None and np.any(lower > 0):
        lo = np.asarray(lower, dtype=float)
        y = fit_piecewise_linear(
            lambda y: predict(y + lo), measured, [np.maximum(x0 - lo, 0.0) + 1e-3 * lo for x0 in starts], rounds
        )
        return y + lo
    w = 1.0 / np.asarray(measured, dtype=float)

    def error(x):
        return float(np.sum(((predict(x) - measured) * w) ** 2))

    best = None
    for x0 in starts:
        x, scale = np.asarray(x0, dtype=float), np.abs(np.asarray(x0, dtype=float))
        for _ in range(rounds):
            base = predict(x)
            cols = []
            for j in range(len(x)):
                dx = np.zeros_like(x)
                dx[j] = max(abs(x[j]), scale[j]) * 1e-3
                cols.append((predict(x + dx) - base) / dx[j])
            jac = np.stack(cols, axis=1)
            new = _nonnegative_lstsq(jac * w[:, None], (measured - (base - jac @ x)) * w, x)
            if np.allclose(new, x, rtol=1e-9, atol=0):
                break
            x = new
        if best is None or error(x) < best[0]:
            best = (error(x), x)
    if best is None:
        raise ValueError("fit_piecewise_linear needs at least one start")
    return best[1]


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """min |a x - b| with x >= 0 (active set: a negative component is pinned at 0 and the
    rest re-solved); a column nothing depends on keeps its value from `keep`."""
    x = keep.copy()
    free = np.abs(a).sum(axis=0) > 0
    while free.any():
        sol, *_ = np.linalg.lstsq(a[:, free], b - a[:, ~free] @ x[~free], rcond=None)
        if (sol >= 0).all():
            x[free] = sol
            break
        idx = np.flatnonzero(free)
        x[idx[sol < 0]] = 0.0
        free[idx[sol < 0]] = False
    return x


def fit_compute(
    timings: list[Timing], peak_flops: float, memory_bandwidth: float, kernel_latency: float = 0.0
) -> tuple[float, float, float, float, float, float, float]:
    """(train_efficiency, inference_efficiency, bandwidth_efficiency, step_overhead,
    train_overhead, inference_overhead, sequence_overhead) minimising relative error. The last
    is told apart from decoding's matmuls by the forward calls, which pin the inference rate:
    a decoding step's rows cost more than their FLOPs (sampling and log-probs over the
    vocabulary, row by row; generation at 2-32 rows was off by -15% to +15% without it)."""
    kinds = {t.kind for t in timings}
    if not {"train", "inference"} <= kinds:
        raise ValueError(f"calibration needs train and inference timings; got {sorted(kinds)}")
    base = dataclasses.replace(_placeholder(peak_flops, memory_bandwidth), kernel_latency=kernel_latency)

    def cluster_of(x):
        a, b, m, o, t, i, q = x
        # (s/FLOP train and inference, s/byte decoding, s per forward, s per training and per
        # inference micro-batch, s per sequence per decoding step)
        return dataclasses.replace(
            base,
            train_efficiency=1 / (a * peak_flops),
            inference_efficiency=1 / (b * peak_flops),
            bandwidth_efficiency=1 / (m * memory_bandwidth),
            step_overhead=o,
            train_overhead=t,
            inference_overhead=i,
            sequence_overhead=q,
        )

    def predict(x):
        c = cluster_of(x)
        return np.array([t.predict(c) for t in timings])

    measured = np.array([t.seconds for t in timings])
    # Starts from compute-bound to memory-bound decoding.
    starts = [
        np.array([2 / peak_flops, 2 / peak_flops, k / memory_bandwidth, 1e-3, 1e-3, 1e-3, 1e-4]) for k in (1, 4, 16)
    ]
    b = EFFICIENCY_BOUNDS
    lower = np.array(
        [
            1 / (b["train_efficiency"] * peak_flops),
            1 / (b["inference_efficiency"] * peak_flops),
            1 / (b["bandwidth_efficiency"] * memory_bandwidth),
            0.0,
            0.0,
            0.0,
            0.0,
        ]
    )
    c = cluster_of(fit_piecewise_linear(predict, measured, starts, lower=lower))
    return (
        c.train_efficiency,
        c.inference_efficiency,
        c.bandwidth_efficiency,
        c.step_overhead,
        c.train_overhead,
        c.inference_overhead,
        c.sequence_overhead,
    )


def fit_collectives(samples: list[CollectiveTiming]) -> tuple[float, float]:
    """(intra_node_bandwidth, collective_latency) of the simulator's ring all-reduce."""
    base = _placeholder(1e12, 1e10)

    def predict(x):
        inv_bw, lat = x
        # the non-negative solve may reach inv_bw = 0 (bandwidth not resolved by the samples)
        c = dataclasses.replace(base, intra_node_bandwidth=1 / max(inv_bw, 1e-15), collective_latency=lat)
        return np.array([s.predict(c) for s in samples])

    measured = np.array([s.seconds for s in samples])
    inv_bw, lat = fit_piecewise_linear(predict, measured, [np.array([1e-9, 1e-4])])
    return 1 / max(inv_bw, 1e-15), lat


def fit_link(samples: list[CollectiveTiming], collective_latency: float) -> float:
    """inter_node_bandwidth from all-reduces over a rank on each of `group` hosts (one member
    per host, `Simulator.allreduce`): ring bytes / (seconds - 2 latencies), least squares
    through the origin, so the large sizes, where the link and not the latency rules, weigh most."""
    ring = np.array([2 * (s.group - 1) / s.group * s.nbytes for s in samples])
    sending = np.array([max(s.seconds - 2 * collective_latency, 1e-9) for s in samples])
    return float(ring @ ring / (ring @ sending))


def fit_cores(slowdown: dict[int, float]) -> float:
    """Effective cores C from {k busy workers: time / time alone}, modelled as max(1, k/C)."""
    grid = np.linspace(1.0, max(slowdown), 301)
    err = [sum((s - max(1.0, k / c)) ** 2 for k, s in slowdown.items()) for c in grid]
    return float(grid[int(np.argmin(err))])


def fit(
    timings: list[Timing],
    collectives: list[CollectiveTiming],
    *,
    peak_flops: float,
    memory_bandwidth: float,
    slowdown: dict[int, float],
    device_memory: float = 4 * GIB,
    machine: dict | None = None,
    kernel_latency: float = 0.0,
    call_overhead: float = 0.0,
    driver_bandwidth: float = float("inf"),
) -> Calibration:
    """All fitted figures as one Calibration (kernel latency and call overhead as measured).
    One-device calls fix the compute figures; then, with those and the collectives' fixed,
    the sharded calls (`Timing.dp` > 1) fix `shard_overhead` and the syncs `gather_overhead`."""
    train_eff, inf_eff, bw_eff, overhead, train_overhead, inference_overhead, sequence_overhead = fit_compute(
        [t for t in timings if t.dp == 1 and t.kind != "sync"], peak_flops, memory_bandwidth, kernel_latency
    )
    bw, lat = fit_collectives(collectives)
    cal = Calibration(
        peak_flops,
        train_eff,
        inf_eff,
        overhead,
        memory_bandwidth,
        bw_eff,
        bw,
        lat,
        fit_cores(slowdown),
        device_memory,
        list(timings),
        list(collectives),
        dict(machine or {}, slowdown={str(k): v for k, v in slowdown.items()}),
        kernel_latency,
        call_overhead,
        driver_bandwidth,
        train_overhead,
        inference_overhead,
        sequence_overhead=sequence_overhead,
    )
    sharded = [t for t in timings if t.dp > 1 and t.kind in ("train", "inference")]
    cal.shard_overhead = fit_fixed_cost(sharded, cal.cluster(), "shard_overhead")
    # A whole-tensor gather's fixed cost is latency + overhead >= 0: a small tensor's gather may
    # cost less than the all-reduce latency the collectives fitted, so the overhead may be negative.
    syncs = [t for t in timings if t.kind == "sync"]
    cal.gather_overhead = fit_fixed_cost(syncs, cal.cluster(), "gather_overhead", lower=-lat)
    return cal


def fit_fixed_cost(timings: list[Timing], cluster: ClusterSpec, field: str, lower: float = 0.0) -> float:
    """The value >= `lower` of one per-operation cost of `cluster` (a field each prediction is
    linear in) that minimises the timings' squared relative error, the rest held fixed;
    0 without timings."""
    if not timings:
        return 0.0
    measured = np.array([t.seconds for t in timings])
    zero: dict[str, Any] = {field: 0.0}  # `field` names a float field of ClusterSpec
    one: dict[str, Any] = {field: 1.0}
    base = np.array([t.predict(dataclasses.replace(cluster, **zero)) for t in timings])
    per_unit = np.array([t.predict(dataclasses.replace(cluster, **one)) for t in timings]) - base
    w = per_unit / measured
    if not np.any(w > 0):
        return 0.0
    return max(lower, float(np.sum(w * (measured - base) / measured) / np.sum(w * w)))


def _placeholder(peak_flops: float, memory_bandwidth: float) -> ClusterSpec:
    return ClusterSpec(
        "fit",
        1,
        1,
        device_memory=math.inf,
        peak_flops=peak_flops,
        train_efficiency=1.0,
        inference_efficiency=1.0,
        memory_bandwidth=memory_bandwidth,
        bandwidth_efficiency=1.0,
        intra_node_bandwidth=1e12,
        inter_node_bandwidth=1e12,
        comm_efficiency=1.0,
        collective_latency=0.0,
        dtype_bytes=CPU_DTYPE_BYTES,
        decode_overlap=False,
        broadcast_tree=True,
    )
