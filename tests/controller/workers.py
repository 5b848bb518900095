"""Small workers for the controller tests: real processes, real collectives, no models."""

import os
import threading
import time

import ray
import torch
import torch.distributed as dist

from workbench import DP_PROTO, ONE_TO_ALL, THREE_D_PROTO, Batch, Protocol, Worker, register

# A user-defined protocol: rank r receives value * (r + 1); the driver gets the sum.
SCALED = Protocol(
    "SCALED",
    distribute=lambda mesh, value: [value * (r + 1) for r in range(mesh.world_size)],
    collect=lambda mesh, outputs: sum(outputs),
)


class EchoWorker(Worker):
    """Transforms batches row by row and reports where it runs."""

    def __init__(self, config=None):
        super().__init__(config)
        self.scale = (config or {}).get("scale", 2)

    @register(DP_PROTO)
    def double(self, batch: Batch) -> Batch:
        out = Batch({"x": batch["x"] * self.scale}, {"uid": batch["uid"]})
        out["seen_by"] = torch.full((len(batch),), self.rank)
        return out

    @register(THREE_D_PROTO)
    def double_3d(self, batch: Batch) -> Batch:
        return self.double(batch)

    @register(DP_PROTO, pad=False)
    def strict_double(self, batch: Batch) -> Batch:
        return self.double(batch)

    @register(ONE_TO_ALL)
    def where(self) -> dict:
        return {
            "rank": self.rank,
            "coord": tuple(self.coord),
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "world": dist.get_world_size(),
            "nice": os.nice(0),
        }

    @register(ONE_TO_ALL)
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @register(ONE_TO_ALL)
    def touch_memory(self, mib: int) -> int:
        """Touch `mib` MiB for a moment: a memory peak in this call's span."""
        return int(torch.ones(mib * 2**18).sum())

    @register(ONE_TO_ALL)
    def record_inner(self) -> int:
        now = time.time()
        self.record_span("inner.span", now, now + 0.001, note="inside a call")
        return self.rank

    @register(ONE_TO_ALL)
    def use_deepspeed(self, comm: bool) -> int:
        """Import DeepSpeed, as transformers does to save a model; with `comm`, set up its comm
        over this group, as a DeepSpeed engine does. Through the engine's module, as the
        workers do: it points DeepSpeed at the comm op `make` built (else DeepSpeed compiles
        one under ~/.cache, 50 s on 2 cores, again whenever another checkout built it last)."""
        from workbench.engines.deepspeed_engine import deepspeed  # sets TORCH_EXTENSIONS_DIR, then imports it

        if comm:
            deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
        return os.getpid()

    @register(ONE_TO_ALL)
    def all_reduce(self) -> float:
        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        return value.item()

    @register(ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"boom on purpose at rank {rank}")
        return self.rank

    @register(SCALED)
    def identity(self, value):
        return value

    @register(DP_PROTO, execute="rank_zero")
    def only_rank_zero(self, batch: Batch) -> int:
        return len(batch) * 100 + self.rank


class ReferenceLike(Worker):
    """A second role for fused colocation: shares the process with EchoWorker."""

    @register(ONE_TO_ALL)
    def where(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}

    @register(DP_PROTO)
    def negate(self, batch: Batch) -> Batch:
        return Batch({"x": -batch["x"]}, {"uid": batch["uid"]})


class Lingering(Worker):
    """Starts a thread that outlives its call: its process must not serve another group."""

    @register(ONE_TO_ALL)
    def start_thread(self) -> int:
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        return os.getpid()


class FailingInit(Worker):
    """A worker whose start-up raises on one rank (a bad config, a missing file...)."""

    def __init__(self, config=None):
        super().__init__(config)
        if self.rank == (config or {}).get("fail_rank", 0):
            raise RuntimeError("cannot start on purpose")

    @register(ONE_TO_ALL)
    def where(self) -> int:
        return self.rank


class ConfigHolder(Worker):
    """Holds any config (e.g. an ActorConfig) without loading a model: for driver-side checks
    that read a group's config, at the cost of an empty process."""

    @register(DP_PROTO)
    def generate_sequences(self, prompts: Batch, sampling=None) -> Batch:
        return Batch({"width": torch.full((len(prompts),), prompts["input_ids"].shape[1])})
