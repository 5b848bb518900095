"""Parameter reallocation on real processes: six gloo ranks (torch.multiprocessing) move a
Llama-shaped model between layouts — pp, tp and dp changes on one rank set, into another pool's
ranks (a separate group built from a store, as between two pools' worlds) and onto overlapping
ranks — and every weight arrives bit-identical to slicing the whole model for the destination,
with the bytes each rank counted equal to the planner's formula (`planner.realloc_bytes`)."""

import json
import os
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.hybrid.test_realloc import PAIRS, SHAPE, SPEC
from workbench import Mesh
from workbench.hybrid.channel import ChannelAddress, open_group
from workbench.hybrid.reallocate import Reallocator, piece_of
from workbench.planner import realloc_bytes
from workbench.transfers import Param, Placement, llama_params, llama_shapes, plan

WORLD = 6
DEVICE = os.environ.get("WORKBENCH_TEST_DEVICE", "cpu")
"""Where the pieces live: "cuda" on a GPU machine (bench/gpu_run.sh runs this file so), where
every rank shares one GPU and gloo moves the pieces through host memory."""
RUNS = [(name, "float32", False) for name in PAIRS] + [
    ("2-2-1 -> 1-2-2", "bfloat16", False),
    ("1-2-1 -> 2-1-1 other pool", "bfloat16", False),
    ("2-2-1 -> 1-2-2", "float32", True),  # kept pieces become views of the source
    ("1-1-2 -> 1-2-2 other pool", "float32", "by unit"),  # the source given one layer unit at a time
    # messages staged in host memory, as gloo needs for CUDA pieces (forced here on CPU pieces)
    ("2-2-1 -> 1-2-2", "float32", "through host"),
    ("1-2-1 -> 2-1-1 other pool", "bfloat16", "through host"),
]


def _model(dtype: str) -> tuple[list[Param], dict[str, torch.Tensor]]:
    params = llama_params(llama_shapes(*SHAPE), SHAPE[1], dtype)
    gen = torch.Generator().manual_seed(11)
    full = {q.name: torch.randn(q.shape, generator=gen).to(getattr(torch, dtype)) for q in params}
    return params, full


def _worker(rank: int, store_dir: str, out_dir: str, device: str = "cpu") -> None:
    """Every run of RUNS on this rank, its results to out_dir/rank{rank}.json. `device`: where
    the pieces live (bench/gpu_check_realhf.py runs it with "cuda": gloo through host memory)."""
    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.path.join(store_dir, "world"), WORLD),
        rank=rank,
        world_size=WORLD,
        timeout=timeout,
    )
    # A second group over the same ranks, built from a store like a weight channel between two
    # pools' worlds: the reallocations into another pool's ranks run over it.
    pools, _ = open_group(ChannelAddress("file", os.path.join(store_dir, "pools"), WORLD), rank, "cpu", timeout)
    results = {}
    for name, dtype, alias in RUNS:
        m1, f1, m2, f2 = PAIRS[name]
        params, full = _model(dtype)
        src, dst = Placement(m1, f1), Placement(m2, f2)
        p = plan(params, src, dst)
        units = len(p.layers)
        source = {
            q.name: t.to(device) for q in params if (t := piece_of(full[q.name], q, src, rank, units)) is not None
        }
        group = pools if "pool" in name else None
        dist.barrier()
        asked: list[list[str]] = []
        reallocator = Reallocator(p, group=group, device=device)
        reallocator.through_host |= alias == "through host"
        if alias == "by unit":  # as a sharded source gathers it: each unit's pieces, then dropped

            def by_unit(names, source=source, asked=asked):
                asked.append(names)
                return {n: source[n] for n in names if n in source}

            got, stats = reallocator.run(by_unit)
        else:
            got, stats = reallocator.run(source, alias=alias is True)
        wrong = []
        for q in params:
            want = piece_of(full[q.name], q, dst, rank, units)
            if (want is None) != (q.name not in got) or (want is not None and not torch.equal(got[q.name].cpu(), want)):
                wrong.append(q.name)
        ptrs = {t.untyped_storage().data_ptr() for t in source.values()}
        views = sum(t.untyped_storage().data_ptr() in ptrs for t in got.values())
        asked_units = [sorted({q.layer for q in params if q.name in names}) for names in asked]
        results[f"{name} {dtype} {alias}"] = {
            **stats.as_dict(),
            "wrong": wrong,
            "views": views,
            "asked": asked_units,
            "staged": reallocator.through_host,
        }
    # bad input: a source piece of the wrong shape is refused with the weight and rank named
    params, full = _model("float32")
    alone = plan(params, Placement(Mesh(), ranks=(rank,)), Placement(Mesh(), ranks=(rank,)))
    try:
        Reallocator(alone).run({q.name: full[q.name][:1] for q in params})
        results["error"] = None
    except ValueError as e:
        results["error"] = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    store, out = tmp_path_factory.mktemp("store"), tmp_path_factory.mktemp("out")
    mp.spawn(_worker, args=(str(store), str(out), DEVICE), nprocs=WORLD, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,dtype,alias", RUNS)
def test_reallocated_weights_are_bit_identical_and_bytes_equal_the_planners(counted, name, dtype, alias):
    m1, f1, m2, f2 = PAIRS[name]
    itemsize = 2 if dtype == "bfloat16" else 4
    formula = realloc_bytes(SPEC, m1, f1, m2, f2, dtype_bytes=itemsize)
    ranks = sorted(formula)
    key = f"{name} {dtype} {alias}"
    # with alias, the pieces a rank keeps whole are views of its source pieces; never otherwise
    assert (sum(counted[r][key]["views"] for r in range(WORLD)) > 0) == (alias is True)
    if alias == "by unit":  # every source rank asked for every unit once, in order; no other rank asked
        sources = range(f1, f1 + m1.world_size)
        units = [[u] for u in range(SHAPE[1] + 2)]
        assert all(counted[r][key]["asked"] == (units if r in sources else []) for r in range(WORLD))
    # staged in host memory where asked (here) or where gloo meets CUDA pieces (on a GPU)
    assert all(counted[r][key]["staged"] == (alias == "through host" or DEVICE == "cuda") for r in range(WORLD))
    for r in range(WORLD):
        row = counted[r][key]
        assert row["wrong"] == [], (r, row["wrong"])
        want = formula.get(r, (0, 0))
        assert (row["bytes_sent"], row["bytes_received"]) == tuple(want), (r, row, want)
        if r not in ranks:
            assert row["layers"] == 0  # ranks outside the reallocation take no part
    # the destination ranks took part one layer unit at a time
    dst_ranks = range(f2, f2 + m2.world_size)
    assert all(counted[r][key]["layers"] > 0 for r in dst_ranks)
    moved = sum(counted[r][key]["bytes_received"] for r in range(WORLD))
    assert moved == sum(b.received for b in formula.values())


def test_a_wrong_source_piece_is_refused_naming_weight_and_rank(counted):
    for r in range(WORLD):
        error = counted[r]["error"]
        assert re.search(
            r"rank \d+: source\['[\w.]+'\] is a tensor of shape \(1, \d+\); .* of shape \(\d+, \d+\)", error
        )
        assert f"rank {r}:" in error
