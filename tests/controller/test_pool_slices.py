"""Slices of a pool without Ray: which devices they hold and which pools share devices."""

import pytest

from workbench import PlacementError
from workbench.controller.resource_pool import ResourcePool

GROUP = object()  # a placement group stand-in: slices only compare it by identity


def four_devices() -> ResourcePool:
    return ResourcePool("whole", [2, 2], "CPU", 4, ["a", "a", "b", "b"], GROUP)


def test_a_slice_holds_its_parents_devices_and_nodes():
    whole = four_devices()
    middle = whole.slice("middle", 1, 2)
    assert middle.devices == (1, 2) and middle.parent == "whole" and middle.world_size == 2
    assert (middle.node_ids, middle.devices_per_node) == (["a", "b"], [1, 1])
    assert middle.last_calls is whole.last_calls  # one call order per device
    assert whole.devices == (0, 1, 2, 3)


def test_pools_share_devices_only_where_their_devices_meet():
    whole = four_devices()
    left, right, middle = whole.slice("left", 0, 2), whole.slice("right", 2, 2), whole.slice("middle", 1, 2)
    assert whole.shares_devices(left) and left.shares_devices(middle) and middle.shares_devices(right)
    assert not left.shares_devices(right)
    other = ResourcePool("other", [2], "CPU", 4, ["c", "c"], object())
    assert not other.shares_devices(whole) and other.shares_devices(other)


def test_a_slice_beyond_its_pool_is_refused():
    with pytest.raises(PlacementError, match=r"slice 'far' of pool 'whole': devices \[3, 3\+2\) are not within its 4"):
        four_devices().slice("far", 3, 2)
    with pytest.raises(PlacementError, match="are not within"):
        four_devices().slice("empty", 0, 0)


def test_releasing_a_slice_keeps_its_parents_devices():
    whole = four_devices()
    piece = whole.slice("piece", 0, 1)
    piece.release()  # a real parent's placement group would be removed here if it were not a slice
    assert piece.placement is None and whole.placement is GROUP


def test_a_rollout_group_may_share_some_or_all_of_the_actors_devices():
    """The weight push runs as joint calls over gloo, so a rollout on a slice of the actor's pool,
    on the pool itself or apart takes the actor's weights alike; its layout is still checked."""
    from types import SimpleNamespace

    from workbench import Mesh
    from workbench.errors import ConfigError
    from workbench.workers import ActorConfig
    from workbench.workers.rollout_link import check_rollout_pair

    whole = four_devices()
    actor = SimpleNamespace(config=ActorConfig("model"), pool=whole.slice("train", 0, 2), mesh=Mesh(dp=2))
    for pool in (whole.slice("gen", 1, 2), whole, whole.slice("gen", 2, 2)):
        check_rollout_pair(actor, SimpleNamespace(config=ActorConfig("model", train=False), pool=pool, mesh=Mesh(dp=2)))
    cut = SimpleNamespace(config=ActorConfig("model", train=False), pool=whole.slice("gen", 0, 2), mesh=Mesh(tp=2))
    with pytest.raises(ConfigError, match=r"data-parallel ranks only"):
        check_rollout_pair(actor, cut)
