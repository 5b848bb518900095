"""The 3D-HybridEngine's switch to the generation layout: the three grouping methods of
HybridFlow Table 2 side by side, and hybridflow's time against a raw all-gather, in one run.

For each training -> generation layout (default 1-4-1 -> 1-2-2-1 on 4 processes and
1-4-2 -> 1-2-2-2 on 8; also 1-8-1 -> 1-2-4-1) three actor groups of the ~30M tiny Llama (one per
method: deepspeed_chat, vanilla, hybridflow) share one pool. Each repeat runs one short greedy
generation per method, in a rotating order: the machine's 2 cores are shared and noisy, and
alternating lets every method see the same load. Where the three groups would pass
--max-workers processes (3 x 8 at ~0.7 GB each would, on this shared 24 GB machine), the methods
run one group at a time instead. Each switch is read from the `hybrid.transition` spans: its
seconds on every rank (the worker's own clock around `HybridEngine.to_generation`; weight-sync
checksum off) and the bytes each rank received. A figure is the median over repeats of the max
over ranks.

Baseline, in the same worker processes: a raw all-gather of the same bytes on the same ranks in
the same groups: one flat fp32 tensor of the rank's contribution (the bytes it received / (group
size - 1)), `dist.all_gather_single` in the gather group the engine formed, into an output
buffer allocated and touched before the clock starts (the collective alone: a lower bound).
Both the switch and the baseline start behind a barrier, so driver dispatch skew is no part of
either. Ratio = hybridflow's seconds / its raw all-gather's seconds (goal <= 1.5); the other
methods get the same ratio against their own gathers. A third column tells where a gap comes
from: the same gathers one weight at a time (`all_gather_single` per tensor, outputs ready
beforehand, nothing re-assembled), i.e. the cost of many small collectives without the switch's
allocation and copies. A fourth prototypes the fix for that cost: per decoder layer, the
layer's pieces packed into one buffer, one all-gather, each weight's generation piece copied out,
into buffers kept between switches (hybridflow and vanilla; "bucketed/raw" is its ratio).

The generations above switch by all-gather (`transition_executor="allgather"`, as before the
engine's default became the reallocation). Last, the switch as a parameter reallocation
(`HybridEngine(executor="reallocate")`: batched point-to-point per decoder layer) against the
all-gather switch: in every repeat, after the generation, each method's group switches once by
each executor (order alternating between repeats), behind a barrier, with no generation in
between; "realloc/allgather" is the ratio of their medians (of the max over ranks).

Last line: one JSON object; `ratio` is the max over the layouts run (`ratio_by_layout` has each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from workbench import ONE_TO_ALL, Mesh, Session, layouts, register
from workbench.data.prompts import tokenize_prompts
from workbench.engines.rollout import SamplingConfig
from workbench.engines.tensor_parallel import local, shard_dim
from workbench.hybrid.transition import EXECUTORS
from workbench.models import load, make_tiny
from workbench.workers import ActorConfig, ActorRolloutRefWorker

METHODS = ("deepspeed_chat", "vanilla", "hybridflow")
LAYOUTS = {  # name: (tp, dp, gen_tp), p = p_g = 1
    "1-4-1to1-2-2-1": (4, 1, 2),
    "1-4-2to1-2-2-2": (4, 2, 2),
    "1-8-1to1-2-4-1": (8, 1, 2),
}


class TransitionBenchWorker(ActorRolloutRefWorker):
    """The actor, plus a barrier before each switch and the raw all-gather baseline."""

    def _prepare_generation(self) -> None:
        dist.barrier()  # every rank starts the switch together: dispatch skew is not its cost
        super()._prepare_generation()

    @register(ONE_TO_ALL)
    def timed_switch(self, executor: str) -> dict:
        """One switch to the generation layout by `executor` and back (both ranks' clocks start
        behind a barrier): its seconds and the bytes this rank received."""
        # (No `self.config` here: a method naming an attribute `config` beside `dist` makes Ray's
        # cloudpickle ship the submodule torch.distributed.config, which does not pickle.)
        engine = self.generation.hybrid
        engine.to_training()
        engine.executor, previous = executor, engine.executor
        try:
            dist.barrier()
            stats = engine.to_generation()
            engine.to_training()
        finally:
            engine.executor = previous
        return {"seconds": stats.seconds, "bytes_received": stats.bytes_received}

    @register(ONE_TO_ALL)
    def raw_all_gather(self, received_by_rank: list[int]) -> float:
        """Seconds of one all_gather_single of this rank's contribution (bytes it received in
        the switch / (group size - 1)) inside the gather group the hybrid engine formed."""
        members, group = self.generation.hybrid.gather_members, self.generation.hybrid.gather_group
        if len(members) == 1:
            return 0.0
        numel = received_by_rank[self.rank] // (len(members) - 1) // 4
        flat = torch.ones(numel, dtype=torch.float32)
        out = torch.zeros(len(members) * numel, dtype=torch.float32)  # its pages touched before the clock
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_single(out, flat, group=group)
        return time.perf_counter() - start

    @register(ONE_TO_ALL)
    def per_tensor_all_gathers(self) -> float:
        """Seconds of the switch's collectives alone: one all_gather_single per weight, of the
        part this rank sends for it, into outputs allocated and touched before the clock (no
        allocation, no re-assembly): how much of the switch is the number of collectives."""
        members, group = self.generation.hybrid.gather_members, self.generation.hybrid.gather_group
        if len(members) == 1:
            return 0.0
        pairs = self.generation.hybrid.pairs
        parts = [local(train).reshape(-1) for _, train, _ in pairs if shard_dim(train) is not None]
        if self.mesh.transition == "deepspeed_chat":  # each data-parallel copy sends 1/d of its piece
            parts = [p.chunk(self.mesh.dp)[self.coord.dp] for p in parts]
        parts = [p.contiguous() for p in parts]
        outs = [torch.zeros(len(members) * p.numel(), dtype=p.dtype) for p in parts]
        dist.barrier()
        start = time.perf_counter()
        for part, out in zip(parts, outs):
            dist.all_gather_single(out, part, group=group)
        return time.perf_counter() - start

    @register(ONE_TO_ALL)
    def bucketed_switch(self) -> float:
        """Seconds of a prototype of the fix for many small collectives (hybridflow and vanilla):
        per decoder layer, pack the layer's training pieces into one buffer, one
        all_gather_single, then copy each weight's generation piece out, all into buffers kept
        from the previous call (no allocation). 0.0 where there is nothing to gather or for
        deepspeed_chat (its 1/d parts are not prototyped)."""
        members, group = self.generation.hybrid.gather_members, self.generation.hybrid.gather_group
        if len(members) == 1 or self.mesh.transition == "deepspeed_chat":
            return 0.0
        if getattr(self, "_buckets", None) is None:
            self._buckets = _layer_buckets(self.generation.hybrid.pairs, len(members))
        dist.barrier()
        start = time.perf_counter()
        for pieces, send, recv, outputs in self._buckets:
            offset = 0
            for piece, _ in pieces:
                send[offset : offset + piece.numel()].copy_(piece.reshape(-1))
                offset += piece.numel()
            dist.all_gather_single(recv, send, group=group)
            parts = recv.view(len(members), -1)
            offset = 0
            for (piece, dim), out in zip(pieces, outputs):
                n = piece.numel()
                torch.cat(
                    [parts[m, offset : offset + n].view(piece.shape) for m in range(len(members))], dim=dim, out=out
                )
                offset += n
        elapsed = time.perf_counter() - start
        at = members.index(self.rank)  # the prototype rebuilt what it should: its own piece in place
        for pieces, _, _, outputs in self._buckets:
            for (piece, dim), out in zip(pieces, outputs):
                if not torch.equal(out.narrow(dim, at * piece.shape[dim], piece.shape[dim]), piece):
                    raise RuntimeError(f"bucketed prototype: rank {self.rank} rebuilt a weight wrongly")
        return elapsed


def _layer_buckets(pairs, members: int) -> list:
    """Per decoder layer (and one for the rest): its weights' training pieces with their cut
    dims, a send buffer, a receive buffer and each weight's generation-piece buffer."""
    layers: dict[str, list] = {}
    for name, train, _ in pairs:
        dim = shard_dim(train)
        if dim is None:
            continue
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "rest"
        layers.setdefault(key, []).append((local(train), dim))
    buckets = []
    for pieces in layers.values():
        numel = sum(p.numel() for p, _ in pieces)
        outputs = []
        for piece, dim in pieces:
            shape = list(piece.shape)
            shape[dim] *= members
            outputs.append(torch.zeros(shape, dtype=piece.dtype))
        buckets.append(
            (
                pieces,
                torch.zeros(numel, dtype=pieces[0][0].dtype),
                torch.zeros(members * numel, dtype=pieces[0][0].dtype),
                outputs,
            )
        )
    return buckets


def prompts(tokenizer, n: int):
    rows = [{"prompt": f"Q: {i}+{i + 3}=? A:", "ground_truth": str(2 * i + 3)} for i in range(n)]
    return tokenize_prompts(rows, tokenizer, max_prompt_length=32)


def bench_layout(
    session: Session, model_dir: str, tokenizer, name: str, repeats: int, sampling: SamplingConfig, max_workers: int
) -> dict:
    """Medians over `repeats` of one layout's three methods. When the three groups fit in
    `max_workers` processes they live together and alternate; otherwise one method's group at
    a time (each ~0.7 GB per process on this machine)."""
    tp, dp, gen_tp = LAYOUTS[name]
    world = tp * dp
    meshes = {m: Mesh(tp=tp, dp=dp, gen_tp=gen_tp, transition=m) for m in METHODS}
    config = ActorConfig(
        model_path=model_dir,
        backend="3d",
        train=False,
        check_weight_sync=False,
        mini_batch_size=dp,
        transition_executor="allgather",  # the switch columns: the all-gathers, as in runs 1-4
    )
    batch = prompts(tokenizer, 2 * world)
    seconds = {m: [] for m in METHODS}
    raw = {m: [] for m in METHODS}
    per_tensor = {m: [] for m in METHODS}
    bucketed = {m: [] for m in METHODS}
    by_executor = {m: {e: [] for e in EXECUTORS} for m in METHODS}
    realloc_received: dict[str, list[int]] = {}
    received: dict[str, list[int]] = {}
    model_bytes = 0
    alternate = len(METHODS) * world <= max_workers
    batches = [METHODS] if alternate else [(m,) for m in METHODS]
    for methods in batches:
        pool = session.pool(f"pool{world}", world)
        groups = {m: session.group(m, TransitionBenchWorker, pool, config, mesh=meshes[m]) for m in methods}
        for r in range(-1, repeats):  # repeat -1 warms up (first allocations, first collectives)
            for method in methods[r % len(methods) :] + methods[: r % len(methods)]:
                since = time.time()
                groups[method].generate_sequences(batch, sampling).get()
                spans = [
                    s
                    for s in session.trace()
                    if s.role == method and s.method == "hybrid.transition" and s.start >= since
                ]
                if sorted(s.rank for s in spans) != list(range(world)):
                    raise RuntimeError(
                        f"{name} {method}: expected one hybrid.transition span per rank, "
                        f"got ranks {[s.rank for s in spans]}"
                    )
                spans.sort(key=lambda s: s.rank)
                received[method] = [s.extra["bytes_received"] for s in spans]
                model_bytes = spans[0].extra["model_bytes"]
                gathered = max(groups[method].raw_all_gather(received[method]).get())
                collectives = max(groups[method].per_tensor_all_gathers().get())
                prototype = max(groups[method].bucketed_switch().get())
                switched = {}
                for executor in EXECUTORS if r % 2 else EXECUTORS[::-1]:
                    switched[executor] = groups[method].timed_switch(executor).get()
                realloc_received[method] = [row["bytes_received"] for row in switched["reallocate"]]
                if r >= 0:
                    for executor, rows in switched.items():
                        by_executor[method][executor].append(max(row["seconds"] for row in rows))
                    seconds[method].append(max(s.extra["seconds"] for s in spans))
                    raw[method].append(gathered)
                    per_tensor[method].append(collectives)
                    bucketed[method].append(prototype)
        session.clear("this bench step is done")
    figures = {}
    for method in METHODS:
        expected = [t.received for t in layouts.transition_bytes(meshes[method], model_bytes)]
        if received[method] != expected:
            raise RuntimeError(
                f"{name} {method}: counted bytes {received[method]} differ from layouts.transition_bytes {expected}"
            )
        sec, base = statistics.median(seconds[method]), statistics.median(raw[method])
        gather_s, realloc_s = (statistics.median(by_executor[method][e]) for e in ("allgather", "reallocate"))
        figures[method] = {
            "bytes_received_per_rank": max(received[method]),
            "gather_group_size": len(layouts.gather_group(meshes[method], 0)),
            "seconds": sec,
            "raw_all_gather_seconds": base,
            "ratio": sec / base if base else None,
            "per_tensor_all_gathers_seconds": statistics.median(per_tensor[method]),
            "bucketed_switch_seconds": statistics.median(bucketed[method]) or None,
            "seconds_all": seconds[method],
            "raw_all": raw[method],
            "per_tensor_all": per_tensor[method],
            "bucketed_all": bucketed[method],
            "allgather_switch_seconds": gather_s,
            "realloc_switch_seconds": realloc_s,
            "realloc_over_allgather": realloc_s / gather_s if gather_s else None,
            "realloc_bytes_received_per_rank": max(realloc_received[method]),
            "allgather_switch_all": by_executor[method]["allgather"],
            "realloc_switch_all": by_executor[method]["reallocate"],  # (key kept: bench JSON keys stay stable)
        }
    return {
        "processes": world,
        "tp": tp,
        "dp": dp,
        "gen_tp": gen_tp,
        "model_bytes": model_bytes,
        "methods_alternated": alternate,
        "methods": figures,
    }


def _num(x: float | None, width: int, digits: int = 4) -> str:
    return f"{x:>{width}.{digits}f}" if x else f"{'-':>{width}}"


def table(name: str, result: dict) -> str:
    order = "methods alternated in each repeat" if result["methods_alternated"] else "one method's group at a time"
    lines = [
        f"== {name}: {result['processes']} processes, M = {result['model_bytes'] / 2**20:.1f} MiB of "
        f"tensor-parallel weights, {order}",
        f"{'method':<16}{'group':>6}{'MiB recv/rank':>15}{'switch s':>11}{'raw gather s':>14}"
        f"{'per-tensor gathers s':>22}{'bucketed s':>12}{'switch/raw':>12}{'bucketed/raw':>14}",
    ]
    for method, f in result["methods"].items():
        ratio = f"{f['ratio']:.2f}" if f["ratio"] is not None else "-"
        bucketed = f["bucketed_switch_seconds"]
        lines.append(
            f"{method:<16}{f['gather_group_size']:>6}{f['bytes_received_per_rank'] / 2**20:>15.2f}"
            f"{f['seconds']:>11.4f}{f['raw_all_gather_seconds']:>14.4f}"
            f"{f['per_tensor_all_gathers_seconds']:>22.4f}{_num(bucketed, 12)}{ratio:>12}"
            f"{_num(bucketed and bucketed / f['raw_all_gather_seconds'], 14, 2)}"
        )
    lines.append(
        f"{'method':<16}{'MiB recv/rank (realloc)':>25}{'all-gather switch s':>21}{'realloc switch s':>18}"
        f"{'realloc/allgather':>19}"
    )
    for method, f in result["methods"].items():
        lines.append(
            f"{method:<16}{f['realloc_bytes_received_per_rank'] / 2**20:>25.2f}{f['allgather_switch_seconds']:>21.4f}"
            f"{f['realloc_switch_seconds']:>18.4f}{_num(f['realloc_over_allgather'], 19, 2)}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1-4-1to1-2-2-1", "1-4-2to1-2-2-2"], choices=sorted(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=7, help="measured switches per method and layout")
    parser.add_argument("--model", default="30m", help="workbench.models.make_tiny size")
    parser.add_argument("--max-new-tokens", type=int, default=2)
    parser.add_argument(
        "--max-workers",
        type=int,
        default=12,
        help="run a layout's three method groups together (alternating) when they fit in this many processes",
    )
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=True)
    start = time.time()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-transition-") as tmp:
        model_dir = str(make_tiny(args.model, Path(tmp) / "actor", seed=0))
        tokenizer = load(model_dir).tokenizer
        with Session(num_devices=8, threads_per_worker=1) as session:
            for name in args.layouts:
                results[name] = bench_layout(
                    session, model_dir, tokenizer, name, args.repeats, sampling, args.max_workers
                )
                print(table(name, results[name]), flush=True)
    ratios = {name: r["methods"]["hybridflow"]["ratio"] for name, r in results.items()}
    print(f"hybridflow switch / raw all-gather: {', '.join(f'{k} {v:.2f}' for k, v in ratios.items())} (goal <= 1.5)")
    summary = {
        "bench": "transition",
        "ratio": max(ratios.values()),
        "ratio_is": (
            "max over layouts of hybridflow switch seconds / raw all-gather seconds "
            "(medians over repeats of the max over ranks)"
        ),
        "ratio_by_layout": ratios,
        "realloc_over_allgather": {
            name: {m: f["realloc_over_allgather"] for m, f in r["methods"].items()} for name, r in results.items()
        },
        "layouts": results,
        "settings": {
            "model": args.model,
            "threads_per_worker": 1,
            "session_devices": 8,
            "repeats": args.repeats,
            "max_workers": args.max_workers,
            "max_new_tokens": args.max_new_tokens,
            "greedy": True,
            "backend": "gloo (CPU)",
            "check_weight_sync": False,
            "train": False,
            "generation_switch_executor": "allgather",
            "methods": list(METHODS),
            "wall_seconds": round(time.time() - start, 1),
        },
    }
    line = json.dumps(summary)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
