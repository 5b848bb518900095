"""A cluster of separate hosts on this machine (workbench.deploy.netns_cluster): each host a
network namespace with its own address, loopback and Ray node. A driver on host 0
(tests/controller/netns_check.py, run once for the module) attaches a Session and reports what
the ranks saw; the tests assert on it, then on the teardown. Needs root and iproute2 (network namespaces): without
them the cluster's start fails and says so."""

import ipaddress
import json
import sys
from pathlib import Path

import pytest

from workbench.deploy.netns_cluster import NetnsCluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    cluster = NetnsCluster.up(hosts=2, cpus=2)
    yield cluster
    cluster.down()  # again after the teardown test: nothing to do then


@pytest.fixture(scope="module")
def seen(cluster):
    """What the driver on host 0 reported (one run for the module's tests)."""
    argv = [sys.executable, "-m", "tests.controller.netns_check", str(cluster.hosts)]
    run = cluster.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
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


def test_teardown_leaves_no_namespace_link_or_process(cluster, seen):
    assert len(cluster.pids) >= 2 * cluster.hosts  # gcs, raylet and agents were recorded
    cluster.down()
    assert cluster.leftovers() == []
    cluster.down()  # idempotent
    assert cluster.leftovers() == []
