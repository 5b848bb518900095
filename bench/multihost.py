"""Two hosts on one machine, a shaped link between them, and the planner's estimates of what
crosses it against what the runtime measures.

The hosts are network namespaces (workbench.deploy.netns_cluster), each a Ray node; host 1's
link is shaped by tc's token bucket to --rate on both of its ends. A driver on host 0:

1. Calibrates: this machine's profile on host 0 (workbench.deploy.profiler.calibrate, cached
   in --calibration), then the link (`calibrate_link`: all-reduces over a rank on each host,
   `inter_node_bandwidth` fitted). Nothing below feeds the estimates.
2. Two placements of each transfer, in alternating rounds, measured against the simulator's
   estimate under that calibration:
   - `rows`: a batch made by a group on host 0 consumed by a group on host 1 (`cross`) or on
     host 0 (`local`): the consuming rank's wait for its input (span fetched - start) against
     `Simulator.data_transfer_time(bytes, crosses_nodes)`;
   - `push`: asynchronous RL's weight push from the actor (host 0) to a rollout group on host 1
     or on host 0: the receiving span against `Simulator.weight_push_time`.
3. Throughput: PPO (the headless runner) with the actor's two ranks one per host and the critic
   on host 1, against every group on host 0; response tokens per second over the iterations
   after the first, the two placements alternating.

    sudo .venv/bin/python bench/multihost.py [--rate 400mbit] [--rounds 3] [--model 10m]

Needs root (namespaces, tc). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS_MIB = (8, 32)


def launch(args) -> dict:
    """Make the cluster, run the driver on host 0, remove the cluster."""
    from workbench.deploy.netns_cluster import Link, NetnsCluster

    cluster = NetnsCluster.up(hosts=2, cpus=4, links={1: Link(rate=args.rate)})
    try:
        argv = [sys.executable, str(Path(__file__).resolve()), "--driver", cluster.name]
        argv += ["--rounds", str(args.rounds), "--model", args.model, "--calibration", str(args.calibration)]
        run = cluster.run(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=3600)
        lines = run.stdout.strip().splitlines()
        print("\n".join(lines[:-1]))
        if run.returncode:
            raise SystemExit(f"the driver on host 0 failed (exit {run.returncode})")
        return json.loads(lines[-1]) | {"rate": args.rate}
    finally:
        cluster.down()


def drive(args) -> dict:
    import ray
    import torch
    from transformers import AutoConfig

    from workbench import DP_PROTO, Batch, Session, Worker, register
    from workbench.deploy.netns_cluster import NetnsCluster
    from workbench.deploy.profiler import calibrate, calibrate_link
    from workbench.models import make_tiny
    from workbench.planner import Workload
    from workbench.planner.simulator import Simulator
    from workbench.planner.specs import ModelSpec
    from workbench.workers import ActorConfig, ActorRolloutRefWorker
    from workbench.workers.rollout_link import RolloutLink

    class Rows(Worker):
        """Passes rows on (made on its host), or takes them (its span's fetched - start is the
        wait for them: the pull from the maker's object store)."""

        @register(DP_PROTO)
        def make(self, batch: Batch) -> Batch:
            return Batch({"x": batch["x"] + 0}, {"uid": batch["uid"]})

        @register(DP_PROTO)
        def take(self, batch: Batch) -> Batch:
            return Batch({"rows": torch.ones(len(batch))}, {"uid": batch["uid"]})

    def rows(mib: int) -> Batch:
        x = torch.randn(mib << 8, 1024)  # 4 KiB a row
        return Batch({"x": x}, {"uid": list(range(len(x)))})

    cluster = NetnsCluster.load(args.driver)
    h0, h1 = cluster.host_ip(0), cluster.host_ip(1)
    model = make_tiny(args.model, cluster.shared / f"tiny-{args.model}", seed=0)
    session = Session(address=os.environ["RAY_ADDRESS"])
    try:
        # 1. calibration
        started = time.time()
        calibration = calibrate(session, {args.model: str(model)}, devices=2, cache=args.calibration)
        calibration = calibrate_link(calibration, session, [h0, h1])
        sim = Simulator(calibration.cluster(n_nodes=2, devices_per_node=1), Workload.tiny())
        print(
            f"calibrated in {time.time() - started:.0f} s: link {calibration.inter_node_bandwidth / 1e6:.1f} MB/s "
            f"(on host 0: {calibration.intra_node_bandwidth / 1e6:.0f} MB/s)",
            flush=True,
        )

        # 2. rows, then weight pushes, each over the link and within host 0, rounds alternating
        maker = session.group("maker", Rows, session.pool("maker", 1, hosts=[h0]))
        takers = {
            where: session.group(f"taker_{where}", Rows, session.pool(f"taker_{where}", 1, hosts=[host]))
            for where, host in (("cross", h1), ("local", h0))
        }
        warm = None
        for r in range(args.rounds + 1):  # round 0 warms up
            if r == 1:
                warm = time.time()
            for where in ("cross", "local"):
                for mib in ROWS_MIB:
                    takers[where].take(maker.make(rows(mib))).get()
        session.clear()
        # A group holds one weight channel: an actor per link, both on host 0.
        actor_config = ActorConfig(model_path=str(model), reference=False)
        rollout_config = ActorConfig(model_path=str(model), train=False, reference=False, rollout="hf")
        links = {}
        for where, host in (("cross", h1), ("local", h0)):
            actor = session.group(
                f"actor_{where}", ActorRolloutRefWorker, session.pool(f"actor_{where}", 1, hosts=[h0]), actor_config
            )
            rollout_pool = session.pool(f"rollout_{where}", 1, hosts=[host])
            rollout = session.group(f"rollout_{where}", ActorRolloutRefWorker, rollout_pool, rollout_config)
            links[where] = RolloutLink(actor, rollout)
        pushed_from = None
        for r in range(args.rounds + 1):
            if r == 1:
                pushed_from = time.time()
            for where in ("cross", "local"):
                links[where].push(r + 1)
                links[where].check()
        measured: dict[str, list[float]] = {}
        for record in session.trace():
            if record.method == "take" and record.start >= warm:
                key = f"rows_{record.role.removeprefix('taker_')}_{record.bytes_in >> 20}mib"
                measured.setdefault(key, []).append(record.fetched - record.start)
            elif record.method == "async.receive_weights" and record.start >= pushed_from:
                measured.setdefault(f"push_{record.role.removeprefix('rollout_')}", []).append(record.seconds)
        spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(model))
        estimates = {}
        for key, seconds in measured.items():
            crosses = "_cross" in key
            if key.startswith("rows"):
                nbytes = float(key.rsplit("_", 1)[1].removesuffix("mib")) * 2**20
                estimate = sim.data_transfer_time(nbytes, crosses)
            else:
                one = links["cross"].actor.mesh
                estimate = sim.weight_push_time(spec, one, one, crosses)
            estimates[key] = {
                "measured_s": statistics.median(seconds),
                "estimated_s": estimate,
                "ratio": estimate / statistics.median(seconds),
            }
        session.clear()

        # 3. PPO spread over the hosts against PPO on host 0
        throughput = ppo_throughput(session, model, cluster, h0, h1, args.rounds)
    finally:
        session.shutdown()
        ray.shutdown()
    return {
        "link_mb_s": calibration.inter_node_bandwidth / 1e6,
        "host_mb_s": calibration.intra_node_bandwidth / 1e6,
        "estimates": estimates,
        **throughput,
    }


def ppo_throughput(session, model: Path, cluster, h0: str, h1: str, rounds: int) -> dict:
    from workbench.run.config import RunConfig
    from workbench.run.runner import Runner

    layouts = {
        "spread": {"actor_devices": 2, "hosts": {"actor": [h0, h1], "critic": [h1]}},
        "one_host": {"actor_devices": 2, "hosts": {"actor": [h0], "critic": [h0]}},
    }
    rates: dict[str, list[float]] = {name: [] for name in layouts}
    for r in range(rounds):
        for name, placement in layouts.items():
            config = RunConfig.from_dict(
                {
                    "model": {"path": str(model)},
                    "iterations": 4,
                    "data": {"train_size": 64, "eval_size": 8, "loader": {"batch_size": 8}},
                    "sampling": {"n": 2, "max_new_tokens": 16, "seed": r},
                    "actor": {"mini_batch_size": 16, "micro_batch_size": 8},
                    "critic": {"mini_batch_size": 16, "micro_batch_size": 8},
                    "placement": placement,
                    "logging": {
                        "output_dir": str(cluster.shared / f"ppo-{name}-{r}"),
                        "progress": False,
                        "tensorboard": False,
                    },
                    "evaluation": {"every": 0, "at_start": False},
                    "checkpoint": {"every": 0},
                    "faults": {"max_recoveries": 0},
                }
            )
            history = Runner(config, session=session).run().history[1:]  # the first compiles and warms up
            tokens = sum(row["perf/total_tokens"] for row in history)
            rates[name].append(tokens / sum(row["timing_s/step"] for row in history))
            session.clear()
    spread, one = statistics.median(rates["spread"]), statistics.median(rates["one_host"])
    return {"ppo_tokens_s": {"spread": spread, "one_host": one}, "spread_over_one_host": spread / one}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="400mbit", help="host 1's link (tc tbf rate)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="10m", help="tiny-kit size")
    parser.add_argument("--calibration", type=Path, default=ROOT / ".cache/planner/multihost-calibration.json")
    parser.add_argument("--driver", help=argparse.SUPPRESS)  # the cluster's name: run as its driver
    args = parser.parse_args(argv)
    if args.driver:
        result = drive(args)
        print(json.dumps(result))
        return result
    result = launch(args)
    for key, row in result["estimates"].items():
        seconds = f"measured {row['measured_s']:.3f} s, estimated {row['estimated_s']:.3f} s"
        print(f"{key:<22} {seconds}, ratio {row['ratio']:.2f}")
    rates = result["ppo_tokens_s"]
    print(f"PPO tokens/s: spread {rates['spread']:.1f}, one host {rates['one_host']:.1f}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
