"""Profile this machine for the planner: model calls, collectives, and how devices share cores.

Everything runs in Ray workers of a live Session, with the threads workers use (1 torch
thread per process), through the same code paths as the model workers: the FSDP2 engine's
train step, the response log-prob forward, HF rollout. The results feed `calibrate.fit`.

    with Session(num_devices=4) as session:
        cal = calibrate(session, {"kit-10m": make_tiny("10m", dir)})
    cal.save()                                    # .cache/planner/local-calibration.json
    cluster = cluster_preset("local", 4, calibration=cal)

Shapes are generic powers of two (ReaLHF profiles a grid of sizes and interpolates), not the
workload a benchmark will later run.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import inspect
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from workbench.controller import ONE_TO_ALL, Worker, register
from workbench.data.batch import Batch
from workbench.engines.backends import make_engine
from workbench.engines.contract import OptimConfig
from workbench.engines.forward import model_outputs, response_log_probs
from workbench.engines.hf_rollout import HFRollout, weightless_copy
from workbench.engines.rollout import SamplingConfig, response_texts
from workbench.errors import ConfigError
from workbench.models.load import load
from workbench.planner import calibrate as calibrate_module
from workbench.planner.calibrate import Calibration, CollectiveTiming, Timing, fit, load_calibration
from workbench.planner.specs import ModelSpec


@dataclass(frozen=True)
class ProfileShapes:
    """What to time per model."""

    forward: tuple[tuple[int, int, int], ...] = ((8, 16, 16), (32, 16, 16), (16, 64, 32), (16, 8, 8))
    """(sequences, prompt tokens, response tokens) of inference and train calls: micro-batches
    of 64, 128 and 384 tokens, and 2 to 8 of them, so per-token rates and per-micro-batch costs
    are told apart."""
    generate: tuple[tuple[int, int, int], ...] = ((2, 16, 16), (8, 16, 16), (32, 16, 16), (32, 16, 32))
    """(sequences, prompt tokens, new tokens) of generation calls."""
    sharded_forward: tuple[tuple[int, int, int], ...] = ((8, 16, 16), (16, 8, 8))
    """Shapes of each rank's share of the calls timed with the weights sharded over two
    devices (FSDP), which fix the cost of its collectives beyond their bytes."""
    micro_batch_size: int = 4
    rows_per_step: int = 8
    """Sequences per optimizer step in train calls."""
    repeats: int = 3
    """Timed runs per shape after one warm-up; the median is kept."""
    allreduce_bytes: tuple[int, ...] = (1 << 12, 1 << 20, 1 << 22, 1 << 24)


def _loss(outputs, batch):
    """A PPO-shaped loss: the response log-prob forward (the worker's), a scalar per token."""
    return -outputs["log_probs"].mean(), {}


def synthetic_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0) -> Batch:
    """Random tokens laid out as the rollout lays out a batch: prompts left-padded by up to
    half their length (padding changes the attention kernels, so it must be profiled),
    responses after them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=g)
    pads = torch.randint(0, prompt // 2 + 1, (rows,), generator=g)
    mask = (torch.arange(prompt + response) >= pads[:, None]).long()
    ids = ids * mask
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0),
            "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:],
        }
    )


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and lazy inits
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class ProbeWorker(Worker):
    """Times calls and collectives where the model workers run (one process per device)."""

    _models: dict[str, tuple[ModelSpec, HFRollout, Any, Any]]
    """Loaded on first use (model_calls) and kept for re-profiling: path -> (spec, rollout, engine, tokenizer)."""

    @register(ONE_TO_ALL)
    def machine(self) -> dict:
        """Single-thread GEMM FLOP/s and streaming-copy bytes/s of this process."""
        n = 1024
        a, b = torch.randn(n, n), torch.randn(n, n)
        gemm = _median_time(lambda: a @ b, 5)
        x = torch.empty(1 << 25)  # 128 MiB
        y = torch.empty_like(x)
        copy_s = _median_time(lambda: y.copy_(x), 5)
        # One tiny op: what every kernel costs beyond its bytes and FLOPs (dispatch).
        small = torch.ones(64)
        ops = 200
        kernel = _median_time(lambda: [small.add_(1.0) for _ in range(ops)], 5) / ops
        return {
            "peak_flops": 2 * n**3 / gemm,
            "memory_bandwidth": 2 * x.numel() * 4 / copy_s,
            "kernel_latency": kernel,
            "threads": torch.get_num_threads(),
        }

    @register(ONE_TO_ALL)
    def noop(self) -> None:
        """An empty call: its round trip from the driver is the per-call overhead."""
        return None

    @register(ONE_TO_ALL)
    def echo(self, payload):
        """Send the payload back: data through the driver and back."""
        return payload

    @register(ONE_TO_ALL)
    def model_calls(self, name: str, model_path: str, shapes: ProfileShapes) -> list[Timing]:
        """Train, inference and generate calls of one model on this rank alone."""
        if model_path not in self.__dict__.setdefault("_models", {}):  # kept for re-profiling
            loaded = load(model_path)
            self._models[model_path] = (
                ModelSpec.from_hf_config(loaded.model.config, name),
                HFRollout(copy.deepcopy(loaded.model), loaded.tokenizer.pad_token_id, loaded.tokenizer.eos_token_id),
                make_engine(loaded.model, OptimConfig(), self.device_mesh["dp"]),
                loaded.tokenizer,
            )
        spec, rollout, engine, tokenizer = self._models[model_path]
        out = _forward_timings(engine, spec, shapes.forward, shapes)
        for rows, prompt, new in shapes.generate:
            prompts = synthetic_batch(rows, prompt, 0, spec.vocab)
            sampling = SamplingConfig(max_new_tokens=new, seed=0)
            # As the actor's generate_sequences: sample, then decode the responses' text.
            out.append(
                Timing(
                    "generate",
                    spec,
                    rows,
                    prompt,
                    new,
                    rows,
                    seconds=_median_time(
                        lambda: response_texts(rollout.generate(prompts, sampling), tokenizer), shapes.repeats
                    ),
                )
            )
        return out

    @register(ONE_TO_ALL)
    def sharded_calls(self, name: str, model_path: str, shapes: ProfileShapes) -> list[Timing]:
        """On ranks 0 and 1 (the others idle): train and inference calls with the model's
        weights FSDP-sharded over the two (each rank its share of the sequences), and the
        weight sync a sharded actor runs before generating (every tensor gathered whole into
        the rollout's copy)."""
        dp = 2
        group = dist.new_group(list(range(dp)))  # every rank must create it
        if self.rank >= dp:
            dist.barrier()
            return []
        loaded = load(model_path)
        spec = ModelSpec.from_hf_config(loaded.model.config, name)
        rollout = HFRollout(weightless_copy(loaded.model), loaded.tokenizer.pad_token_id, loaded.tokenizer.eos_token_id)
        mesh = DeviceMesh.from_group(group, self.device.type, mesh_dim_names=("dp",))
        engine = make_engine(loaded.model, OptimConfig(), mesh["dp"])
        rollout.materialize(engine.iter_full_weights())
        out = _forward_timings(engine, spec, shapes.sharded_forward, shapes, dp)
        seconds = _median_time(lambda: rollout.load_weights(engine.iter_full_weights()), shapes.repeats)
        out.append(Timing("sync", spec, 1, 0, 0, 1, seconds=seconds, dp=dp))
        dist.barrier()
        return out

    @register(ONE_TO_ALL)
    def all_reduce(self, sizes: tuple[int, ...], group_size: int, repeats: int = 5) -> list:
        """Median seconds of an fp32 all-reduce of each size over ranks [0, group_size)."""
        group = dist.new_group(list(range(group_size)))  # every rank must create it
        out = []
        if self.rank < group_size:
            for nbytes in sizes:
                x = torch.ones(nbytes // 4)
                dist.barrier(group=group)
                out.append(
                    CollectiveTiming(nbytes, group_size, _median_time(lambda: dist.all_reduce(x, group=group), repeats))
                )
        dist.barrier()
        return out

    @register(ONE_TO_ALL)
    def busy(self, active: int, model_path: str, steps: int = 3) -> float:
        """Seconds of a few training steps of the model (forward, backward, AdamW: the memory
        traffic of the workers' own calls, which a cache-resident GEMM loop does not have) on
        ranks < active, each on its own copy, the others idle."""
        if getattr(self, "_busy", (None,))[0] != model_path:
            loaded = load(model_path)
            model = loaded.model.train()
            vocab = model.config.vocab_size
            self._busy = (model_path, model, torch.optim.AdamW(model.parameters()), synthetic_batch(8, 16, 16, vocab))
            self._busy_warm = False
        _, model, optimizer, batch = self._busy

        def step():
            _loss(model_outputs(model, batch), batch)[0].backward()
            optimizer.step()
            optimizer.zero_grad()

        if self.rank < active and not self._busy_warm:
            step()  # warm, once per model: the first step allocates the optimizer's moments
            self._busy_warm = True
        dist.barrier()
        if self.rank >= active:
            return 0.0
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return time.perf_counter() - start


def _forward_timings(engine, spec: ModelSpec, forward, shapes: ProfileShapes, dp: int = 1) -> list[Timing]:
    """Inference and train calls of `forward`'s shapes on this rank, whose share of a call on
    `dp` ranks is the shape's sequences (the Timing counts all ranks' sequences)."""
    mb, out = shapes.micro_batch_size, []
    for rows, prompt, response in forward:
        batch = synthetic_batch(rows, prompt, response, spec.vocab)

        @torch.no_grad()
        def infer():
            engine.model.eval()
            for i in range(0, rows, mb):
                response_log_probs(engine.model, batch[i : i + mb])

        def train():
            for s in range(0, rows, shapes.rows_per_step):
                mini = batch[s : s + shapes.rows_per_step]
                engine.train_step(_loss, [mini[i : i + mb] for i in range(0, len(mini), mb)], model_outputs)

        steps = -(-rows // shapes.rows_per_step)
        total = rows * dp
        infer_s, train_s = _median_time(infer, shapes.repeats), _median_time(train, shapes.repeats)
        out.append(Timing("inference", spec, total, prompt, response, mb, seconds=infer_s, dp=dp))
        out.append(Timing("train", spec, total, prompt, response, mb, steps, seconds=train_s, dp=dp))
    return out


@dataclass
class Profile:
    """Raw measurements, before fitting."""

    timings: list[Timing] = field(default_factory=list)
    collectives: list[CollectiveTiming] = field(default_factory=list)
    machine: dict = field(default_factory=dict)
    slowdown: dict[int, float] = field(default_factory=dict)


class Profiler:
    """Probe workers on `session` (one device for model calls, `devices` for collectives and
    core sharing), kept so a benchmark can profile again between measurements."""

    def __init__(self, session, models: dict[str, str], shapes: ProfileShapes = ProfileShapes(), devices: int = 4):
        self.session, self.models, self.shapes, self.devices = session, models, shapes, devices
        self.one = session.group("calibration_probe", ProbeWorker, session.pool("calibration_one", 1))
        self.all = session.group("calibration_probes", ProbeWorker, session.pool("calibration_all", devices))

    def run(self) -> Profile:
        started = time.perf_counter()
        result = Profile(machine=dict(self.one.machine().get()[0]))
        self.one.noop().get()
        round_trips = []
        for _ in range(15):
            start = time.perf_counter()
            self.one.noop().get()
            round_trips.append(time.perf_counter() - start)
        result.machine["call_overhead"] = statistics.median(round_trips)
        payload = torch.zeros(1 << 20, dtype=torch.int64)  # 8 MiB, a batch of token ids
        self.one.echo(payload).get()
        echo = statistics.median(_timed(lambda: self.one.echo(payload).get()) for _ in range(5))
        result.machine["driver_bandwidth"] = 2 * payload.numel() * 8 / max(echo - result.machine["call_overhead"], 1e-6)
        for name, path in self.models.items():
            result.timings += self.one.model_calls(name, str(path), self.shapes).get()[0]
            # The ranks time their shares together; the slower rank is the call's time.
            per_rank = [t for t in self.all.sharded_calls(name, str(path), self.shapes).get() if t]
            result.timings += [max(same, key=lambda t: t.seconds) for same in zip(*per_rank)]
        for g in sorted({2, self.devices}):
            result.collectives += self.all.all_reduce(self.shapes.allreduce_bytes, g).get()[0]
        alone = None
        probe_model = str(next(iter(self.models.values())))  # sharing is probed with the first model's steps
        for k in range(1, self.devices + 1):
            # The least of three: other work on the machine only ever slows a run down, and one
            # slowed run (a busy core) would halve the cores the planner believes it has. A
            # training step, not a GEMM loop: concurrent steps share memory bandwidth and caches
            # (two 10m-model updates slow each other ~1.3x here, two GEMM loops ~1.05x).
            seconds = min(max(self.all.busy(k, probe_model).get()) for _ in range(3))
            alone = alone or seconds
            result.slowdown[k] = seconds / alone
        result.machine.update(
            cpu_count=os.cpu_count(),
            loadavg=[round(x, 2) for x in os.getloadavg()],
            profile_s=round(time.perf_counter() - started, 1),
        )
        return result

    def calibration(self) -> Calibration:
        """Profile now and fit."""
        p = self.run()
        return fit(
            p.timings,
            p.collectives,
            peak_flops=p.machine["peak_flops"],
            memory_bandwidth=p.machine["memory_bandwidth"],
            slowdown=p.slowdown,
            device_memory=psutil.virtual_memory().total / self.devices,
            machine=p.machine,
            kernel_latency=p.machine["kernel_latency"],
            call_overhead=p.machine["call_overhead"],
            driver_bandwidth=p.machine["driver_bandwidth"],
        )

    def close(self) -> None:
        for name in ("calibration_one", "calibration_all"):
            self.session.release(name)


def calibrate(
    session,
    models: dict[str, str],
    shapes: ProfileShapes = ProfileShapes(),
    devices: int = 4,
    cache: str | Path | None = None,
) -> Calibration:
    """Profile once, fit the local preset's figures (see `calibrate.fit`), remove the probes.

    Profiling takes minutes. With `cache` (a file), a calibration saved there is used instead
    when it was made on this machine for the same models, shapes, devices and profiler code
    (`calibration_key`); otherwise the new one is saved there."""
    key = calibration_key(models, shapes, devices) if cache is not None else None
    if cache is not None and Path(cache).exists():
        saved = load_calibration(cache)
        if saved.machine.get("key") == key:
            return saved
    profiler = Profiler(session, models, shapes, devices)
    try:
        fitted = profiler.calibration()
    finally:
        profiler.close()
    if cache is not None:
        fitted.machine["key"] = key
        staging = Path(cache).with_name(f".{Path(cache).name}.{os.getpid()}")
        fitted.save(staging).replace(cache)  # whole or nothing: a reader never sees half a file
    return fitted


LINK_BYTES = (1 << 16, 1 << 20, 1 << 22, 1 << 24)
"""All-reduce sizes that time a link between hosts: latency-bound to bandwidth-bound."""


def measure_link(session, hosts: list[str], sizes: tuple[int, ...] = LINK_BYTES, repeats: int = 5) -> list:
    """Median seconds of fp32 all-reduces over one rank on each of `hosts` (node addresses or
    ids): what the network between them carries, for `calibrate.fit_link`."""
    if len(set(hosts)) < 2:
        raise ConfigError("measure_link hosts", hosts, "name at least two distinct hosts: a link is between hosts")
    pool = session.pool("calibration_link", [1] * len(hosts), hosts=list(hosts))
    try:
        group = session.group("calibration_link", ProbeWorker, pool)
        return group.all_reduce(tuple(sizes), len(hosts), repeats).get()[0]
    finally:
        session.release("calibration_link")


def calibrate_link(calibration: Calibration, session, hosts: list[str], **kwargs) -> Calibration:
    """`calibration` with its inter_node_bandwidth measured between `hosts` (see measure_link)."""
    samples = measure_link(session, hosts, **kwargs)
    bandwidth = calibrate_module.fit_link(samples, calibration.collective_latency)
    return dataclasses.replace(calibration, inter_node_bandwidth=bandwidth, links=samples)


def calibration_key(models: dict[str, str], shapes: ProfileShapes, devices: int) -> str:
    """What a calibration depends on: the machine (CPU model, cores, memory, torch), each model's
    config, the shapes and devices profiled, and the code that profiles and fits."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else [platform.processor()]
    cpu = next((line for line in lines if "model name" in line), lines[0] if lines else "")
    machine = [cpu, str(os.cpu_count()), str(psutil.virtual_memory().total), torch.__version__]
    parts = [*machine, repr(shapes), str(devices)]
    parts += [f"{name}:{(Path(path) / 'config.json').read_text()}" for name, path in sorted(models.items())]
    parts += [inspect.getsource(module) for module in (sys.modules[__name__], calibrate_module)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
