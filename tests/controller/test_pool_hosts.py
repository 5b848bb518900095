"""Session.pool(..., hosts=[...]): which nodes a pool may take (the planning half, no Ray).
The cross-host run in test_netns_cluster.py places its groups this way on real hosts."""

import pytest

from workbench.controller.resource_pool import NodeInfo, _choose_nodes, check_hosts, on_hosts
from workbench.errors import PlacementError

NODES = [
    NodeInfo("aaaa1111", "10.0.0.1", 4.0),
    NodeInfo("bbbb2222", "10.0.0.2", 4.0),
    NodeInfo("cccc3333", "10.0.0.3", 4.0),
]


def nodes_for(devices, hosts, reserved=None):
    return _choose_nodes("p", devices, on_hosts("p", devices, NODES, hosts), reserved or {}, "CPU")


def test_a_pool_goes_on_the_hosts_named_in_their_order():
    assert nodes_for(2, ()) == ["aaaa1111", "aaaa1111"]  # unnamed: fill in order, head first
    assert nodes_for(2, ("10.0.0.3",)) == ["cccc3333", "cccc3333"]
    assert nodes_for([1, 1], ("10.0.0.3", "aaaa1111")) == ["cccc3333", "aaaa1111"]  # by address or id
    assert nodes_for(6, ("10.0.0.2", "10.0.0.3"), {"bbbb2222": 2.0}) == ["bbbb2222"] * 2 + ["cccc3333"] * 4


def test_a_host_that_is_not_an_alive_node_is_refused_naming_the_alive_ones():
    with pytest.raises(PlacementError, match=r"hosts \['10.0.0.9'\] are not alive nodes.*10.0.0.1 \(aaaa1111\)"):
        nodes_for(1, ("10.0.0.9",))


@pytest.mark.parametrize("devices, hosts", [([1, 1], ("10.0.0.1",)), (2, ("10.0.0.1", "aaaa1111"))])
def test_hosts_must_be_distinct_and_one_per_entry_of_a_list(devices, hosts):
    with pytest.raises(PlacementError, match="must name distinct nodes"):
        nodes_for(devices, hosts)


def test_a_pool_larger_than_its_hosts_free_devices_is_refused():
    with pytest.raises(PlacementError, match="asks for 5"):
        nodes_for(5, ("10.0.0.1",))


@pytest.mark.parametrize("hosts", ["10.0.0.1", [""], [1], None])
def test_hosts_that_are_not_a_list_of_names_are_refused_before_anything_is_asked(hosts):
    with pytest.raises(PlacementError, match="give a list of node addresses or node ids"):
        check_hosts("p", 1, hosts)
