"""The planner's layouts are the runtime's Mesh."""

from workbench import Mesh
from workbench.planner import model_preset
from workbench.planner.strategy import generation_strategies, is_generation_layout, strategies


def test_strategies_are_meshes_and_sort_as_before():
    layouts = strategies(model_preset("llama2-7b"), 16, 8)
    assert all(type(s) is Mesh and s.world_size == 16 for s in layouts)
    assert sorted(layouts) == sorted(layouts, key=lambda s: (s.pp, s.tp, s.dp))
    gens = generation_strategies(Mesh(2, 4, 2))
    assert Mesh(1, 2, 8) in gens and all(is_generation_layout(Mesh(2, 4, 2), g) for g in gens)
    assert not is_generation_layout(Mesh(1, 2, 4), Mesh(1, 4, 2))
