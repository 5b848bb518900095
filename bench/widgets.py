"""How responsive the widgets are, measured in one run.

  slider_ms          - median time from a slider change in the PlacementExplorer to its updated
                       figure data: a fresh planner estimate each time (the cache is cleared) and
                       the new rows in the Bokeh data sources of a displayed explorer (its
                       ipywidgets form, whose jupyter_bokeh widget serializes the patch a browser
                       receives), on this machine's scenario (goal <= 100 ms);
                       `slider_data_ms` is the estimate and `data()` alone (no front end),
                       `slider_vs_planner` slider_ms over a bare planner call on the same
                       scenario, `slider_render_ms` slider_ms plus the static PNG fallback;
  views_overhead     - what a displayed LiveTimeline and MetricsDashboard, both `fit` callbacks
                       of a real tiny GRPO run (2 workers), cost: the time spent in their
                       callbacks (the dashboard streams its row on the loop's thread; the
                       timeline's callback returns at once and its refresh, draining spans and
                       streaming them, runs on its own thread, charged at its CPU time) over the
                       watched iterations' wall time (goal <= 0.01), with both views updated
                       after every iteration (`views_updates` counts them);
                       `timeline_overhead` and `dashboard_overhead` split it, and
                       `timeline_ab_slowdown` is the measured difference against unwatched blocks
                       of iterations alternating in the same run (noisy here);
  long_run_refresh   - the timeline's refresh CPU (median ms, displayed) when the run it follows
                       already holds `long_run_spans` spans (the session's default trace limit):
                       the real run's last iteration repeated, one iteration per refresh,
                       handed over by a cursor as a session's `spans_since` does;
                       `long_run_growth` is it over the same refresh at the run's start (goal:
                       about 1, the cost of the new spans, not of the run).
Last line: one JSON object.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# `widgets` package it measures.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from algorithms import GRPO, Groups, GRPOConfig
from widgets import LiveTimeline, MetricsDashboard, PlacementExplorer
from widgets.planning import cluster_for, dataflow_for, estimate, model_specs, workload_for
from workbench import (
    ActorConfig,
    ActorRolloutRefWorker,
    OptimConfig,
    RuleReward,
    SamplingConfig,
    Session,
    arithmetic,
    tokenize_prompts,
)
from workbench.models import load, make_tiny
from workbench.planner import AutoMapper, Problem

MOVES = (
    [("max_new_tokens", v) for v in (16, 64, 128, 256, 32)]
    + [("batch_size", v) for v in (8, 32, 64, 16)]
    + [("n", v) for v in (1, 4, 8, 2)]
    + [("placement", v) for v in ("split", "standalone", "colocate", "auto")]
)


def displayed(view) -> None:
    """Show a view as a notebook does (a cell's value is its widget, the figure live through
    jupyter_bokeh, which serializes every change for the browser). The app shows the views in
    its own process, following the files a RunRecorder writes, not in the training process."""
    view.widget()


def slider_latency(rounds: int) -> dict:
    explorer, bare_explorer = PlacementExplorer(), PlacementExplorer()
    displayed(explorer)
    ours, data_only, bare, render = [], [], [], []
    for _ in range(rounds):
        for name, value in MOVES:
            estimate.cache_clear()
            t0 = time.perf_counter()
            explorer.set(**{name: value})  # recomputes, then updates the displayed figures' sources
            ours.append(time.perf_counter() - t0)
            estimate.cache_clear()
            t0 = time.perf_counter()
            bare_explorer.set(**{name: value})
            bare_explorer.data()
            data_only.append(time.perf_counter() - t0)
            # The bare planner on the same scenario: auto-mapping from scratch.
            s = explorer.scenario
            flow = dataflow_for(s.algorithm)
            wl = workload_for(s)
            t0 = time.perf_counter()
            AutoMapper(Problem(flow, model_specs(s, flow.models), wl, cluster_for(s))).run()
            bare.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            explorer.png()
            render.append(time.perf_counter() - t0)
    med = statistics.median
    return {
        "slider_ms": round(med(ours) * 1e3, 2),
        "slider_data_ms": round(med(data_only) * 1e3, 2),
        "planner_ms": round(med(bare) * 1e3, 2),
        "slider_vs_planner": round(med(ours) / med(bare), 3),
        "slider_render_ms": round((med(ours) + med(render)) * 1e3, 1),
        "slider_moves": len(ours),
    }


class Timed:
    """A fit callback, timed: what it holds the loop for, every iteration."""

    def __init__(self, callback):
        self.callback, self.seconds, self.cpu_seconds = callback, [], []

    def __call__(self, algorithm, batch, metrics):
        t0, cpu = time.perf_counter(), time.thread_time()
        self.callback(algorithm, batch, metrics)
        self.seconds.append(time.perf_counter() - t0)
        self.cpu_seconds.append(time.thread_time() - cpu)


def timeline_overhead(pairs: int, block: int, workdir: Path) -> dict:
    model_dir = make_tiny("1m", workdir / "policy", seed=0)
    tokenizer = load(model_dir).tokenizer
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 8, seed=1)
    prompts = tokenize_prompts([p.__dict__ for p in problems], tokenizer, max_prompt_length=32)
    with Session(num_devices=2) as session:
        actor = session.group(
            "actor",
            ActorRolloutRefWorker,
            session.pool("actor_pool", 2),
            ActorConfig(model_path=str(model_dir), reference=True, optim=OptimConfig(lr=1e-5)),
        )
        grpo = GRPO(
            Groups(actor=actor, reference=actor, reward=RuleReward(arithmetic.score)),
            GRPOConfig(sampling=SamplingConfig(max_new_tokens=16, n=4, seed=0)),
        )
        grpo.fit([prompts], iterations=1, log=None)  # warm-up: first calls load and compile
        timeline, dashboard = LiveTimeline(session, since=time.time()), MetricsDashboard()
        displayed(timeline)  # as in a notebook and the app: updates stream into live figures
        displayed(dashboard)
        watch_timeline, watch_dashboard = Timed(timeline), Timed(dashboard)
        iterations = pairs * block
        t0 = time.perf_counter()  # one continuous watched run: what the views cost
        grpo.fit([prompts], iterations=iterations, log=None, callbacks=[watch_timeline, watch_dashboard])
        continuous = time.perf_counter() - t0
        assert timeline.wait_drawn(60)  # the last iteration's spans are streamed
        last = timeline._marks.order[-1][0]  # the last iteration's spans: what a refresh gets
        run_spans = [r for r in timeline.records if r.start >= last]
        refresh_cpu, refresh_wall = list(timeline.refresher.cpu_seconds), list(timeline.refresher.wall_seconds)
        updates = min(len(timeline.redraw_seconds), len(dashboard.redraw_seconds))
        assert len(watch_timeline.seconds) == len(watch_dashboard.seconds) == iterations
        assert len(dashboard.rows) == iterations and updates >= iterations, "a view missed an iteration"
        # The timeline's callback returns at once; its refresh (draining the trace, streaming the
        # spans) runs on the view's thread: charged at its CPU time, what it takes from the run.
        spent_timeline = sum(watch_timeline.seconds) + sum(refresh_cpu)
        spent_dashboard = sum(watch_dashboard.seconds)
        redraws = list(timeline.redraw_seconds)
        watched_wall = bare_wall = 0.0
        for _ in range(pairs):  # then blocks watched and not, alternating: the measured difference
            t0 = time.perf_counter()
            grpo.fit([prompts], iterations=block, log=None, callbacks=[timeline, dashboard])
            watched_wall += time.perf_counter() - t0
            t0 = time.perf_counter()
            grpo.fit([prompts], iterations=block, log=None)
            bare_wall += time.perf_counter() - t0
    med = statistics.median
    return {
        "views_overhead": round((spent_timeline + spent_dashboard) / continuous, 5),
        "views_updates": updates,
        "timeline_overhead": round(spent_timeline / continuous, 5),
        "dashboard_overhead": round(spent_dashboard / continuous, 5),
        "timeline_ab_slowdown": round(watched_wall / bare_wall - 1, 4),
        "timeline_hold": round(sum(watch_timeline.seconds) / continuous, 5),
        "timeline_refresh_ms": round(med(refresh_wall) * 1e3, 2),
        "timeline_refresh_cpu_ms": round(med(refresh_cpu) * 1e3, 2),
        "timeline_refreshes": len(refresh_wall),
        "dashboard_update_ms": round(med(watch_dashboard.seconds) * 1e3, 2),
        "dashboard_update_cpu_ms": round(med(watch_dashboard.cpu_seconds) * 1e3, 2),
        "timeline_redraw_ms": round(med(redraws) * 1e3, 2) if redraws else 0.0,
        "timeline_redraws": len(redraws),
        "watched_run_s": round(continuous, 2),
        "iteration_s": round(bare_wall / iterations, 3),
        "iteration_watched_s": round(watched_wall / iterations, 3),
        "timeline_spans": timeline.data()["spans"],
        "pairs": pairs,
        "block": block,
        **long_run_refresh(run_spans, 1, 20_000),
    }


class Repeated:
    """A session's `spans_since` over a run's spans repeated with shifted times and iterations:
    a long run without waiting for one."""

    def __init__(self, spans: list, iterations: int):
        self.spans, self.iterations, self.handed = spans, iterations, []
        self.length = max(r.end for r in spans) - min(r.start for r in spans)

    def grow(self, times: int) -> None:
        for _ in range(times):
            k = len(self.handed) // len(self.spans)
            self.handed += [
                replace(
                    r,
                    start=r.start + k * self.length,
                    fetched=r.fetched + k * self.length,
                    end=r.end + k * self.length,
                    extra={**r.extra, "iteration": r.extra["iteration"] + k * self.iterations}
                    if "iteration" in r.extra
                    else r.extra,
                )
                for r in self.spans
            ]

    def spans_since(self, cursor: int = 0):
        return self.handed[cursor:], len(self.handed)


def long_run_refresh(spans: list, iterations: int, total: int) -> dict:
    """Refresh CPU of a displayed timeline at a run's start and once it holds `total` spans."""
    source = Repeated(spans, iterations)
    timeline = LiveTimeline(source)
    displayed(timeline)

    def refreshes(n: int) -> float:
        cpu = []
        for _ in range(n):
            source.grow(1)
            t0 = time.thread_time()
            timeline.refresh()
            cpu.append(time.thread_time() - t0)
        return statistics.median(cpu)

    early = refreshes(20)
    source.grow(max(0, total // len(spans) - 40))
    timeline.refresh()
    late = refreshes(20)
    return {
        "long_run_refresh_ms": round(late * 1e3, 3),
        "long_run_first_refresh_ms": round(early * 1e3, 3),
        "long_run_growth": round(late / early, 2),
        "long_run_spans": len(timeline.records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="passes over the slider moves")
    parser.add_argument("--pairs", type=int, default=4, help="alternating watched/unwatched blocks of GRPO iterations")
    parser.add_argument("--block", type=int, default=8, help="iterations per block")
    args = parser.parse_args()
    result = {"bench": "widgets", **slider_latency(args.rounds)}
    print(
        f"explorer: slider change -> updated figure data {result['slider_ms']} ms "
        f"(estimate and data alone {result['slider_data_ms']} ms, bare planner {result['planner_ms']} ms); "
        f"with the static PNG {result['slider_render_ms']} ms; goal <= 100 ms"
    )
    with tempfile.TemporaryDirectory() as tmp:
        result |= timeline_overhead(args.pairs, args.block, Path(tmp))
    print(
        f"live timeline + dashboard: their callbacks took {result['views_overhead']:.2%} "
        f"of a {result['watched_run_s']} s watched run (goal <= 1%), updating both figures after every "
        f"iteration ({result['views_updates']} updates each): the timeline's refresh took "
        f"{result['timeline_refresh_ms']} ms ({result['timeline_refresh_cpu_ms']} ms of CPU) on its thread, "
        f"holding the loop {result['timeline_hold']:.3%}; the dashboard {result['dashboard_update_ms']} ms "
        f"per iteration (medians). Measured A/B: "
        f"{result['iteration_watched_s']} s per iteration watched, {result['iteration_s']} s not "
        f"({result['timeline_ab_slowdown']:+.1%}; noisy on a shared machine)"
    )
    print(
        f"a long run: the timeline's refresh took {result['long_run_refresh_ms']} ms of CPU once it held "
        f"{result['long_run_spans']} spans, {result['long_run_growth']}x its {result['long_run_first_refresh_ms']} ms "
        "at the start"
    )
    result |= {
        "goal_slider_ms": 100,
        "goal_timeline_overhead": 0.01,
        "goal_views_overhead": 0.01,
        "views_overhead_ok": result["views_overhead"] <= 0.01,
        "slider_ok": result["slider_ms"] <= 100,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
