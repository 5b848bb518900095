"""Parameter reallocation plans as data: every destination element comes from exactly one sender
that holds it, the planner counts the plan's bytes, and the 3D-HybridEngine's three switches are
special cases with Table 2's bytes (no processes here: tests/hybrid/test_reallocate.py runs them)."""

import itertools

import pytest
import torch

from workbench import Mesh, layouts
from workbench.mesh import TRANSITION_METHODS
from workbench.planner import ModelSpec, Simulator, Workload, cluster_preset, realloc_bytes
from workbench.transfers import (
    Param,
    Placement,
    even_stages,
    hybrid_engine_placements,
    llama_params,
    llama_shapes,
    llama_split,
    plan,
    rank_bytes,
    switch_placements,
)

# A 1m-kit-shaped Llama with a small vocabulary: (hidden, layers, heads, kv heads, intermediate, vocab).
SHAPE = (128, 4, 4, 4, 352, 256)
SPEC = ModelSpec("tiny", SHAPE[1], SHAPE[0], SHAPE[2], SHAPE[3], SHAPE[4], SHAPE[5])
PARAMS = llama_params(llama_shapes(*SHAPE), SHAPE[1])

# (source mesh, source first rank, destination mesh, destination first rank): pp, tp and dp
# changes, on one rank set, overlapping ones and two disjoint ones (another pool).
PAIRS = {
    "1-2-1 -> 2-1-1": (Mesh(1, 2, 1), 0, Mesh(2, 1, 1), 0),
    "1-1-2 -> 1-2-1": (Mesh(1, 1, 2), 0, Mesh(1, 2, 1), 0),
    "2-1-1 -> 1-1-2": (Mesh(2, 1, 1), 0, Mesh(1, 1, 2), 0),
    "2-2-1 -> 1-2-2": (Mesh(2, 2, 1), 0, Mesh(1, 2, 2), 0),
    "1-4-1 -> 4-1-1": (Mesh(1, 4, 1), 0, Mesh(4, 1, 1), 0),
    "1-2-1 -> 2-1-1 other pool": (Mesh(1, 2, 1), 0, Mesh(2, 1, 1), 2),
    "1-1-2 -> 1-2-2 other pool": (Mesh(1, 1, 2), 0, Mesh(1, 2, 2), 2),
    "2-1-2 -> 1-4-1 overlapping": (Mesh(2, 1, 2), 0, Mesh(1, 4, 1), 2),
    "1-2-2 -> 2-2-1 inside": (Mesh(1, 2, 2), 0, Mesh(2, 2, 1), 0),
}


def placements(name):
    m1, f1, m2, f2 = PAIRS[name]
    return Placement(m1, f1), Placement(m2, f2)


def _holds(placement, rank, param, n_units=SHAPE[1] + 2):
    return placement.holds(rank, param, placement.stage_map(n_units))


def shard_bytes(placement, rank, params=PARAMS, n_units=SHAPE[1] + 2):
    """Bytes of the weights `rank` holds under `placement`."""
    total = 0
    for q in params:
        held = _holds(placement, rank, q, n_units)
        if held is not False:
            total += q.numel * q.itemsize // (1 if held is None else placement.mesh.tp)
    return total


@pytest.mark.parametrize("name", PAIRS)
def test_every_destination_element_comes_once_from_a_rank_that_holds_it(name):
    src, dst = placements(name)
    p = plan(PARAMS, src, dst)
    by_target = {}
    for f in p.fragments:
        by_target.setdefault((f.dst, f.name), []).append(f)
    params = {q.name: q for q in PARAMS}
    for d, q in itertools.product(dst.ranks, PARAMS):
        want = _holds(dst, d, q)
        frags = by_target.pop((d, q.name), [])
        if want is False:
            assert not frags, (d, q.name)
            continue
        if want is None:  # a whole weight: one fragment, from a rank holding it whole
            assert len(frags) == 1 and frags[0].dim is None and _holds(src, frags[0].src, q) is None
            continue
        covered = torch.zeros(want[1] - want[0], dtype=torch.int64)
        for f in frags:
            have = _holds(src, f.src, params[f.name])
            assert have not in (False, None), f
            # the same global position, read inside the sender's piece, written inside the receiver's
            assert have[0] + f.src_start == want[0] + f.dst_start and f.src_start + f.length <= have[1] - have[0]
            covered[f.dst_start : f.dst_start + f.length] += 1
        assert covered.eq(1).all(), (d, q.name)
    assert not by_target  # nothing for ranks or weights outside the destination


@pytest.mark.parametrize("name", PAIRS)
def test_bytes_per_rank_equal_the_formula_the_planner_reads(name):
    src, dst = placements(name)
    counted = plan(PARAMS, src, dst).bytes_per_rank()
    assert counted == rank_bytes(PARAMS, src, dst)
    m1, f1, m2, f2 = PAIRS[name]
    assert counted == realloc_bytes(SPEC, m1, f1, m2, f2, dtype_bytes=4)
    total = sum(b.sent for b in counted.values())
    assert total == sum(b.received for b in counted.values())
    # the destination ranks already hold their new pieces (data-parallel copies, or stages of a replica)
    assert (total == 0) == (name in ("1-1-2 -> 1-2-1", "1-2-2 -> 2-2-1 inside"))
    # a rank receives its destination shard minus what it already holds
    for d in dst.ranks:
        need = shard_bytes(dst, d)
        assert counted[d].received <= need
        if d not in src.ranks:
            assert counted[d].received == need


@pytest.mark.parametrize("mesh", [Mesh(1, 2, 2), Mesh(2, 2, 1), Mesh(4, 1, 1), Mesh(1, 1, 4)])
def test_the_same_layout_on_the_same_ranks_moves_nothing(mesh):
    same = plan(PARAMS, Placement(mesh), Placement(mesh))
    assert all(f.src == f.dst for f in same.fragments)
    assert set(same.bytes_per_rank().values()) == {(0, 0)}
    moved = plan(PARAMS, Placement(mesh), Placement(mesh, first=mesh.world_size))  # another pool: everything
    dst = moved.dst
    assert {r: b.received for r, b in moved.bytes_per_rank().items() if r in dst.ranks} == {
        r: shard_bytes(dst, r) for r in dst.ranks
    }
    sim = Simulator(cluster_preset("local", 8), Workload())
    assert sim.realloc_time(SPEC, mesh, (0, 4), mesh, (0, 4)) == 0.0


def test_senders_spread_over_replicas_for_another_pool():
    # 1-1-2 on ranks 0, 1 -> 1-1-4 on ranks 2..5: each source replica serves two destinations.
    p = plan(PARAMS, Placement(Mesh(1, 1, 2)), Placement(Mesh(1, 1, 4), first=2))
    sent = {r: b.sent for r, b in p.bytes_per_rank().items()}
    assert sent[0] == sent[1] > 0 and sent[2] == sent[3] == sent[4] == sent[5] == 0


def test_layers_are_planned_one_unit_at_a_time():
    p = plan(PARAMS, Placement(Mesh(1, 2, 1)), Placement(Mesh(2, 1, 1)))
    assert len(p.layers) == SHAPE[1] + 2
    assert {f.name.split(".")[2] for f in p.layers[1]} == {"0"}
    assert {f.name for f in p.layers[0]} == {"model.embed_tokens.weight"}
    assert even_stages(6, 2) == (0, 0, 0, 1, 1, 1) and even_stages(7, 2) == (0, 0, 0, 0, 1, 1, 1)


# ---- the 3D-HybridEngine's switch as a special case -----------------------------------------------
HYBRID = {
    "1-4-1 -> 1-2-2-1": dict(pp=1, tp=4, dp=1, gen_tp=2),
    "1-2-2 -> 1-1-2-2": dict(pp=1, tp=2, dp=2, gen_tp=1),
    "1-4-2 -> 1-2-2-2": dict(pp=1, tp=4, dp=2, gen_tp=2),
    "2-2-2 -> 1-1-4-2": dict(pp=2, tp=2, dp=2, gen_pp=1, gen_tp=1),
    "4-1-1 -> 2-1-2-1": dict(pp=4, tp=1, dp=1, gen_pp=2),
    "2-4-1 -> 1-2-4-1": dict(pp=2, tp=4, dp=1, gen_pp=1, gen_tp=2),
}


def _uniform_model(pp):
    """Table 2's model: M split evenly over the p·t training shards (every weight cut, every
    layer alike, layers a multiple of pp): 2 weights per layer, cut along dims 0 and 1."""
    n = 2 * pp
    return [Param(f"l{i}.{w}", (16, 24), dim, i) for i in range(n) for w, dim in (("a", 0), ("b", 1))], n


def _staged(placement, n):
    """`placement` with the uniform model's n layer units spread evenly over its stages."""
    pp = placement.mesh.pp
    return Placement(placement.mesh, ranks=placement.ranks, stages=tuple(i * pp // n for i in range(n)))


@pytest.mark.parametrize("name", HYBRID)
@pytest.mark.parametrize("method", TRANSITION_METHODS)
def test_each_switch_is_a_reallocation_to_the_block_it_gathers_with_table_2s_bytes(name, method):
    """Each method's switch, planned as a reallocation from the training layout to the block each
    rank holds at its peak, moves Table 2's bytes; deepspeed_chat's exactly the ZeRO-3 share less
    (its all-gather refetches (d-1)/d of each rank's own piece from its data-parallel twins)."""
    mesh = Mesh(**HYBRID[name], transition=method)
    params, n = _uniform_model(mesh.pp)
    src, dst = (_staged(p, n) for p in switch_placements(mesh))
    model_bytes = sum(q.numel * q.itemsize for q in params)
    table = layouts.transition_bytes(mesh, model_bytes)
    for r in range(mesh.world_size):  # the destination holds what layouts says the rank gathers
        block = layouts.gathered_shard(mesh, r)
        assert block.contains(layouts.gen_shard(mesh, r))  # the generation piece is a view inside it
        for q in params:
            width = q.shape[q.dim] // mesh.tp
            inside = block.pp[0] <= src.stages[q.layer] < block.pp[1]
            assert _holds(dst, r, q, n) == ((block.tp[0] * width, block.tp[1] * width) if inside else False)
        assert shard_bytes(dst, r, params, n) == table[r].peak_params
    counted = plan(params, src, dst).bytes_per_rank()
    assert counted == rank_bytes(params, src, dst)  # the planner's count of the same plan
    d = mesh.dp if method == "deepspeed_chat" else 1
    twins = model_bytes * (d - 1) // (d * mesh.pp * mesh.tp)
    assert [tuple(counted[r]) for r in range(mesh.world_size)] == [(t.sent - twins, t.received - twins) for t in table]


@pytest.mark.parametrize("name", HYBRID)
@pytest.mark.parametrize("method", [m for m in TRANSITION_METHODS if m != "hybridflow"])
def test_the_other_switches_move_more_than_a_reallocation_to_their_generation_layout(name, method):
    """vanilla and deepspeed_chat rebuild the whole model on every rank (Table 2's peak M), where a
    reallocation delivers each rank its generation shard only: never more bytes, fewer as soon as
    the generation layout keeps any model parallelism."""
    mesh = Mesh(**HYBRID[name], transition=method)
    params, n = _uniform_model(mesh.pp)
    src, dst = (_staged(p, n) for p in hybrid_engine_placements(mesh))
    counted = plan(params, src, dst).bytes_per_rank()
    table = layouts.transition_bytes(mesh, sum(q.numel * q.itemsize for q in params))
    for r, t in enumerate(table):
        assert counted[r].received <= t.received
    if dst.mesh.model_parallel > 1:
        assert sum(b.received for b in counted.values()) < sum(t.received for t in table)


# ---- the Llama description and the planner --------------------------------------------------------
def test_llama_shapes_and_cuts_match_the_model_and_the_tensor_parallel_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import LlamaConfig, LlamaForCausalLM

    from workbench.engines.tensor_parallel import llama_tp_plan

    hidden, layers, heads, kv, inter, vocab = SHAPE
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    assert {n: tuple(t.shape) for n, t in model.named_parameters()} == llama_shapes(*SHAPE)
    assert ModelSpec.from_hf_config(config).param_count == sum(q.numel for q in PARAMS)
    styles = llama_tp_plan(model)
    for name, t in model.named_parameters():
        module = name.removesuffix(".weight")
        style = styles.get(module)
        if style is None:
            expected = None
        elif isinstance(style, ColwiseParallel):
            expected = 1 if isinstance(model.get_submodule(module), torch.nn.Embedding) else 0
        else:
            assert isinstance(style, RowwiseParallel)
            expected = 1
        assert llama_split(name, t.dim()) == expected, name


def test_realloc_time_charges_the_busiest_rank_of_the_plan():
    cluster = cluster_preset("local", 8)
    sim = Simulator(cluster, Workload())
    src, dst = Mesh(1, 2, 1), Mesh(2, 1, 1)
    per_rank = realloc_bytes(SPEC, src, 0, dst, 0, sim.dtype_bytes)
    busiest = max(max(b) for b in per_rank.values())
    latency = (SPEC.n_layers + 2) * cluster.collective_latency
    assert sim.realloc_time(SPEC, src, (0, 2), dst, (0, 2)) == pytest.approx(
        busiest / sim.link_bandwidth(False) + latency
    )
    # 1-1-2 -> 1-2-1 on the same devices: every device already holds its new shard
    assert sim.realloc_time(SPEC, Mesh(1, 1, 2), (0, 2), Mesh(1, 2, 1), (0, 2)) == 0.0


def test_bad_input_is_refused_with_what_to_change():
    with pytest.raises(ValueError, match="split dim 2 outside"):
        Param("w", (4, 4), 2, 0)
    with pytest.raises(ValueError, match="distinct group ranks"):
        Placement(Mesh(1, 2, 1), ranks=(0, 0))
    with pytest.raises(ValueError, match="does not split into 3 equal pieces"):
        plan([Param("w", (4, 4), 0, 0)], Placement(Mesh(1, 1, 1)), Placement(Mesh(1, 3, 1)))
    with pytest.raises(ValueError, match="do not fill pp=4"):
        plan(PARAMS[:1] + [Param("h", (4,), None, 3)], Placement(Mesh(1, 1, 1)), Placement(Mesh(4, 1, 1)))
    with pytest.raises(ValueError, match="3 stages given for a model of 6"):
        plan(PARAMS, Placement(Mesh(2, 1, 1), stages=(0, 1, 1)), Placement(Mesh(1, 1, 1)))
    with pytest.raises(ValueError, match="must be unique"):
        plan([Param("w", (4,), None, 0)] * 2, Placement(Mesh()), Placement(Mesh()))
