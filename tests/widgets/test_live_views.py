"""The live views on a real run (tests/widgets/conftest.py): a tiny GRPO on real worker groups,
two iterations through `fit(callbacks=...)`, watched by the dashboard, the timeline and a
run recorder."""

import json

import pytest

from widgets import BatchInspector, ClusterView, LiveTimeline, MetricsDashboard
from widgets.app import RunFiles
from widgets.inspector import shade
from widgets.mismatch import MismatchView
from widgets.recorder import load_batch
from workbench.tracing import load_records


def test_dashboard_follows_fit(run):
    data = run["dashboard"].data()
    history = run["history"]
    assert data["score"]["critic/score/mean"] == ([1.0, 2.0], [m["critic/score/mean"] for m in history])
    assert data["losses"]["actor/pg_loss"][1] == [m["actor/pg_loss"] for m in history]
    assert {"timing_s/gen", "timing_s/step"} <= set(data["step times (s)"])
    assert "iteration 2" in run["dashboard"].summary()
    run["dashboard"].png()


def test_timeline_shows_every_span_of_the_run_tagged_with_its_step(run):
    timeline = run["timeline"]
    assert len(timeline.refresh_seconds) >= 3  # built, then refreshed after each iteration of fit
    assert len(timeline.refresher.wall_seconds) >= 2  # those refreshes ran on the view's thread
    timeline.refresh()  # (the browser test may have run another iteration since)
    trace = [r for r in run["session"].trace() if r.role == "actor" and r.start >= run["since"]]
    data = timeline.data()
    shown = {(data["lanes"][b["lane"]], b["method"], b["call"]) for b in data["bars"]}
    assert {(f"{r.pool} rank {r.rank}", r.method, r.extra.get("call")) for r in trace} <= shown
    steps = {(b["method"], b["step"]) for b in data["bars"] if b["kind"] == "call"}
    assert {("generate_sequences", "gen"), ("compute_ref_log_prob", "ref"), ("update_actor", "update_actor")} <= steps
    assert [i for i, _ in data["iterations"]] == list(range(1, run["grpo"].iteration + 1))
    for iteration, start in data["iterations"]:  # each mark at its iteration's first span
        assert start == min(b["start"] for b in data["bars"] if b["iteration"] == iteration) >= 0
    assert any(b["kind"] == "transition" for b in data["bars"])  # the hybrid engine's weight sync
    timeline.png()


def test_timeline_beside_the_planner_estimate(run):
    from widgets import Scenario, estimate

    plan = estimate(Scenario(algorithm="GRPO", machines=1, devices_per_machine=2, placement="colocate")).plan
    data = LiveTimeline(run["session"], estimate=plan).data()
    assert data["estimate_lanes"] == ["actor+reference+reward"] and data["estimate"]


def test_inspector_colours_follow_the_batch_values(run):
    batch = run["batch"]
    inspector = BatchInspector(batch, run["tokenizer"], field="log-prob", sort="none")
    values = batch["old_log_probs"]
    mask = batch["response_mask"].bool()
    scale = float(values[mask].abs().max())
    tokens = inspector.tokens(0)
    assert [t["value"] for t in tokens] == pytest.approx(values[0][mask[0]].tolist())
    assert [t["colour"] for t in tokens] == [shade(v, scale) for v in values[0][mask[0]].tolist()]
    assert all(t["colour"].endswith("ff") for t in tokens if t["value"] < 0)  # below zero: blue
    inspector.set(field="advantage", sort="advantage (high first)")
    advantages = [r["advantage"] for r in inspector.rows()]
    assert advantages == sorted(advantages, reverse=True)
    top = max(set(float(x) for x in batch["scores"]))
    inspector.set(min_score=top)
    assert inspector.rows() and all(r["score"] >= top for r in inspector.rows())
    assert "<table>" in inspector.summary()
    with pytest.raises(ValueError, match="field 'value' is not in this batch"):
        BatchInspector(batch, field="value")


def test_cluster_view_lists_every_worker(run):
    data = ClusterView(run["session"]).data()
    actors = [w for w in data["workers"] if "actor" in w["roles"]]
    assert sorted(w["rank"] for w in actors) == [0, 1]
    assert all(w["layout"] == "pp1 tp1 dp2" and w["memory_mib"] > 0 and w["pid"] for w in actors)
    [pool] = [p for p in data["pools"] if p["pool"] == "actor_pool"]
    assert pool == {
        "pool": "actor_pool",
        "devices_per_node": [2],
        "resource": "CPU",
        "slice_of": None,
        "devices": [0, 1],
    }
    assert data["nodes"] and "actor_pool" in ClusterView(run["session"]).summary()


def test_recorder_writes_metrics_and_every_span(run):
    recorder = run["recorder"]
    lines = [json.loads(text) for text in recorder.metrics_path.read_text().splitlines()]
    assert len(lines) >= 2 and [line["iteration"] for line in lines] == [float(i) for i in range(1, len(lines) + 1)]
    saved = load_records(recorder.trace_path)
    trace = run["session"].trace()
    assert len(saved) == len({(r.extra.get("call"), r.rank, r.method, r.start) for r in saved})
    actor_saved = {(r.extra.get("call"), r.rank, r.method) for r in saved if r.role == "actor"}
    # spans up to the last iteration's end were all written
    last = max(r.end for r in saved)
    ours = [r for r in trace if r.role == "actor" and r.start >= run["since"] and r.end <= last]
    assert {(r.extra.get("call"), r.rank, r.method) for r in ours} <= actor_saved
    assert MetricsDashboard.from_jsonl(recorder.metrics_path).data()["score"]["critic/score/mean"][1] == [
        line["critic/score/mean"] for line in lines
    ]


def test_recorder_keeps_the_last_batches_for_the_app(run):
    recorder, grpo = run["recorder"], run["grpo"]
    if grpo.iteration < 3:  # (the browser test runs a third one; alone, this test does)
        grpo.fit([run["prompts"]], iterations=3 - grpo.iteration, log=None, callbacks=[recorder])
    saved = sorted((recorder.run_dir / "batches").glob("*.pt"), key=lambda p: p.stat().st_mtime_ns)
    assert len(saved) == 2  # keep_batches: the last two iterations
    batch = load_batch(saved[-1])
    assert sorted(batch.keys()) == sorted(run["batch"].keys()) and len(batch) == len(run["batch"])
    files = RunFiles(recorder.run_dir)
    newest = files.lookup(grpo.run_name, grpo.iteration)
    assert newest["batch"] is not None and newest["metrics"]["iteration"] == grpo.iteration
    oldest = files.lookup(grpo.run_name, 1)  # its batch is gone, its metrics stay
    assert oldest["batch"] is None and oldest["metrics"]["iteration"] == 1


def test_spans_carry_rows_and_bytes(run):
    timeline = run["timeline"]
    generate = [r for r in timeline.records if r.method == "generate_sequences"]
    assert generate and all(r.extra["rows"] > 0 and r.extra["rows_out"] == 2 * r.extra["rows"] for r in generate)
    assert all(r.bytes_in > 0 for r in generate)


def test_a_callback_returning_false_stops_fit(run):
    grpo = run["grpo"]
    calls = []
    history = grpo.fit([run["prompts"]], iterations=5, log=None, callbacks=[lambda a, b, m: calls.append(m) or False])
    assert len(history) == 1 and len(calls) == 1
    with pytest.raises(TypeError, match="callbacks must be callables"):
        grpo.fit([run["prompts"]], iterations=1, callbacks=["print"])


def test_fit_in_the_background_leaves_the_driver_free(run):
    grpo, session = run["grpo"], run["session"]
    before = grpo.iteration
    background = grpo.fit_background([run["prompts"]], iterations=2, callbacks=[run["dashboard"]])
    spans = session.trace()  # the driver is free: it reads the trace while the run goes on
    assert isinstance(spans, list)
    history = background.wait(timeout=600)
    assert len(history) == 2 and grpo.iteration == before + 2 and background.done
    assert run["dashboard"].history[-1] == history[-1]
    stopped = grpo.fit_background([run["prompts"]], iterations=5)
    stopped.stop()
    assert len(stopped.wait(timeout=600)) == 1


def test_the_mismatch_view_measures_the_runs_batch_as_the_metric_does(run):
    """The rollout's log-probs against the trainer's on the run's last batch: their mean is the
    iteration's actor/rollout_logprob_diff, bit for bit; the inspector colours the same gap."""
    batch, metrics = run["batch"], run["history"][-1]
    view = MismatchView(run["tokenizer"])
    view(run["grpo"], batch, metrics)
    [row] = view.data()["per_iteration"]
    assert row["iteration"] == metrics["iteration"] and row["mean"] == metrics["actor/rollout_logprob_diff"]
    assert row["median"] <= row["90%"] <= row["99%"] <= row["largest"]
    worst = view.data()["worst"]
    assert [abs(w["diff"]) for w in worst] == sorted((abs(w["diff"]) for w in worst), reverse=True)
    mask = batch["response_mask"].bool()
    gap = batch["rollout_log_probs"] - batch["old_log_probs"]
    assert abs(worst[0]["diff"]) == pytest.approx(float(gap[mask].abs().max()))
    inspector = BatchInspector(batch, run["tokenizer"], field="mismatch (rollout - trainer)", sort="none")
    assert [t["value"] for t in inspector.tokens(0)] == pytest.approx(gap[0][mask[0]].tolist())
    assert view.png().startswith(b"\x89PNG")
