"""PlacementExplorer's logic, without a browser: controls change the figure's data."""

import pytest

from widgets import PlacementExplorer, Scenario, estimate
from widgets.planning import placement_sets


def test_a_slider_change_changes_the_figure_data():
    explorer = PlacementExplorer()
    before = explorer.data()
    assert before["error"] is None and before["bars"] and before["iteration_s"] > 0
    explorer.set(response_len=128)  # longer responses: more decoding, a longer iteration
    after = explorer.data()
    assert after["iteration_s"] > before["iteration_s"]
    assert [b["end"] for b in after["bars"]] != [b["end"] for b in before["bars"]]
    assert "estimated iteration" in explorer.summary()


@pytest.mark.parametrize("placement, lanes", [("colocate", 1), ("split", 2), ("standalone", 4)])
def test_named_placements_give_their_lanes(placement, lanes):
    data = PlacementExplorer(placement=placement).data()
    assert len(data["lanes"]) == lanes
    assert {b["role"] for b in data["bars"]} == {"actor", "reference", "critic", "reward"}
    assert all(m["used_gib"] <= m["capacity_gib"] for m in data["memory"])


def test_custom_placement_follows_the_set_numbers():
    explorer = PlacementExplorer(placement="custom", custom={"critic": 1, "reward": 1})
    assert sorted(m["set"] for m in explorer.data()["memory"]) == ["actor+reference", "critic+reward"]
    explorer.set(set_reward=2)
    assert sorted(m["set"] for m in explorer.data()["memory"]) == ["actor+reference", "critic", "reward"]


def test_every_algorithm_and_device_type_plans():
    for algorithm in ("PPO", "GRPO", "ReMax", "Safe-RLHF"):
        assert estimate(Scenario(algorithm=algorithm)).plan is not None
    big = dict(
        actor="llama2-7b",
        critic="llama2-7b",
        reward="llama2-7b",
        global_batch=256,
        prompt_len=512,
        response_len=512,
        machines=2,
        devices_per_machine=8,
    )
    for device in ("A100 80GB", "H100", "H200"):
        data = PlacementExplorer(device=device, placement="split", **big).data()
        assert data["error"] is None and data["throughput"] > 0
        assert data["layouts"]["actor"]["generate"] is not None  # the hybrid engine's generation layout


def test_an_infeasible_placement_says_which_model_and_by_how_much():
    explorer = PlacementExplorer(
        device="A100 80GB",
        machines=1,
        devices_per_machine=1,
        actor="llama2-70b",
        critic="llama2-70b",
        reward="llama2-70b",
        global_batch=64,
    )
    data = explorer.data()
    assert data["bars"] == []
    assert "actor does not fit" in data["error"] and "short by" in data["error"]
    assert "does not fit" in explorer.summary()
    explorer.png()  # the figure says so too, without raising


def test_placement_sets():
    models = ("actor", "reference", "critic", "reward")
    assert placement_sets(Scenario(placement="split"), models) == (("actor", "reference"), ("critic", "reward"))
    assert placement_sets(Scenario(placement="colocate"), models) == (models,)
    with pytest.raises(ValueError, match="placement 'sideways'"):
        placement_sets(Scenario(placement="sideways"), models)


def test_widget_and_panel_forms_follow_the_view():
    explorer = PlacementExplorer()
    box = explorer.widget()
    slider = next(c for c in box.children[0].children if getattr(c, "description", "") == "response tokens")
    text = box.children[1]
    before = text.value
    slider.value = 128
    assert explorer.scenario.response_len == 128 and text.value != before
    layout = explorer.panel()
    assert layout is not None
