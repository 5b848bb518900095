"""Run inside host 0 of a NetnsCluster (python -m tests.controller.netns_fault_check NAME MODEL):
the headless runner's PPO with the actor's two ranks one per host and the critic on host 1,
two iterations with a checkpoint after each, three times on one session:

1. uninterrupted;
2. host 1 dies after iteration 1 (every process of its Ray node killed): iteration 2 fails
   naming host 1, the runner reserves the pools again on what is left (host 0) and redoes it
   from the checkpoint;
3. host 1 rejoins; after iteration 1 its link is pulled until Ray gives the node up, then put
   back and the host rejoins: the runner (faults.lost_host=rejoin) waits for it and redoes
   iteration 2 on both hosts.

Prints one JSON line; test_netns_cluster.py asserts on it.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

import ray

from workbench import Session
from workbench.deploy.netns_cluster import NetnsCluster
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


def config(model: str, out: Path, hosts: list[str], lost_host: str) -> RunConfig:
    settings = json.loads(json.dumps(SETTINGS))
    settings["model"] = {"path": model}
    settings["logging"]["output_dir"] = str(out)
    settings["faults"]["lost_host"] = lost_host
    settings["placement"] = {"actor_devices": 2, "hosts": {"actor": hosts, "critic": [hosts[1]]}}
    return RunConfig.from_dict(settings)


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
    """A callback noting where each group is after every iteration (the last one's stays)."""
    seen: dict[str, list[str]] = {}

    def callback(algorithm, batch, metrics):
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        seen.clear()
        seen.update({role: [address[n] for n in g.pool.node_ids] for role, g in session.groups.items()})

    return callback, seen


def main(name: str, model: str) -> None:
    cluster = NetnsCluster.load(name)
    h0, h1 = cluster.host_ip(0), cluster.host_ip(1)
    root = cluster.shared / "faults"
    # Warm processes: each run's groups start on the last run's where the pools are the same.
    session = Session(address=os.environ["RAY_ADDRESS"], keep_processes=True)
    out = {}
    try:
        # 1. uninterrupted
        where, placed = placement(session)
        first = Runner(config(model, root / "first", [h0, h1], "remaining"), session=session, callbacks=[where]).run()
        out["first"] = {"history": steady(first.history), "placed": dict(placed)}

        # 2. host 1 dies
        kill, killed = after_iteration(1, lambda: cluster.kill_host(1))
        killed_config = config(model, root / "killed", [h0, h1], "remaining")
        run = Runner(killed_config, session=session, callbacks=[kill, where])
        result = run.run()
        out["killed"] = {
            "history": steady(result.history),
            "faults": result.faults,
            "recoveries": result.recoveries,
            "placed": dict(placed),
        }

        # 3. the link drops
        cluster.rejoin(1)

        def pull_the_cable():
            cluster.set_link(1, up=False)

            def put_it_back():
                end = time.time() + 120
                while alive(h1) and time.time() < end:
                    time.sleep(0.5)
                out["link"]["down_s"] = time.time() - pulled[0]
                cluster.set_link(1, up=True)
                cluster.rejoin(1)

            threading.Thread(target=put_it_back, daemon=True).start()

        pull, pulled = after_iteration(1, pull_the_cable)
        out["link"] = {}
        run = Runner(config(model, root / "link", [h0, h1], "rejoin"), session=session, callbacks=[pull, where])
        result = run.run()
        out["link"] |= {
            "history": steady(result.history),
            "faults": result.faults,
            "recoveries": result.recoveries,
            "placed": dict(placed),
        }
    finally:
        session.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
