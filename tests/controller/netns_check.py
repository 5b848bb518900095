"""Run inside host 0 of a NetnsCluster, a driver on the head node (argv: the cluster's name): a
Session attached to the cluster, a two-rank gloo group with one rank per host, a 2 x 2 mesh over
both hosts, a DataFuture from a group on host 0 consumed by a group on host 1, and a weight
channel between them. Then, on the same session (one driver start, warm processes):
netns_ppo_check's two PPO runs, and netns_fault_check's host that dies and link that drops.
Prints one JSON line: what each rank saw, the PPO runs and the faults (or the error that ended
them); test_netns_cluster.py asserts on it.
"""

import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

import psutil
import ray
import torch
import torch.distributed as dist

from tests.controller import netns_fault_check, netns_ppo_check
from workbench import DP_PROTO, ONE_TO_ALL, Batch, Mesh, Session, Worker, register
from workbench.deploy.netns_cluster import NetnsCluster
from workbench.hybrid.channel import ChannelAddress, WeightChannel, open_address


class NetWorker(Worker):
    """Reports the network a rank used. Defined in __main__, so Ray ships the class by value."""

    @register(ONE_TO_ALL)
    def all_reduce(self) -> float:
        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        return value.item()

    @register(ONE_TO_ALL)
    def network(self) -> dict:
        tcp = psutil.Process().net_connections(kind="tcp")
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "env": {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")},
            "connected": [
                [c.laddr.ip, c.laddr.port, c.raddr.ip, c.raddr.port] for c in tcp if c.status == psutil.CONN_ESTABLISHED
            ],
            "listening": [[c.laddr.ip, c.laddr.port] for c in tcp if c.status == psutil.CONN_LISTEN],
        }

    @register(ONE_TO_ALL)
    def open_channel(self, size: int) -> ChannelAddress:
        return open_address(size, local=False, host=ray.util.get_node_ip_address())

    @register(ONE_TO_ALL)
    def share_over_channel(self, address: ChannelAddress, rank: int, value: str | None) -> str:
        """A weight channel's process group between groups on two hosts: each group alone is
        on one host (its own process group on loopback), the channel is not."""
        channel = WeightChannel(address, rank, torch.device("cpu"), timeout=timedelta(seconds=30))
        try:
            return channel.share(value)
        finally:
            channel.close()

    @register(DP_PROTO)
    def scale(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"] * 2}, {"uid": batch["uid"]})


def phase(what: str, started: float = time.time()) -> None:
    """Where the driver is, on stderr: the test shows its tail when the driver fails."""
    print(
        f"[netns_check +{time.time() - started:.0f}s {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True
    )


def report_ray_state_at(when_s: float) -> None:
    """Just before the stack dump: what Ray was doing (nodes, actors not alive, placement groups
    not created), so a hang says what it waited for, not only where."""

    def report() -> None:
        time.sleep(when_s)
        try:
            nodes = [(n["NodeManagerAddress"], n["Alive"]) for n in ray.nodes()]
            actors = [
                (
                    a["ActorID"][:8],
                    a["State"],
                    a.get("Address", {}).get("IPAddress"),
                    a.get("Name") or a.get("ActorClassName"),
                )
                for a in ray._private.state.actors().values()
                if a["State"] not in ("ALIVE", "DEAD")
            ]
            groups = [(g["placement_group_id"][:8], g["state"]) for g in ray.util.placement_group_table().values()]
            phase(f"hung? nodes {nodes}; actors not alive {actors}; placement groups {groups}")
        except Exception as e:  # a report, never a second failure
            phase(f"hung? the Ray state could not be read: {e!r}")

    threading.Thread(target=report, daemon=True).start()


def wait_for_nodes(count: int, timeout: float = 60.0) -> list[dict]:
    end = time.time() + timeout
    while (alive := [n for n in ray.nodes() if n["Alive"]]) and len(alive) < count and time.time() < end:
        time.sleep(0.2)
    return alive


def main(name: str, dump_after_s: float) -> None:
    # A driver that hangs prints every thread's stack (then exits) before the test gives up on it.
    faulthandler.dump_traceback_later(dump_after_s, exit=True)
    report_ray_state_at(dump_after_s - 20)
    cluster = NetnsCluster.load(name)
    addresses = [cluster.host_ip(h) for h in range(cluster.hosts)]
    hosts = len(addresses)
    # Warm processes: a group starts on an earlier one's processes where its pool has their shape.
    session = Session(address=os.environ["RAY_ADDRESS"], keep_processes=True)
    try:
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in wait_for_nodes(hosts)}
        # (a) one rank on each host, one gloo process group
        pair = session.pool("pair", [1, 1])
        ring = session.group("ring", NetWorker, pair)
        reduced = ring.all_reduce().get()
        ranks = ring.network().get()
        # (b) rows made on one host, consumed on the other
        made = session.group("made", NetWorker, session.pool("one", 1, hosts=[addresses[0]]))
        used = session.group("used", NetWorker, session.pool("other", 1, hosts=[addresses[1]]))
        rows = Batch({"x": torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)}, {"uid": list(range(64))})
        future = made.scale(rows)
        out = used.scale(future).get()
        locations = ray.experimental.get_object_locations(future.outputs)
        # (c) a weight channel from the group on host 0 to the one on host 1
        address = made.open_channel(2).get()[0]
        sent = made.share_over_channel(address, 0, "weights v1")
        shared = used.share_over_channel(address, 1, None).get() + sent.get()
        # (d) a 2 x 2 mesh over both hosts: each tensor-parallel pair on one host, data parallel across
        square = session.group("square", NetWorker, session.pool("square", [2, 2]), mesh=Mesh(tp=2, dp=2))
        result = {
            "square": {"nodes": [r["node_ip"] for r in square.network().get()], "reduced": square.all_reduce().get()},
            "nodes": nodes,
            "reduced": reduced,
            "ranks": ranks,
            "made_on": made.network().get()[0]["node"],
            "used_on": used.network().get()[0]["node"],
            "rows_ok": torch.equal(out["x"], rows["x"] * 4) and [int(u) for u in out["uid"]] == list(range(64)),
            "object_nodes": [sorted(loc["node_ids"]) for loc in locations.values()],
            "channel": {"address": [address.where, address.port], "shared": shared},
        }
        session.clear()
        phase("checks done; PPO spread and on one host")
        ppo = netns_ppo_check.compare(session, cluster.shared, addresses[0], addresses[1])
        # Last (it leaves host 1 rejoined); an error here is reported, the checks above stand.
        phase("PPO done; faults")
        try:
            faults = netns_fault_check.run_faults(session, cluster)
        except Exception:
            faults = {"error": traceback.format_exc()}
    finally:
        phase("shutting down")
        session.shutdown()
    print(json.dumps({"checks": result, "ppo": ppo, "faults": faults}))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
