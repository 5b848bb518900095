"""Transfer protocols as pure functions of the mesh (HybridFlow Table 3)."""

import pytest
import torch

from workbench import (
    ALL_TO_ALL,
    DP_PROTO,
    ONE_TO_ALL,
    ONE_TO_ALL_KEEP_RANK0,
    THREE_D_ALL_MICRO_DP,
    THREE_D_PP_ONLY,
    THREE_D_PROTO,
    Batch,
    Mesh,
    Protocol,
)
from workbench.errors import ConfigError


def rows(n):
    return Batch({"x": torch.arange(n)})


def chunk_values(protocol, mesh, n):
    return [part["x"].tolist() for part in protocol.distribute(mesh, rows(n))]


def test_rank_layout_tp_innermost_then_pp_then_dp():
    m = Mesh(pp=2, tp=2, dp=2)
    assert [tuple(m.coord(r)) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert m.coord(5) == (0, 1, 1) and m.rank(pp=1, tp=0, dp=1) == 6
    assert all(m.rank(*m.coord(r)) == r for r in range(8))
    with pytest.raises(ValueError, match="does not divide"):
        Mesh.for_world(6, tp=4)


@pytest.mark.parametrize(
    "mesh, dp_chunks, collected",
    [
        (Mesh(1, 1, 4), [[0, 1], [2, 3], [4, 5], [6, 7]], [0, 1, 2, 3]),
        (Mesh(1, 2, 2), [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2, [0, 2]),
        (Mesh(2, 2, 2), [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4, [2, 6]),
    ],
)
def test_3d_proto_splits_by_dp_and_collects_last_stage_tp0(mesh, dp_chunks, collected):
    assert chunk_values(THREE_D_PROTO, mesh, 8) == dp_chunks
    assert THREE_D_PROTO.collect_ranks(mesh) == collected
    assert THREE_D_PROTO.num_chunks(mesh) == mesh.dp


@pytest.mark.parametrize("mesh", [Mesh(1, 1, 4), Mesh(1, 2, 2), Mesh(2, 2, 2)])
def test_dp_proto_one_chunk_per_rank(mesh):
    n = mesh.world_size
    assert chunk_values(DP_PROTO, mesh, 2 * n) == [[2 * r, 2 * r + 1] for r in range(n)]
    assert DP_PROTO.collect_ranks(mesh) == list(range(n))


@pytest.mark.parametrize("mesh", [Mesh(1, 1, 4), Mesh(1, 2, 2), Mesh(2, 2, 2)])
def test_one_to_all_and_pp_only_broadcast(mesh):
    b = rows(3)
    assert all(part is b for part in ONE_TO_ALL.distribute(mesh, b))
    assert ONE_TO_ALL.collect(mesh, [1, 2]) == [1, 2]
    assert THREE_D_PP_ONLY.collect_ranks(mesh) == [mesh.rank(pp=p) for p in range(mesh.pp)]
    assert ONE_TO_ALL_KEEP_RANK0.collect_ranks(mesh) == [0] and ONE_TO_ALL_KEEP_RANK0.collect(mesh, ["a"]) == "a"


def test_all_to_all_takes_one_input_per_rank():
    m = Mesh(1, 2, 2)
    assert ALL_TO_ALL.distribute(m, [10, 11, 12, 13]) == [10, 11, 12, 13]
    with pytest.raises(ValueError, match="one input per rank: a list of 4"):
        ALL_TO_ALL.distribute(m, [1, 2])


def test_micro_dp_generation_groups_are_strided_and_collect_one_rank_per_replica():
    # Training tp=4 -> generation tp=2: two generation replicas per training replica. Their TP
    # groups take ranks at stride 2 ({0,2}, {1,3}), so each keeps its own training shard.
    m = Mesh(pp=1, tp=4, dp=2, gen_tp=2)
    assert m.micro_dp == 2
    assert [m.gen_replica(r) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert chunk_values(THREE_D_ALL_MICRO_DP, m, 8) == [[0, 1], [2, 3], [0, 1], [2, 3], [4, 5], [6, 7], [4, 5], [6, 7]]
    assert THREE_D_ALL_MICRO_DP.collect_ranks(m) == [0, 1, 4, 5]
    # (2,2,2) trained, generated with pp=1, tp=1: every rank is its own generation replica.
    full = Mesh(pp=2, tp=2, dp=2, gen_pp=1, gen_tp=1)
    assert full.micro_dp == 4 and sorted(full.gen_replica(r) for r in range(8)) == list(range(8))
    assert THREE_D_ALL_MICRO_DP.collect_ranks(full) == list(range(8))
    with pytest.raises(ValueError, match="must divide"):
        Mesh(tp=2, gen_tp=4)


def test_vanilla_generation_groups_are_consecutive_and_the_protocol_follows():
    # The same 1-4-2 -> (1-2-2-2) switch with generation groups formed like training groups:
    # generation TP groups {0,1}, {2,3}, ...; replicas 0 and 1 inside training replica 0.
    m = Mesh(pp=1, tp=4, dp=2, gen_tp=2, transition="vanilla")
    assert [m.gen_replica(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [m.gen_coord(r).tp for r in range(8)] == [0, 1] * 4
    assert chunk_values(THREE_D_ALL_MICRO_DP, m, 8) == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]]
    assert THREE_D_ALL_MICRO_DP.collect_ranks(m) == [0, 2, 4, 6]
    assert THREE_D_ALL_MICRO_DP.num_chunks(m) == 4
    # Along the pipeline: 4 stages -> 2, hybridflow pairs stages {0,2}, {1,3}; the others {0,1}, {2,3}.
    pipelined = dict(pp=4, tp=1, dp=1, gen_pp=2)
    assert [Mesh(**pipelined).gen_replica(r) for r in range(4)] == [0, 1, 0, 1]
    consecutive = Mesh(**pipelined, transition="deepspeed_chat")
    assert [consecutive.gen_replica(r) for r in range(4)] == [0, 0, 1, 1]
    assert THREE_D_ALL_MICRO_DP.collect_ranks(consecutive) == [1, 3]  # last generation stage, tp 0
    assert str(m) == "Mesh(pp=1, tp=4, dp=2, gen pp=1 tp=2 (vanilla))"
    assert str(Mesh(tp=4, gen_tp=2)) == "Mesh(pp=1, tp=4, dp=1, gen pp=1 tp=2)"


def test_the_transition_method_is_checked_and_hybridflow_by_default():
    assert Mesh().transition == "hybridflow"
    with pytest.raises(
        ConfigError, match="Mesh.transition='zero3': use one of 'deepspeed_chat', 'vanilla', 'hybridflow'"
    ):
        Mesh(tp=4, gen_tp=2, transition="zero3")


def test_collect_concatenates_batches_and_drops_padding():
    m = Mesh(1, 1, 2)
    parts = DP_PROTO.distribute(m, rows(3).pad_to_multiple(2))
    assert DP_PROTO.collect(m, parts)["x"].tolist() == [0, 1, 2]
    assert DP_PROTO.collect(m, [torch.ones(2), torch.zeros(1)]).tolist() == [1, 1, 0]
    assert DP_PROTO.collect(m, [{"a": 1}, {"a": 2}]) == [{"a": 1}, {"a": 2}]


def test_user_defined_protocol_is_a_distribute_collect_pair():
    scaled = Protocol(
        "SCALED", distribute=lambda m, v: [v * (r + 1) for r in range(m.world_size)], collect=lambda m, outs: sum(outs)
    )
    m = Mesh(dp=3)
    assert scaled.distribute(m, 1) == [1, 2, 3] and scaled.collect(m, [1, 2, 3]) == 6
    assert scaled.num_chunks(m) is None
