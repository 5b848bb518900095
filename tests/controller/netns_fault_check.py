"""Faults on a NetnsCluster, run by netns_check's driver after its other checks, on its session:
the headless runner's PPO with the actor's two ranks one per host and the critic on host 1, two
iterations with a checkpoint after each, twice:

1. host 1 dies after iteration 1 (every process of its Ray node killed): iteration 2 fails
   naming host 1, the runner reserves the pools again on what is left (host 0) and redoes it
   from the checkpoint;
2. host 1 rejoins; after iteration 1 its link is pulled until Ray gives the node up, then put
   back and the host rejoins: the runner (faults.lost_host=rejoin) waits for it and redoes
   iteration 2 on both hosts.

Both redone runs must log the same numbers: one redid iteration 2 on one host, the other on two
(that a redone iteration equals the uninterrupted one is test_runner's check, on one machine).
"""

import json
import sys
import threading
import time
from pathlib import Path

import ray

from workbench import Session
from workbench.deploy.netns_cluster import NetnsCluster
from workbench.models import make_tiny
from workbench.run.config import RunConfig
from workbench.run.runner import Runner

SETTINGS = {
    "iterations": 2,
    "data": {"train_size": 32, "eval_size": 8, "loader": {"batch_size": 4}},
    "sampling": {"n": 2, "max_new_tokens": 4, "seed": 0},
    "actor": {"mini_batch_size": 8, "micro_batch_size": 8, "optim": {"lr": 1e-3}},
    "critic": {"mini_batch_size": 8, "micro_batch_size": 8, "optim": {"lr": 1e-3}},
    "logging": {"progress": False, "tensorboard": False, "rollouts_every": 0},
    "evaluation": {"every": 0, "at_start": False},
    "checkpoint": {"every": 1},
    "faults": {"max_recoveries": 1, "rejoin_wait_s": 180},
}


def config(model: Path, out: Path, hosts: list[str], lost_host: str) -> RunConfig:
    settings = json.loads(json.dumps(SETTINGS))
    settings["model"] = {"path": str(model)}
    settings["logging"]["output_dir"] = str(out)
    settings["faults"]["lost_host"] = lost_host
    settings["placement"] = {"actor_devices": 2, "hosts": {"actor": hosts, "critic": [hosts[1]]}}
    return RunConfig.from_dict(settings)


def phase(what: str) -> None:
    print(f"[netns_fault_check {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def alive(address: str) -> bool:
    return any(n["Alive"] and n["NodeManagerAddress"] == address for n in ray.nodes())


def after_iteration(iteration: int, action):
    done = []

    def callback(algorithm, batch, metrics):
        if metrics["iteration"] == iteration and not done:
            done.append(time.time())
            action()

    return callback, done


def steady(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/", "run/"))} for r in rows]


def placement(session: Session) -> tuple:
    """A callback noting where each group is after every iteration, by iteration (a redone one:
    where it was redone), and saying when each iteration ends (a slow recovery shows between)."""
    seen: dict[int, dict[str, list[str]]] = {}

    def callback(algorithm, batch, metrics):
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        where = {role: [address[n] for n in g.pool.node_ids] for role, g in session.groups.items()}
        seen[int(metrics["iteration"])] = where  # a float among the metrics
        phase(f"iteration {int(metrics['iteration'])} done (recoveries {int(metrics.get('run/recoveries', 0))})")

    return callback, seen


def run_faults(session: Session, cluster: NetnsCluster) -> dict:
    h0, h1 = cluster.host_ip(0), cluster.host_ip(1)
    root = cluster.shared / "faults"
    model = make_tiny("1m", root / "model", seed=0)
    out = {}

    # 1. host 1 dies; the placement callback runs before the kill (callbacks in order)
    where, placed = placement(session)
    kill, _ = after_iteration(1, lambda: phase(f"killed host 1: {cluster.kill_host(1)} processes"))
    run = Runner(config(model, root / "killed", [h0, h1], "remaining"), session=session, callbacks=[where, kill])
    result = run.run()
    out["killed"] = {
        "history": steady(result.history),
        "faults": result.faults,
        "recoveries": result.recoveries,
        "placed": dict(placed),
    }

    # 2. the link drops
    phase("host 1 rejoins")
    cluster.rejoin(1)

    def pull_the_cable():
        cluster.set_link(1, up=False)
        phase("pulled host 1's link")

        def put_it_back():
            end = time.time() + 120
            while alive(h1) and time.time() < end:
                time.sleep(0.5)
            out["link"]["down_s"] = time.time() - pulled[0]
            phase(f"host 1 given up after {out['link']['down_s']:.1f} s; link back, rejoining")
            cluster.set_link(1, up=True)
            cluster.rejoin(1)
            phase("host 1 rejoined")

        threading.Thread(target=put_it_back, daemon=True).start()

    where, placed = placement(session)
    pull, pulled = after_iteration(1, pull_the_cable)
    out["link"] = {}
    run = Runner(config(model, root / "link", [h0, h1], "rejoin"), session=session, callbacks=[where, pull])
    result = run.run()
    out["link"] |= {
        "history": steady(result.history),
        "faults": result.faults,
        "recoveries": result.recoveries,
        "placed": dict(placed),
    }
    return out
