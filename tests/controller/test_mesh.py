"""Mesh, the one (pp, tp, dp) layout type: its rank order decides which ranks share a machine,
and the planner's placement reasoning asks the mesh rather than assuming an order of its own."""

import itertools

import pytest

from workbench import Mesh


def machines(ranks, per_node):
    return {r // per_node for r in ranks}


def dp_group(mesh, rank):
    c = mesh.coord(rank)
    return [mesh.rank(pp=c.pp, tp=c.tp, dp=d) for d in range(mesh.dp)]


def replicas(mesh):
    return [[mesh.rank(pp=p, tp=t, dp=d) for p in range(mesh.pp) for t in range(mesh.tp)] for d in range(mesh.dp)]


SIZES = [Mesh(p, t, d) for p, t, d in itertools.product((1, 2, 3, 4), (1, 2, 4, 8), (1, 2, 3, 4))]


@pytest.mark.parametrize("per_node", [4, 8])
def test_where_ranks_sit_follows_the_rank_order(per_node):
    for mesh in SIZES:
        # a replica (one copy of the weights) is pp*tp consecutive ranks
        assert all(sorted(r) == list(range(r[0], r[0] + mesh.model_parallel)) for r in replicas(mesh))
        spans = any(len(machines(r, per_node)) > 1 for r in replicas(mesh))
        assert mesh.replica_spans_nodes(per_node) == spans, mesh
        # data-parallel peers are pp*tp ranks apart; the fewest of a group on one machine
        groups = [dp_group(mesh, r) for r in range(mesh.model_parallel)]
        assert all(b - a == mesh.model_parallel for g in groups for a, b in zip(g, g[1:]))
        fewest = min(sum(r // per_node == m for r in g) for g in groups for m in machines(g, per_node))
        assert mesh.dp_peers_per_node(per_node) == fewest, mesh


def test_positional_sizes_ordering_and_the_planners_text_form():
    assert Mesh(1, 2, 4) == Mesh(pp=1, tp=2, dp=4) and Mesh(1, 2, 4).model_parallel == 2
    assert sorted([Mesh(2, 1, 1), Mesh(1, 2, 2), Mesh(1, 2, 1), Mesh(1, 1, 4)]) == [
        Mesh(1, 1, 4),
        Mesh(1, 2, 1),
        Mesh(1, 2, 2),
        Mesh(2, 1, 1),
    ]  # by (pp, tp, dp)
    assert Mesh(1, 4, 2) < Mesh(1, 4, 2, gen_tp=2) and not Mesh(1, 4, 2) < Mesh(1, 4, 2)
    assert Mesh(1, 2, 4).short() == "p1t2d4" and str(Mesh(1, 2, 4)) == "Mesh(pp=1, tp=2, dp=4)"
    assert Mesh(1, 4, 2, gen_tp=2).short() == "p1t4d2|p1t2d4"
    with pytest.raises(TypeError):
        _ = Mesh(1, 2, 4) < (1, 2, 4)


def test_generation_layout_from_a_mesh_of_its_own():
    train, gen = Mesh(2, 4, 2), Mesh(1, 2, 8)
    hybrid = train.with_generation(gen, "vanilla")
    assert (hybrid.gen_pp, hybrid.gen_tp, hybrid.transition, hybrid.micro_dp) == (1, 2, "vanilla", 4)
    assert hybrid.short() == "p2t4d2|p1t2d8"
    with pytest.raises(ValueError, match="p1t2d4 has 8 ranks, the training layout p2t4d2 16"):
        train.with_generation(Mesh(1, 2, 4))
    with pytest.raises(ValueError, match="must divide the training"):
        Mesh(1, 2, 8).with_generation(Mesh(1, 4, 4))
