"""PlacementExplorer's logic, without a browser: controls change the figure's data."""

import pytest

from widgets import PlacementExplorer, Scenario, estimate
from widgets.planning import placement_sets


def test_a_slider_change_changes_the_figure_data():
    explorer = PlacementExplorer()
    before = explorer.data()
    assert before["error"] is None and before["bars"] and before["iteration_s"] > 0
    explorer.set(max_new_tokens=128)  # longer responses: more decoding, a longer iteration
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
        batch_size=256,
        prompt_len=512,
        max_new_tokens=512,
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
        batch_size=64,
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
    assert explorer.scenario.max_new_tokens == 128 and text.value != before
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
    explorer.set(max_new_tokens=256)
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


ASYNC = dict(
    device="H100",
    devices_per_machine=8,
    algorithm="GRPO",
    actor="llama2-7b",
    critic="llama2-7b",
    reward="llama2-7b",
    batch_size=64,
    n=4,
    prompt_len=512,
)


def test_an_async_split_shows_both_estimates_and_whether_it_beats_colocation():
    verdicts = {}
    for max_new_tokens in (128, 1024, 4096):
        explorer = PlacementExplorer(placement="async split", max_staleness=1, max_new_tokens=max_new_tokens, **ASYNC)
        a = explorer.data()["asynchronous"]
        assert a["asynchronous_s"] == pytest.approx(max(a["generation_s"], a["trainer_s"]) + a["push_s"])
        assert a["synchronous_s"] == pytest.approx(a["generation_s"] + a["trainer_s"] + a["push_s"])
        assert a["beats_colocation"] == (a["asynchronous_s"] < a["colocated_s"])
        colocated = PlacementExplorer(placement="colocate", max_new_tokens=max_new_tokens, **ASYNC).data()
        assert a["colocated_s"] == pytest.approx(colocated["iteration_s"])
        summary = explorer.summary()
        assert f"synchronous <b>{a['synchronous_s']:.3g} s</b>" in summary
        assert f"asynchronous (max staleness 1) <b>{a['asynchronous_s']:.3g} s</b>" in summary
        assert ("<b>beats colocation</b>" in summary) == a["beats_colocation"]
        assert ("<b>does not beat colocation</b>" in summary) != a["beats_colocation"]
        verdicts[max_new_tokens] = a["beats_colocation"]
    assert verdicts == {128: False, 1024: True, 4096: False}  # the overlap wins in between


def test_the_staleness_slider_runs_the_split_synchronously_at_zero():
    explorer = PlacementExplorer(placement="async split", max_staleness=0, max_new_tokens=1024, **ASYNC)
    slider = next(c for c in explorer.controls() if c.name == "max_staleness")
    assert slider.visible and slider.kind == "int" and slider.help
    sync = explorer.data()
    assert sync["iteration_s"] == pytest.approx(sync["asynchronous"]["synchronous_s"])
    assert sync["asynchronous"]["max_staleness"] == 1  # the asynchronous estimate is shown beside it
    lanes = {b["lane"] for b in sync["bars"] if b["role"] == "push"}
    assert len(lanes) == 2  # the push holds the actor's lane and the rollout's
    gen = next(b for b in sync["bars"] if b["call"] == "gen")
    train = [b for b in sync["bars"] if b["role"] not in ("rollout", "push")]
    assert min(b["start"] for b in train) == pytest.approx(gen["end"])  # one after another
    explorer.set(max_staleness=1)
    overlapped = explorer.data()
    assert overlapped["iteration_s"] == pytest.approx(overlapped["asynchronous"]["asynchronous_s"])
    assert overlapped["iteration_s"] < sync["iteration_s"]
    train = [b for b in overlapped["bars"] if b["role"] not in ("rollout", "push")]
    assert min(b["start"] for b in train) == 0.0  # beside the next batch's generation
    assert max(b["end"] for b in overlapped["bars"]) == pytest.approx(overlapped["iteration_s"])
    explorer.set(placement="colocate")
    assert not next(c for c in explorer.controls() if c.name == "max_staleness").visible
    assert explorer.data()["asynchronous"] is None and "colocation" not in explorer.summary()
    with pytest.raises(ValueError, match="max_staleness=-1"):
        explorer.set(max_staleness=-1)


def test_auto_weighs_async_split_plans_only_with_a_staleness():
    explorer = PlacementExplorer(placement="auto", max_new_tokens=1024, **ASYNC)
    assert explorer.data()["asynchronous"] is None  # synchronous plans only, as before
    synchronous = explorer.data()["iteration_s"]
    explorer.set(max_staleness=1)
    d = explorer.data()
    assert d["asynchronous"] is not None and d["iteration_s"] < synchronous
    assert "rollout" in d["layouts"]


def test_the_live_figure_and_the_picture_draw_an_async_split():
    explorer = PlacementExplorer(placement="async split", max_staleness=1, max_new_tokens=1024, **ASYNC)
    layout, update = explorer.figure()
    explorer._listeners.append(update)
    bars = layout.select_one({"name": "explorer_bars"})
    assert "push weights" in bars.data["call"] and "push" in bars.data["role"]
    explorer.set(max_staleness=0)
    assert max(bars.data["end"]) == pytest.approx(explorer.data()["iteration_s"])
    assert explorer.png()


def test_the_notebook_form_shows_the_staleness_slider_where_it_applies():
    explorer = PlacementExplorer(placement="colocate", max_new_tokens=1024, **ASYNC)
    box = explorer.widget()
    controls = {getattr(c, "description", ""): c for c in box.children[0].children}
    slider, placement, text = controls["max staleness"], controls["placement"], box.children[1]
    assert slider.layout.display == "none"
    placement.value = "async split"
    assert slider.layout.display is None and "colocation" in text.value
    slider.value = 1
    assert explorer.scenario.max_staleness == 1 and "asynchronous (max staleness 1)" in text.value
