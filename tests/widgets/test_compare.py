"""widgets.compare: RunComparison overlays runs given as metrics files, fit histories or live
dashboards. The runs here are metrics rows as `fit` and the runner write them (two real
headless runs are compared in tests/run/test_runner.py); these tests cover the view itself:
alignment, smoothing as the dashboard's, the live follow, the figures and the errors."""

import json

import pytest

from widgets import MetricsDashboard, RunComparison


def history(iterations, loss, step_s, eval_every=0):
    rows = []
    for it in range(1, iterations + 1):
        row = {"iteration": float(it), "actor/pg_loss": loss(it), "critic/score/mean": 0.1 * it}
        row |= {"timing_s/gen": step_s / 2, "timing_s/step": step_s}
        if eval_every and it % eval_every == 0:
            row["eval/score"] = 0.05 * it
        rows.append(row)
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_fit_history_and_a_metrics_file_align_by_iteration_and_by_time(tmp_path):
    a = history(4, lambda it: 1.0 / it, step_s=2.0)
    b = history(3, lambda it: 2.0 / it, step_s=0.5, eval_every=3)
    compare = RunComparison({"a": a, "b": write_jsonl(tmp_path / "b.jsonl", b)})
    points = compare.aligned()
    assert [x for x, _ in points["a"]] == [1, 2, 3, 4] and [x for x, _ in points["b"]] == [1, 2, 3]
    losses = compare.data()["losses"]["actor/pg_loss"]
    assert losses == {"a": ([1, 2, 3, 4], [1.0, 0.5, 1 / 3, 0.25]), "b": ([1, 2, 3], [2.0, 1.0, 2 / 3])}
    assert compare.data()["held-out"] == {"eval/score": {"b": ([3], [0.15000000000000002])}}
    compare.set(align="time")  # no runner clock here: the sum of the step times
    losses = compare.data()["losses"]["actor/pg_loss"]
    assert losses["a"][0] == [2.0, 4.0, 6.0, 8.0] and losses["b"][0] == [0.5, 1.0, 1.5]
    assert "<b>a</b> (4 iterations, metrics)" in compare.summary() and "<b>b</b> (3 iterations" in compare.summary()


def test_smoothing_is_the_dashboards_own(tmp_path):
    rows = history(6, lambda it: (-1.0) ** it + 0.1 * it, step_s=1.0)
    compare = RunComparison({"run": rows}, smoothing=0.6)
    dashboard = MetricsDashboard(rows, smoothing=0.6)
    xs, values = compare.data()["losses"]["actor/pg_loss"]["run"]
    assert compare.smoothed(values) == pytest.approx([r["actor/pg_loss (smoothed)"] for r in dashboard.rows], rel=1e-12)


def test_a_live_dashboard_is_followed_and_the_figure_grows_a_line_per_run():
    live, done = MetricsDashboard(), history(3, lambda it: 1.0, step_s=1.0)
    compare = RunComparison({"done": done, "live": live})
    updates = []
    compare._listeners.append(lambda: updates.append(len(compare.aligned()["live"])))
    layout, update = compare.figure()
    titles = [f.title.text for f in layout.children]
    assert "losses" in titles and "step times (s)" in titles
    lines = [r for f in layout.children for r in f.renderers if type(r.glyph).__name__ == "Line"]
    assert len(lines) == 4  # score, loss, two step times: of the finished run only, so far

    for row in history(2, lambda it: 0.5, step_s=1.0):  # as `fit(callbacks=[live])` does
        live(None, None, row)
    assert updates == [1, 2]
    update()
    lines = [r for f in layout.children for r in f.renderers if type(r.glyph).__name__ == "Line"]
    assert len(lines) == 8 and {r.glyph.line_color for r in lines} == {compare.colour("done"), compare.colour("live")}
    loss = next(f for f in layout.children if f.title.text == "losses")
    sources = [r.data_source.data for r in loss.renderers if type(r.glyph).__name__ == "Line"]
    assert sorted(s["x"] for s in sources) == [[1.0, 2.0], [1.0, 2.0, 3.0]]
    compare.set(align="time")
    update()
    assert {f.xaxis[0].axis_label for f in layout.children} == {"wall-clock (s)"}
    assert compare.png().startswith(b"\x89PNG")


def test_configs_show_the_fields_that_differ():
    rows = history(2, lambda it: 1.0, step_s=1.0)
    configs = {
        "low": {"actor": {"optim": {"lr": 1e-6}, "clip": 0.2}, "seed": 0},
        "high": {"actor": {"optim": {"lr": 1e-5}, "clip": 0.2}, "seed": 0, "kl": 0.1},
    }
    compare = RunComparison({"low": rows, "high": rows}, configs=configs)
    assert compare.config_diff() == {
        "actor.optim.lr": {"low": 1e-6, "high": 1e-5},
        "kl": {"low": "(unset)", "high": 0.1},
    }
    assert "<code>actor.optim.lr</code>" in compare.summary() and "actor.clip" not in compare.summary()


def test_bad_runs_and_settings_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"run 'gone': no metrics at .*gone/metrics.jsonl"):
        RunComparison([tmp_path / "gone"])
    with pytest.raises(ValueError, match=r"run 'x': a int"):
        RunComparison({"x": 3})
    with pytest.raises(ValueError, match=r"configs: no run named \['y'\]"):
        RunComparison({"x": []}, configs={"y": {}})
    with pytest.raises(ValueError, match=r"align='epoch'; give one of \['iteration', 'time'\]"):
        RunComparison({"x": []}, align="epoch")


def test_the_app_overlays_the_runs_it_is_given_and_follows_their_files(tmp_path):
    from widgets import app

    a, b = tmp_path / "a", tmp_path / "b"
    for run, loss in ((a, 1.0), (b, 2.0)):
        run.mkdir()
        write_jsonl(run / "metrics.jsonl", history(2, lambda it, loss=loss: loss / it, step_s=1.0))
    tabs = app.build(a, compare=[b])
    assert list(tabs._names) == ["Placement explorer", "Live timeline", "Metrics", "Compare runs"]
    with pytest.raises(SystemExit):
        app.main(["--compare", str(tmp_path / "missing")])

    compare = RunComparison([a, b])
    assert not compare.reload()  # nothing changed
    with (b / "metrics.jsonl").open("a") as f:  # run b goes on
        f.write(json.dumps(history(3, lambda it: 0.5, step_s=1.0)[-1]) + "\n")
    assert compare.reload() and [x for x, _ in compare.aligned()["b"]] == [1, 2, 3]
