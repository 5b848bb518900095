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


def test_every_control_says_what_it_does_and_custom_groups_show_only_for_custom():
    explorer = PlacementExplorer(algorithm="GRPO")
    assert all(c.help for c in explorer.controls())
    assert not [c for c in explorer.controls() if c.name.startswith("set_") and c.visible]
    explorer.set(placement="custom", set_reward=1)
    shown = {c.name for c in explorer.controls() if c.visible and c.name.startswith("set_")}
    assert shown == {"set_actor", "set_reference", "set_reward"}  # GRPO's models, no critic
    assert sorted(m["set"] for m in explorer.data()["memory"]) == ["actor+reference", "reward"]


def test_the_figure_data_follows_a_slider_and_compares_two_placements():
    explorer = PlacementExplorer(compare="standalone")
    layout, update = explorer.figure()
    explorer._listeners.append(update)
    bars = layout.select_one({"name": "explorer_bars"})
    before = list(bars.data["end"])
    explorer.set(response_len=256)
    assert bars.data["end"] != before and max(bars.data["end"]) == pytest.approx(explorer.data()["iteration_s"])
    other = layout.select_one({"name": "explorer_compare_bars"})
    assert len(set(other.data["lane"])) == 4  # standalone: a lane per model
    assert "compared with the standalone placement" in explorer.summary()
    # the hover's breakdown: compute + switch to the generation layout = the call's time
    for seconds, compute, switch in zip(bars.data["seconds"], bars.data["compute"], bars.data["reshard"]):
        assert compute + switch == pytest.approx(seconds)


def test_memory_is_readable_for_a_tiny_model_on_a_big_device():
    explorer = PlacementExplorer(device="H100")  # tiny-1m models: a sliver of 80 GiB
    layout, _ = explorer.figure()
    memory = layout.select_one({"name": "explorer_memory"})
    plot = layout.select_one({"name": "explorer_memory_plot"})
    used, capacity = memory.data["used"][0], memory.data["capacity"][0]
    assert used / capacity < 1e-3
    assert plot.x_scale.__class__.__name__ == "LogScale" and plot.x_range.start < used < capacity < plot.x_range.end
    assert memory.data["share"][0].endswith("%") and memory.data["share"][0] != "0%"


def test_bad_settings_are_named():
    explorer = PlacementExplorer()
    with pytest.raises(ValueError, match="unknown settings \\['gpus'\\]"):
        explorer.set(gpus=4)
    with pytest.raises(ValueError, match="PlacementExplorer.device='TPU'"):
        explorer.set(device="TPU")
    with pytest.raises(ValueError, match="PlacementExplorer.compare='best'"):
        PlacementExplorer(compare="best")
    with pytest.raises(ValueError, match="PlacementExplorer.machines=0"):
        PlacementExplorer(machines=0)
