"""How a frozen model is kept, measured: the reference policy whole on each of 2 data-parallel
ranks, as FSDP2 shards, and as those shards in host memory (`ActorConfig.reference_keep`,
workbench.engines.frozen), with the planner's estimate beside each.

1. Profile this machine and fit the local cluster (`workbench.deploy.profiler.calibrate`), as
   bench/plan_runs.py does: the estimates see nothing this script measures afterwards.
2. Three reference groups of 2 ranks (one torch thread each) on the same 2 devices, one per
   keep. Per repeat, in rotation: `compute_ref_log_prob` on the same batch (8 prompts x 2
   samples, tiny 10m), timed from the driver (dispatch included, as the planner's call
   estimate includes it); medians over repeats.
3. Per keep: bytes each rank keeps between forwards (`reference_bytes`), the measured seconds and their ratio to
   "whole", and the estimated ones (`Simulator.inference` with `Workload.frozen_keep`, plus the
   calibrated per-call overhead). On a CPU the host is the device: "host" moves nothing more
   than "sharded" here (its price has ClusterSpec.host_bandwidth = inf), so its figures check
   the bookkeeping, not a PCIe copy.

    python bench/frozen_keep.py [--repeats 9]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from workbench import Mesh, Session
from workbench.deploy.profiler import calibrate, synthetic_batch
from workbench.models import make_tiny
from workbench.models.load import load
from workbench.planner import Simulator, Workload
from workbench.planner.specs import ModelSpec
from workbench.workers import ActorConfig, ActorRolloutRefWorker

OUT = Path("runs/frozen_keep")
KEEPS = ("whole", "sharded", "host")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    OUT.mkdir(parents=True, exist_ok=True)
    model_dir = str(make_tiny("10m", OUT / "tiny-10m", seed=0))
    loaded = load(model_dir)
    spec = ModelSpec.from_hf_config(loaded.model.config, "tiny-10m")
    rows = args.prompts * args.n
    data = synthetic_batch(rows, args.prompt_len, args.new_tokens, loaded.model.config.vocab_size)
    wall = time.perf_counter()
    seconds: dict[str, list[float]] = {k: [] for k in KEEPS}
    with Session(num_devices=3, threads_per_worker=1) as session:  # the profiler: 1 + 2 devices
        fitted = calibrate(session, {"tiny-10m": model_dir}, devices=2)
        fitted.save(OUT / "calibration.json")
        pool = session.pool("reference", 2)
        groups = {
            keep: session.group(
                f"reference_{keep}",
                ActorRolloutRefWorker,
                pool,
                ActorConfig(
                    model_path=model_dir,
                    train=False,
                    rollout=None,
                    reference=True,
                    reference_keep=keep,
                    micro_batch_size=args.micro_batch_size,
                ),
            )
            for keep in KEEPS
        }
        outputs = {keep: group.compute_ref_log_prob(data).get()["ref_log_probs"] for keep, group in groups.items()}
        for r in range(args.repeats):
            for keep in KEEPS[r % 3 :] + KEEPS[: r % 3]:  # rotated: no keep always runs first
                start = time.perf_counter()
                groups[keep].compute_ref_log_prob(data).get()
                seconds[keep].append(time.perf_counter() - start)
        # after the forwards: what each rank keeps between them, not just before the first
        kept = {keep: group.reference_bytes().get() for keep, group in groups.items()}
    cluster = fitted.cluster(devices_per_node=2)
    mesh = Mesh(dp=2)
    estimated = {}
    for keep in KEEPS:
        wl = Workload(
            batch_size=args.prompts,
            n=args.n,
            prompt_len=args.prompt_len,
            max_new_tokens=args.new_tokens,
            micro_batch_size=args.micro_batch_size,
            param_sharding="full",
            frozen_keep=keep,  # type: ignore[arg-type]
        )
        estimated[keep] = Simulator(cluster, wl).inference(spec, mesh, trained=False) + cluster.call_overhead
    measured = {k: statistics.median(v) for k, v in seconds.items()}
    whole_bytes = sum(kept["whole"][0].values())
    table = {
        keep: {
            "bytes_per_rank": [sum(k.values()) for k in kept[keep]],
            "kept_fraction": round(max(sum(k.values()) for k in kept[keep]) / whole_bytes, 4),
            "where": sorted({d for k in kept[keep] for d in k}),
            "measured_s": round(measured[keep], 4),
            "estimated_s": round(estimated[keep], 4),
            "error": round(estimated[keep] / measured[keep] - 1, 3),
            "measured_ratio_to_whole": round(measured[keep] / measured["whole"], 3),
            "estimated_ratio_to_whole": round(estimated[keep] / estimated["whole"], 3),
            "max_diff_to_whole": float((outputs[keep] - outputs["whole"]).abs().max()),
            "all_s": [round(s, 4) for s in seconds[keep]],
        }
        for keep in KEEPS
    }
    header = ("keep", "kept/whole", "measured s", "estimated s", "error", "meas. x whole", "est. x whole")
    print("{:8} {:>10} {:>11} {:>12} {:>7} {:>14} {:>13}".format(*header))
    for keep, row in table.items():
        print(
            f"{keep:8} {row['kept_fraction']:>10.3f} {row['measured_s']:>11.4f} {row['estimated_s']:>12.4f} "
            f"{row['error']:>+7.1%} {row['measured_ratio_to_whole']:>14.3f} {row['estimated_ratio_to_whole']:>13.3f}"
        )
    print(
        json.dumps(
            {
                "bench": "frozen_keep",
                "keeps": table,
                "max_error": max(abs(r["error"]) for r in table.values()),
                "sharded_kept_fraction": table["sharded"]["kept_fraction"],
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
