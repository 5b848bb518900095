"""The live timeline on a multi-turn iteration: each turn's generation and its tool calls are
drawn inside the rollout's call, apart from each other (their own kind and colour) and from the
training call, in the static picture and in the interactive figure alike."""

from widgets.timeline import INNER_SPANS, LiveTimeline
from widgets.ui import role_colour
from workbench.tracing import CallRecord


def span(method: str, start: float, end: float, call_id: int = -1, **extra) -> CallRecord:
    tags = {"iteration": 1, "step": "gen" if method != "update_actor" else "update_actor", **extra}
    return CallRecord(call_id, "actor", method, 0, "actor_pool", 1, start, start, end, 0, 0, True, tags)


def records() -> list[CallRecord]:
    return [
        span("generate_episodes", 0.0, 1.0, call_id=1),
        span("episode.generate", 0.05, 0.4, turn=0),
        span("episode.tools", 0.4, 0.5, turn=0, tool_calls=4, tool_errors=1),
        span("episode.generate", 0.5, 0.8, turn=1),
        span("episode.tools", 0.8, 0.81, turn=1, tool_calls=0, tool_errors=0),
        span("hybrid.release", 0.95, 1.0),
        span("update_actor", 1.1, 1.6, call_id=2),
    ]


def test_generation_tool_and_training_spans_are_drawn_apart():
    timeline = LiveTimeline(records(), last_iterations=None)
    kinds = [(b["method"], b["kind"]) for b in timeline.data()["bars"]]
    assert kinds == [
        ("generate_episodes", "call"),
        ("episode.generate", "generation"),
        ("episode.tools", "tool"),
        ("episode.generate", "generation"),
        ("episode.tools", "tool"),
        ("hybrid.release", "transition"),
        ("update_actor", "call"),
    ]
    colours = {row["method"]: row["colour"] for row in timeline.rows}
    generation, tool = INNER_SPANS["episode.generate"][1], INNER_SPANS["episode.tools"][1]
    assert colours == {
        "generate_episodes": role_colour("actor"),
        "episode.generate": generation,
        "episode.tools": tool,
        "hybrid.release": "black",
        "update_actor": role_colour("actor"),
    }
    assert len({generation, tool, role_colour("actor"), "black"}) == 4
    from bokeh.models import Legend

    layout, _ = timeline.figure()
    items = [item for legend in layout.select({"type": Legend}) for item in legend.items]
    labels = {getattr(item.label, "value", None) for item in items}
    assert {"policy turn (generation)", "tool calls", "hybrid-engine transition"} <= labels
    assert timeline.png()  # the static picture draws them too
