import pytest

from workbench.planner import TaskGraph, time_cost


def test_disjoint_meshes_run_concurrently():
    g = TaskGraph()
    g.add("a", 2.0, (0, 2))
    g.add("b", 3.0, (2, 4))
    s = time_cost(g)
    assert s.start == [0.0, 0.0] and s.makespan == 3.0


def test_overlapping_meshes_never_run_together():
    g = TaskGraph()
    a = g.add("a", 2.0, (0, 4))  # whole machine
    b = g.add("b", 3.0, (2, 4))  # overlaps a
    c = g.add("c", 1.0, (0, 2))  # overlaps a, not b
    s = time_cost(g)
    # Ready order a, b, c (all at 0): a [0,2]; b waits for a: [2,5]; c waits for a: [2,3].
    assert (s.start[a], s.end[a]) == (0, 2)
    assert (s.start[b], s.end[b]) == (2, 5)
    assert (s.start[c], s.end[c]) == (2, 3)
    assert s.makespan == 5


def test_dependencies_and_deviceless_transfers():
    g = TaskGraph()
    a = g.add("a", 1.0, (0, 2))
    c = g.add("c", 1.0, (2, 4))
    t = g.add("data a->b", 0.5, (), [a], kind="data")
    b = g.add("b", 2.0, (2, 4), [t])
    s = time_cost(g)
    assert (s.start[c], s.end[c]) == (0, 1)
    assert (s.start[t], s.end[t]) == (1, 1.5)
    assert (s.start[b], s.end[b]) == (1.5, 3.5)
    assert s.makespan == 3.5


def test_ready_time_orders_the_queue():
    # x finishes late on d0-1; y (ready at 0) and z (ready when x ends) both want d2-3.
    g = TaskGraph()
    x = g.add("x", 4.0, (0, 2))
    z = g.add("z", 1.0, (2, 4), [x])
    y = g.add("y", 2.0, (2, 4))
    s = time_cost(g)
    assert (s.start[y], s.end[y]) == (0, 2)
    assert (s.start[z], s.end[z]) == (4, 5)


def test_task_spanning_two_ranges_waits_for_both():
    g = TaskGraph()
    a = g.add("a", 1.0, (0, 2))
    b = g.add("b", 3.0, (4, 6))
    r = g.add("realloc", 0.5, ((0, 2), (4, 6)))
    s = time_cost(g)
    assert s.start[r] == 3.0 and s.makespan == 3.5
    assert s.end[a] == 1.0 and s.end[b] == 3.0


def test_parents_must_exist():
    g = TaskGraph()
    with pytest.raises(ValueError, match="not an earlier task"):
        g.add("a", 1.0, (0, 1), [3])
