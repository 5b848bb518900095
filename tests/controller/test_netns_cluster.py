"""A cluster of separate hosts on this machine (workbench.deploy.netns_cluster): each host a
network namespace with its own address, loopback and Ray node. A driver on host 0
(tests/controller/netns_check.py, run once for the module) attaches a Session and reports what
the ranks saw, what PPO spread over the hosts and on one host gave, and how the headless runner
went through a host that dies and a link that drops (netns_fault_check.py). The tests assert on
what it reports, then on the teardown. Needs root and iproute2 (network
namespaces): without them the cluster's start fails and says so."""

import ipaddress
import json
import sys
from pathlib import Path

import pytest

from workbench.deploy.netns_cluster import NetnsCluster

ROOT = Path(__file__).resolve().parents[2]
PHASES = Path.home() / ".cache" / "hybridflow-workbench" / "netns-phases.txt"
"""The last driver run's phase lines (where its time went)."""
DRIVE_TIMEOUT_S = 1200
"""The one driver: checks, two PPO runs, two fault runs (about 5 minutes in `make test` here; a
machine 3x slower needs more than the suite's 600 s per test, which counts the setup)."""
pytestmark = pytest.mark.timeout(DRIVE_TIMEOUT_S + 300)  # the cluster's start and teardown besides
NODE_TIMEOUT_S = 6.0
DEATH_BOUND_S = 30.0
"""From the start of the iteration a host dies in to the error naming it."""
LINK_BOUND_S = 5 * NODE_TIMEOUT_S
"""From the start of the iteration a link drops in to the error naming the host behind it: the
head's node timeout, and the iteration's calls up to the one that waits on the host."""


@pytest.fixture(scope="module")
def cluster():
    # 4 CPUs: room on one host for the one-host PPO run. A silent host is given up after 6 s.
    cluster = NetnsCluster.up(hosts=2, cpus=4, node_timeout_s=NODE_TIMEOUT_S)
    yield cluster
    cluster.down()  # again after the teardown test: nothing to do then


@pytest.fixture(scope="module")
def driven(cluster):
    """One driver run on host 0 (netns_check): what the ranks saw, then PPO spread over the
    hosts and on one host, same seeds (netns_ppo_check), then the faults (netns_fault_check,
    last: it leaves host 1 rejoined)."""
    return drive(cluster, "netns_check", cluster.name, str(DRIVE_TIMEOUT_S - 60))


@pytest.fixture(scope="module")
def seen(driven):
    return driven["checks"]


@pytest.fixture(scope="module")
def ppo(driven):
    return driven["ppo"]


@pytest.fixture(scope="module")
def faults(driven):
    assert "error" not in driven["faults"], driven["faults"].get("error")
    return driven["faults"]


def by_iteration(history: list[dict]) -> dict[int, dict]:
    """The last row of each iteration (a redone one is logged twice: the failed try, then the redo)."""
    return {row["iteration"]: row for row in history}


def drive(cluster, script: str, *argv: str) -> dict:
    """Run tests/controller/<script>.py as a driver on host 0; its last line's JSON. A driver
    that fails shows its stderr's tail: its phases, and every thread's stack if it hung."""
    run = cluster.run(
        [sys.executable, "-m", f"tests.controller.{script}", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=DRIVE_TIMEOUT_S,
    )
    # Its phases, kept per machine beside the suite's times (conftest.TIMES): the module's time
    # varies between runs (236 s to 552 s in `make test`), and a slow run's record says where.
    PHASES.parent.mkdir(parents=True, exist_ok=True)
    PHASES.write_text("".join(f"{line}\n" for line in run.stderr.splitlines() if line.startswith("[netns_")))
    PHASES.with_name("netns-driver.txt").write_text(run.stdout + run.stderr)  # all of it: what a slow phase did
    assert run.returncode == 0, run.stderr[-12000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def ip(address: str) -> str:
    """'::ffff:10.213.0.1' (an IPv4 peer of a dual-stack socket) -> '10.213.0.1'."""
    parsed = ipaddress.ip_address(address)
    return str(getattr(parsed, "ipv4_mapped", None) or parsed)


def test_one_rank_per_host_all_reduces_over_the_hosts_addresses(cluster, seen):
    host = [cluster.host_ip(0), cluster.host_ip(1)]
    r0, r1 = seen["ranks"]
    assert seen["reduced"] == [3.0, 3.0]
    assert [r0["node_ip"], r1["node_ip"]] == host and r0["node"] != r1["node"]
    assert sorted(seen["nodes"].values()) == host

    # The rendezvous: a TCPStore on rank 0's host address, which rank 1 is connected to.
    store = (host[0], int(r0["env"]["MASTER_PORT"]))
    assert r0["env"]["MASTER_ADDR"] == r1["env"]["MASTER_ADDR"] == host[0]
    assert store in {(ip(c[2]), c[3]) for c in r1["connected"]}
    # gloo listens on each host's own interface, not loopback (its default here: the hostname
    # resolves to 127.0.0.1) and not every interface.
    interfaces = [r0["env"]["GLOO_SOCKET_IFNAME"], r1["env"]["GLOO_SOCKET_IFNAME"]]
    assert interfaces == [f"{cluster.name}-v0", f"{cluster.name}-v1"]
    for rank, own in ((r0, host[0]), (r1, host[1])):
        bound = [ip(a) for a, _ in rank["listening"] if not ipaddress.ip_address(a).is_unspecified]
        assert bound and set(bound) == {own}, rank["listening"]
    # The gloo pair: a connection between the two ranks' processes (seen from both ends),
    # other than the store's, between the two hosts' addresses; and nothing on loopback.
    ends0 = {(ip(c[0]), c[1], ip(c[2]), c[3]) for c in r0["connected"]}
    ends1 = {(ip(c[2]), c[3], ip(c[0]), c[1]) for c in r1["connected"]}
    pair = [c for c in ends0 & ends1 if store not in ((c[0], c[1]), (c[2], c[3]))]
    assert pair and all((c[0], c[2]) == (host[0], host[1]) for c in pair), (ends0, ends1)
    for rank in (r0, r1):
        assert not [c for c in rank["connected"] if ipaddress.ip_address(ip(c[0])).is_loopback], rank["connected"]


def test_a_two_by_two_mesh_keeps_each_tensor_parallel_pair_on_one_host(cluster, seen):
    h0, h1 = cluster.host_ip(0), cluster.host_ip(1)
    assert seen["square"]["nodes"] == [h0, h0, h1, h1]  # ranks node by node: tp pairs within a host
    assert seen["square"]["reduced"] == [10.0] * 4  # 1 + 2 + 3 + 4 over both hosts


def test_a_future_made_on_one_host_is_consumed_on_the_other(cluster, seen):
    node_of = {address: node for node, address in seen["nodes"].items()}
    host0, host1 = node_of[cluster.host_ip(0)], node_of[cluster.host_ip(1)]
    assert (seen["made_on"], seen["used_on"]) == (host0, host1)
    assert seen["rows_ok"]
    # The rows (256 KB: in the object store, not inlined) now have a copy on both hosts.
    assert seen["object_nodes"] == [sorted([host0, host1])]


def test_a_weight_channel_joins_groups_on_two_hosts(cluster, seen):
    # Each group alone sits on one host (its own gloo pinned to loopback); the channel is not.
    assert seen["channel"]["address"][0] == cluster.host_ip(0)
    assert seen["channel"]["shared"] == ["weights v1", "weights v1"]


def test_ppo_spread_over_two_hosts_equals_ppo_on_one(cluster, ppo):
    h0, h1 = cluster.host_ip(0), cluster.host_ip(1)
    spread, one = ppo["spread"], ppo["one"]
    assert spread["placed"] == {"actor": [h0, h1], "critic": [h0], "reward": [h1]}
    assert one["placed"] == {"actor": [h1, h1], "critic": [h1], "reward": [h1]}
    assert len(spread["metrics"]) == 2 and "actor/pg_loss" in spread["metrics"][0]
    assert spread["metrics"] == one["metrics"]  # every metric of every iteration, bit for bit
    assert ppo["weights_equal"] == {"actor": True, "critic": True}  # the exported models too
    # The trace names each call's host: the reward model scored on host 1 the rows generated on
    # both (so half crossed from host 0), the critic on host 0 valued rows from both.
    assert set(spread["bytes_in"]["reward"]) == {h1} and spread["bytes_in"]["reward"][h1] > 0
    assert set(spread["bytes_in"]["critic"]) == {h0} and spread["bytes_in"]["critic"][h0] > 0
    assert set(spread["bytes_in"]["actor"]) == {h0, h1}
    assert {host for role in one["bytes_in"].values() for host in role} == {h1}


def test_a_host_that_dies_is_named_and_the_run_goes_on_without_it(cluster, faults):
    h0, h1 = cluster.host_ip(0), cluster.host_ip(1)
    killed = faults["killed"]
    assert killed["placed"]["1"] == {"actor": [h0, h1], "critic": [h1]}
    [fault] = killed["faults"]
    assert fault["iteration"] == 2 and "died" in fault["error"] and h1 in fault["error"], fault
    assert fault["seconds"] < DEATH_BOUND_S
    assert killed["recoveries"] == 1  # both of host 1's groups in one recovery
    assert killed["placed"]["2"] == {"actor": [h0, h0], "critic": [h0]}  # the remaining capacity
    assert sorted(by_iteration(killed["history"])) == [1, 2]


def test_a_link_that_drops_is_named_within_a_bound_and_the_host_rejoins(cluster, faults):
    h0, h1 = cluster.host_ip(0), cluster.host_ip(1)
    link = faults["link"]
    [fault] = link["faults"]
    assert fault["iteration"] == 2 and h1 in fault["error"], fault
    assert fault["seconds"] < LINK_BOUND_S
    assert link["placed"] == {"1": {"actor": [h0, h1], "critic": [h1]}, "2": {"actor": [h0, h1], "critic": [h1]}}
    # Redone from the checkpoint after iteration 1: on both hosts here, on host 0 alone after
    # the host died, the same numbers (and the same as uninterrupted: test_runner's check).
    assert by_iteration(link["history"]) == by_iteration(faults["killed"]["history"])


def test_teardown_leaves_no_namespace_link_or_process(cluster, driven):
    assert len(cluster.pids) >= 2 * cluster.hosts  # gcs, raylet and agents were recorded
    cluster.down()
    assert cluster.leftovers() == []
    cluster.down()  # idempotent
    assert cluster.leftovers() == []
