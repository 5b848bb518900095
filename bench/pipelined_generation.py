"""Pipelined generation measured against its price: an actor trained in 2 pipeline stages
(Mesh(pp=2), backend "3d") generating as a pipeline on its stages' own weights (gen_pp=2,
workbench.engines.pipelined_rollout) and with a whole copy on each rank (gen_pp=1: two
generation replicas), with the planner's estimate beside each.

1. Profile this machine and fit the local cluster (`workbench.deploy.profiler.calibrate`), as
   bench/plan_runs.py does: the estimates see nothing this script measures afterwards.
2. Two actor groups of 2 ranks (one torch thread each) on the same 2 devices, one per layout.
   Per repeat, alternating which goes first: `generate_sequences` of the same prompts (every
   row runs to max_new_tokens), timed from the driver (dispatch included, as the planner's
   call estimate includes it), and inside the workers (the slowest rank's span of the call);
   medians over repeats.
3. Per layout: the measured seconds, the estimate (`Simulator.generate` of p2t1d1 or p1t1d2 on
   the 2 devices' shared cores, as the plan evaluator prices a call, plus the calibrated
   per-call overhead), and the generation weights one rank holds as a
   fraction of the model (its stage, or the whole copy). The two layouts' tokens are compared
   too (greedy: they must be equal).

    python bench/pipelined_generation.py [--repeats 7]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from workbench import Batch, Mesh, Session
from workbench.deploy.profiler import calibrate
from workbench.engines.contract import OptimConfig
from workbench.engines.pipeline_stages import stage_layers
from workbench.engines.rollout import SamplingConfig
from workbench.models import make_tiny
from workbench.models.load import load
from workbench.planner import Simulator, Workload
from workbench.planner.schedule import concurrent_time, shared_cores
from workbench.planner.specs import ModelSpec
from workbench.workers import ActorConfig, ActorRolloutRefWorker

OUT = Path("runs/pipelined_generation")
LAYOUTS = {"pipelined": (Mesh(pp=2), Mesh(2, 1, 1)), "whole": (Mesh(pp=2, gen_pp=1, gen_tp=1), Mesh(1, 1, 2))}
"""Name -> (the actor group's mesh, the generation layout the planner prices)."""


def stage_fraction(model: torch.nn.Module, pp: int) -> float:
    """The largest share of the model's parameters one of `pp` stages holds."""
    total = sum(p.numel() for p in model.parameters())
    inner = model.model
    layers = len(inner.layers)
    shares = []
    for stage in range(pp):
        held = sum(p.numel() for i in stage_layers(layers, pp, stage) for p in inner.layers[i].parameters())
        if stage == 0:
            held += inner.embed_tokens.weight.numel()
        if stage == pp - 1:
            held += model.lm_head.weight.numel() + inner.norm.weight.numel()
        shares.append(held / total)
    return max(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    OUT.mkdir(parents=True, exist_ok=True)
    model_dir = str(make_tiny("10m", OUT / "tiny-10m", seed=0))
    loaded = load(model_dir)
    spec = ModelSpec.from_hf_config(loaded.model.config, "tiny-10m")
    vocab = loaded.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (args.prompts, args.prompt_len), generator=g)
    prompts = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    greedy = SamplingConfig(greedy=True, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    wall = time.perf_counter()
    seconds: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    with Session(num_devices=3, threads_per_worker=1) as session:  # the profiler: 1 + 2 devices
        fitted = calibrate(session, {"tiny-10m": model_dir}, devices=2)
        fitted.save(OUT / "calibration.json")
        pool = session.pool("actor", 2)
        config = ActorConfig(model_path=model_dir, backend="3d", reference=False, optim=OptimConfig(lr=1e-5))
        groups = {
            name: session.group(f"actor_{name}", ActorRolloutRefWorker, pool, config, mesh=mesh)
            for name, (mesh, _) in LAYOUTS.items()
        }
        tokens = {name: group.generate_sequences(prompts, greedy).get()["responses"] for name, group in groups.items()}
        since = time.time()
        for r in range(args.repeats):
            for name in list(LAYOUTS)[r % 2 :] + list(LAYOUTS)[: r % 2]:  # alternated: neither always first
                start = time.perf_counter()
                groups[name].generate_sequences(prompts, greedy).get()
                seconds[name].append(time.perf_counter() - start)
        # Inside the workers: the slowest rank's generate_sequences, per call (dispatch excluded).
        inside: dict[str, dict[int, float]] = {k: {} for k in LAYOUTS}
        for rec in session.trace():
            name = rec.role.removeprefix("actor_")
            if rec.method == "generate_sequences" and rec.start >= since and name in inside:
                inside[name][rec.call_id] = max(inside[name].get(rec.call_id, 0.0), rec.end - rec.start)
    cluster = fitted.cluster(devices_per_node=2)
    wl = Workload(batch_size=args.prompts, n=1, prompt_len=args.prompt_len, max_new_tokens=args.new_tokens)
    sim = Simulator(cluster, wl)
    held = {"pipelined": stage_fraction(loaded.model, 2), "whole": 1.0}
    table = {}
    for name, (_, priced) in LAYOUTS.items():
        measured = statistics.median(seconds[name])
        # As the plan evaluator prices a call on both devices: their cores shared by its ranks.
        work = concurrent_time([(sim.generate(spec, priced), (0, priced.world_size))], shared_cores(cluster))
        estimated = work + cluster.call_overhead
        table[name] = {
            "priced_layout": priced.short(),
            "measured_s": round(measured, 4),
            "in_worker_s": round(statistics.median(inside[name].values()), 4),
            "estimated_s": round(estimated, 4),
            "error": round(estimated / measured - 1, 3),
            "weights_held_per_rank": round(held[name], 3),
            "all_s": [round(s, 4) for s in seconds[name]],
        }
    ratio = {k: round(table["pipelined"][k] / table["whole"][k], 3) for k in ("measured_s", "estimated_s")}
    header = ("layout", "priced", "measured s", "in worker s", "estimated s", "error", "weights/rank")
    print("{:10} {:>7} {:>11} {:>12} {:>12} {:>7} {:>13}".format(*header))
    for name, row in table.items():
        print(
            f"{name:10} {row['priced_layout']:>7} {row['measured_s']:>11.4f} {row['in_worker_s']:>12.4f} "
            f"{row['estimated_s']:>12.4f} {row['error']:>+7.1%} {row['weights_held_per_rank']:>13.3f}"
        )
    print(f"pipelined / whole: measured {ratio['measured_s']:.3f}x, estimated {ratio['estimated_s']:.3f}x")
    print(
        json.dumps(
            {
                "bench": "pipelined_generation",
                "layouts": table,
                "measured_ratio": ratio["measured_s"],
                "estimated_ratio": ratio["estimated_s"],
                "max_error": max(abs(r["error"]) for r in table.values()),
                "tokens_equal": bool(torch.equal(tokens["pipelined"], tokens["whole"])),
                "settings": vars(args)
                | {
                    "model": "tiny-10m",
                    "ranks": 2,
                    "threads_per_worker": 1,
                    "backend": "gloo (CPU)",
                    "wall_seconds": round(time.perf_counter() - wall, 1),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
