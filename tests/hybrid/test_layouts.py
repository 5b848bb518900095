"""The hybrid engine's layouts as data: shards, groups and switch bytes are pure functions of
the Mesh, and the bytes derived from the groups equal HybridFlow Table 2 (the planner reads them)."""

import itertools
import json
from fractions import Fraction

import pytest

from workbench import Mesh
from workbench.errors import ConfigError
from workbench.layouts import (
    RANK_MAP_KEYS,
    Shard,
    contains_training_shard,
    contribution,
    gather_group,
    gather_groups,
    gathered_shard,
    gen_shard,
    gen_sizes,
    generation_groups,
    generation_tp_groups,
    micro_dp_groups,
    rank_map,
    rank_transfer,
    slices,
    train_shard,
    transition_bytes,
)
from workbench.mesh import TRANSITION_METHODS
from workbench.planner import model_preset
from workbench.planner.memory import WEIGHT_BYTES, transition

# The issue's layouts p-t-d -> (p_g-t_g-d_g-d), plus pipeline-parallel ones.
ISSUE = {
    "1-4-1 -> 1-2-2-1": dict(pp=1, tp=4, dp=1, gen_tp=2),
    "1-2-2 -> 1-1-2-2": dict(pp=1, tp=2, dp=2, gen_tp=1),
    "1-4-2 -> 1-2-2-2": dict(pp=1, tp=4, dp=2, gen_tp=2),
}
PIPELINED = {
    "2-2-2 -> 1-1-4-2": dict(pp=2, tp=2, dp=2, gen_pp=1, gen_tp=1),
    "4-1-1 -> 2-1-2-1": dict(pp=4, tp=1, dp=1, gen_pp=2),
    "2-4-1 -> 1-2-4-1": dict(pp=2, tp=4, dp=1, gen_pp=1, gen_tp=2),
}
LAYOUTS = {**ISSUE, **PIPELINED}
MESHES = [
    pytest.param(Mesh(**sizes, transition=method), id=f"{name} {method}")
    for name, sizes in LAYOUTS.items()
    for method in TRANSITION_METHODS
]


def test_issue_layouts_group_ranks_as_the_paper_draws_them():
    # 1-4-1 -> 1-2-2-1: hybridflow takes generation TP ranks at stride 2 and gathers in pairs of
    # consecutive ranks; vanilla forms generation groups like training and gathers all four.
    hf = Mesh(**ISSUE["1-4-1 -> 1-2-2-1"])
    assert generation_groups(hf) == [(0, 2), (1, 3)]
    assert gather_groups(hf) == micro_dp_groups(hf) == [(0, 1), (2, 3)]
    vanilla = Mesh(**ISSUE["1-4-1 -> 1-2-2-1"], transition="vanilla")
    assert generation_groups(vanilla) == [(0, 1), (2, 3)]
    assert gather_groups(vanilla) == [(0, 1, 2, 3)]
    assert micro_dp_groups(vanilla) == [(0, 2), (1, 3)]
    ds = Mesh(**ISSUE["1-4-2 -> 1-2-2-2"], transition="deepspeed_chat")
    assert gather_groups(ds) == [tuple(range(8))]
    assert generation_groups(ds) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # 1-2-2 -> 1-1-2-2: every rank generates alone with the whole model.
    for method in TRANSITION_METHODS:
        m = Mesh(**ISSUE["1-2-2 -> 1-1-2-2"], transition=method)
        assert generation_groups(m) == [(0,), (1,), (2,), (3,)]
        assert all(gen_shard(m, r) == Shard((0, 1), (0, 2)) for r in range(4))
    # 4-1-1 -> 2-1-2-1: the methods differ along the pipeline too.
    assert generation_groups(Mesh(**PIPELINED["4-1-1 -> 2-1-2-1"])) == [(0, 2), (1, 3)]
    assert generation_groups(Mesh(**PIPELINED["4-1-1 -> 2-1-2-1"], transition="vanilla")) == [(0, 1), (2, 3)]


@pytest.mark.parametrize("mesh", MESHES)
def test_every_rank_is_in_exactly_one_gather_and_one_generation_group(mesh):
    everyone = list(range(mesh.world_size))
    for groups in (gather_groups(mesh), generation_groups(mesh), micro_dp_groups(mesh), generation_tp_groups(mesh)):
        assert sorted(r for g in groups for r in g) == everyone
    assert all(list(g) == sorted(g) for g in gather_groups(mesh) + micro_dp_groups(mesh))
    assert len(generation_groups(mesh)) == mesh.dp * mesh.micro_dp
    # a generation replica lives inside one training replica, at its generation coordinates
    gen_pp, gen_tp = gen_sizes(mesh)
    for replica, group in enumerate(generation_groups(mesh)):
        assert len({mesh.coord(r).dp for r in group}) == 1
        for i, r in enumerate(group):
            assert tuple(mesh.gen_coord(r)) == (i // gen_tp, i % gen_tp, replica)


@pytest.mark.parametrize("mesh", MESHES)
def test_a_generation_replica_holds_the_whole_model_exactly_once(mesh):
    whole = sorted(Shard((0, mesh.pp), (0, mesh.tp)).pieces)
    for group in generation_groups(mesh):
        assert sorted(p for r in group for p in gen_shard(mesh, r).pieces) == whole


@pytest.mark.parametrize("mesh", MESHES)
def test_each_rank_gathers_a_block_it_can_cut_its_generation_shard_from(mesh):
    for group in gather_groups(mesh):
        for r in group:
            block = gathered_shard(mesh, r)
            assert block.contains(gen_shard(mesh, r)) and block.contains(train_shard(mesh, r))
            # the members' parts tile the block: each piece `count` times, split `count` ways
            shard, index, count = contribution(mesh, r)
            assert 0 <= index < count and len(group) == count * len(block.pieces)
            if mesh.transition == "hybridflow":
                assert block == gen_shard(mesh, r)
        # members in rank order deliver the block's pieces in order (stage-major)
        first = gathered_shard(mesh, group[0])
        order = [p for r in group for p in train_shard(mesh, r).pieces]
        if mesh.transition == "deepspeed_chat":
            assert order == first.pieces * mesh.dp
            assert [contribution(mesh, r)[1] for r in group] == [mesh.coord(r).dp for r in group]
        else:
            assert order == first.pieces


@pytest.mark.parametrize("name", LAYOUTS)
def test_hybridflow_generation_shard_contains_the_training_shard_on_every_rank(name):
    hf, vanilla = Mesh(**LAYOUTS[name]), Mesh(**LAYOUTS[name], transition="vanilla")
    assert all(contains_training_shard(hf, r) for r in range(hf.world_size))
    outside = [r for r in range(vanilla.world_size) if not contains_training_shard(vanilla, r)]
    # vanilla keeps them apart wherever generation still shards the model
    assert bool(outside) == (gen_sizes(vanilla) != (1, 1)), outside
    if name == "1-4-1 -> 1-2-2-1":
        assert outside == [1, 2]


def test_slices_cut_equal_contiguous_pieces_and_generation_pieces_join_training_ones():
    assert [slices(12, i, 4) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    m = Mesh(**ISSUE["1-4-1 -> 1-2-2-1"])
    for r in range(4):
        t0, t1 = gen_shard(m, r).tp
        assert slices(12, m.gen_coord(r).tp, 2) == (slices(12, t0, 4)[0], slices(12, t1 - 1, 4)[1])
    with pytest.raises(ValueError, match="size 10 does not split into 4 equal pieces"):
        slices(10, 0, 4)
    with pytest.raises(ValueError, match="piece index 4 of 4"):
        slices(8, 4, 4)


# ---- Table 2 -------------------------------------------------------------------------------
SPEC = model_preset("llama2-13b")
M = SPEC.param_count * WEIGHT_BYTES
TABLE2_MESHES = [
    Mesh(pp=p, tp=t, dp=d, gen_pp=pg, gen_tp=tg, transition=method)
    for p, t, d in itertools.product((1, 2, 4), (1, 2, 4, 8), (1, 2, 4))
    for pg, tg in itertools.product((1, 2, 4), (1, 2, 4, 8))
    if p % pg == 0 and t % tg == 0
    for method in TRANSITION_METHODS
]


def table2(mesh, m):
    """HybridFlow Table 2 written out, exactly, per rank: (received, peak, redundant,
    generation shard) for a model of m bytes."""
    (p, t, d), (pg, tg) = (mesh.pp, mesh.tp, mesh.dp), gen_sizes(mesh)
    mp, n, gen = p * t, p * t * d, Fraction(m, pg * tg)
    if mesh.transition == "deepspeed_chat":
        return Fraction(n - 1, n) * m, m, Fraction(m, n), gen
    if (pg, tg) == (p, t):
        return 0, Fraction(m, mp), 0, gen
    if mesh.transition == "vanilla":
        return Fraction(mp - 1, mp) * m, m, Fraction(m, mp), gen
    return Fraction(mp - pg * tg, pg * tg * mp) * m, gen, 0, gen


def exact(x):
    x = Fraction(x)
    return int(x) if x.denominator == 1 else float(x)


def test_bytes_derived_from_the_groups_equal_table_2():
    assert len(TABLE2_MESHES) > 300
    for mesh in TABLE2_MESHES:
        want = tuple(exact(x) for x in table2(mesh, M))
        for counted in transition_bytes(mesh, M):
            got = (counted.received, counted.peak_params, counted.redundant, counted.generation_params)
            assert got == want, (str(mesh), counted)
            assert counted.sent == counted.received  # ring all-gather, equal parts


def test_one_rank_alone_counts_what_all_ranks_together_do():
    for mesh in TABLE2_MESHES[::7]:
        rows = transition_bytes(mesh, M)
        for r in {0, mesh.world_size // 2, mesh.world_size - 1}:
            assert rank_transfer(mesh, M, r) == rows[r], (str(mesh), r)
            assert gather_group(mesh, r) in gather_groups(mesh)


def test_the_planner_reads_these_bytes():
    # The planner's memory model and simulators take the switch from here (one count of it).
    for mesh in TABLE2_MESHES[::5]:
        gen_pp, gen_tp = gen_sizes(mesh)
        planned = transition(
            SPEC, Mesh(mesh.pp, mesh.tp, mesh.dp), Mesh(gen_pp, gen_tp, mesh.dp * mesh.micro_dp), mesh.transition
        )
        row = transition_bytes(mesh, M)[0]
        assert (planned.comm_bytes, planned.peak_params, planned.redundant, planned.generation_params) == (
            row.received,
            row.peak_params,
            row.redundant,
            row.generation_params,
        ), str(mesh)


@pytest.mark.parametrize("name", ISSUE)
def test_issue_layouts_bytes_per_rank(name):
    sizes = ISSUE[name]
    p, t, d, tg = sizes["pp"], sizes["tp"], sizes["dp"], sizes["gen_tp"]
    m = 1 << 20
    expect = {  # Table 2: (received, peak, redundant)
        "deepspeed_chat": ((t * p * d - 1) * m // (t * p * d), m, m // (t * p * d)),
        "vanilla": ((t * p - 1) * m // (t * p), m, m // (t * p)),
        "hybridflow": ((t * p - tg) * m // (tg * t * p), m // tg, 0),
    }
    for method, want in expect.items():
        rows = transition_bytes(Mesh(**sizes, transition=method), m)
        assert [(x.received, x.peak_params, x.redundant) for x in rows] == [want] * (t * p * d)


def test_hybridflow_moves_least_and_keeps_nothing_beside():
    for sizes in LAYOUTS.values():
        hf, va, ds = (
            transition_bytes(Mesh(**sizes, transition=k), M) for k in ("hybridflow", "vanilla", "deepspeed_chat")
        )
        for h, v, s in zip(hf, va, ds):
            assert h.received <= v.received <= s.received
            assert h.peak_params == h.generation_params <= v.peak_params == s.peak_params == M
            assert h.redundant == 0 < s.redundant <= v.redundant


# ---- rank map and errors ---------------------------------------------------------------------
@pytest.mark.parametrize("mesh", MESHES)
def test_rank_map_rows_agree_with_the_functions(mesh):
    rows = rank_map(mesh)
    assert [row["rank"] for row in rows] == list(range(mesh.world_size))
    for row in rows:
        r = row["rank"]
        assert tuple(row) == RANK_MAP_KEYS
        assert (row["train_pp"], row["train_tp"], row["train_dp"]) == tuple(mesh.coord(r))
        assert (row["gen_pp"], row["gen_tp"], row["gen_replica"]) == tuple(mesh.gen_coord(r))
        assert row["train_shard"] == train_shard(mesh, r) and row["gen_shard"] == gen_shard(mesh, r)
        assert r in row["gather_group"] and r in row["micro_dp_group"]
        assert row["contains_training_shard"] == row["gen_shard"].contains(row["train_shard"])
    json.dumps(rows)  # plain data for notebooks and widgets


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ConfigError, match="Mesh.transition='megatron': use one of 'deepspeed_chat'"):
        Mesh(tp=2, transition="megatron")
    m = Mesh(**ISSUE["1-4-1 -> 1-2-2-1"])
    with pytest.raises(IndexError, match="rank 4 outside a mesh of 4 ranks"):
        gen_shard(m, 4)
    assert transition_bytes(m, 10)[0].received == 2.5  # exact ints where M divides, else float
    assert transition_bytes(m, 16)[0] == (0, 4, 4, 8, 0, 8)
    with pytest.raises(ValueError, match="model_bytes=-1"):
        transition_bytes(m, -1)
    with pytest.raises(TypeError, match="expected a workbench Mesh"):
        rank_map((1, 4, 1))
