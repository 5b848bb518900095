"""The training vs generation shard map (HybridFlow Figure 8) drawn from workbench.layouts."""

import pytest

from widgets.shard_map import cell_kinds, draw_shard_map
from workbench import Mesh

METHODS = ("deepspeed_chat", "vanilla", "hybridflow")


def test_hybridflow_generates_around_each_training_shard_with_nothing_kept():
    mesh = Mesh(tp=4, dp=2, gen_tp=2, transition="hybridflow")
    kinds = cell_kinds(mesh)
    assert len(kinds) == 8 and all(len(row) == 4 for row in kinds)
    for rank, row in enumerate(kinds):
        assert row.count("train") == 1 and row[mesh.coord(rank).tp] == "train"
        assert row.count("generate") == 1 and "kept" not in row and "gathered" not in row
    # micro-DP pairs (0, 1), (2, 3) share a generation shard: pieces {0, 1} and {2, 3}
    assert [i for i, k in enumerate(kinds[1]) if k] == [0, 1]
    assert [i for i, k in enumerate(kinds[2]) if k] == [2, 3]


@pytest.mark.parametrize("method", ["vanilla", "deepspeed_chat"])
def test_whole_model_methods_gather_everything_and_keep_the_training_shard(method):
    kinds = cell_kinds(Mesh(tp=4, dp=1, gen_tp=2, transition=method))
    for row in kinds:
        assert "" not in row and row.count("kept") == 1
    # consecutive generation TP pairs (0, 1), (2, 3): rank 1 generates with pieces 2, 3, which
    # do not hold its training piece 1 (HybridFlow-V's redundancy)
    assert kinds[0] == ["kept", "generate", "gathered", "gathered"]
    assert kinds[1] == ["gathered", "kept", "generate", "generate"]


def test_vanilla_without_a_layout_change_keeps_nothing():
    kinds = cell_kinds(Mesh(tp=2, dp=2, transition="vanilla"))
    assert kinds == [["train", ""], ["", "train"]] * 2


def test_figure_has_a_row_per_mesh_and_a_cell_per_rank_and_shard():
    meshes = {m: Mesh(tp=4, dp=1, gen_tp=2, transition=m) for m in METHODS}
    fig = draw_shard_map(meshes)
    axes = fig.get_axes()
    assert len(axes) == 3
    for ax, method in zip(axes, METHODS):
        assert ax.get_title(loc="left").startswith(f"{method}: train 1-4-1 -> generate 1-2-2-1")
        assert len(ax.patches) == 4 * 4 + 4  # 4 ranks x 4 shards, and a gather-group strip per rank
    assert len(draw_shard_map(meshes["hybridflow"]).get_axes()) == 1


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="Mesh"):
        draw_shard_map([Mesh(tp=2)])


def test_pipeline_stages_are_cells_too():
    # 1-2-2 pipeline x tensor -> 1-2 generation: each rank gathers its tensor piece of both stages
    kinds = cell_kinds(Mesh(pp=2, tp=2, gen_pp=1, gen_tp=2, transition="hybridflow"))
    assert kinds[0] == ["train", "", "generate", ""]  # cells are (stage, piece) stage-major
    assert kinds[3] == ["", "generate", "", "train"]
