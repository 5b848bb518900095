"""How responsive the widgets are, measured in one run.

  slider_ms          - median time from a slider change in the PlacementExplorer to its updated
                       figure data (a fresh planner estimate each time: the cache is cleared),
                       on this machine's scenario (goal <= 200 ms, at most 500 ms);
                       `slider_vs_planner` is that over a bare planner call on the same scenario,
                       and `slider_render_ms` adds drawing the figure (what a browser waits for);
  timeline_overhead  - what a displayed LiveTimeline as the `fit` callback of a real tiny GRPO run
                       (2 workers) costs: the callback's own time (draining spans) plus every
                       redraw of its figure (on the view's thread, rate-limited by
                       View.background_share), over the watched iterations' wall time (goal
                       <= 0.02). A conservative bound: it charges each redraw in full, as if it
                       took its time from the workers. `timeline_ab_slowdown` is the measured
                       difference against unwatched blocks of iterations alternating in the same
                       run (noisy here).
Last line: one JSON object.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# `widgets` package it measures.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from algorithms import GRPO, Groups, GRPOConfig
from widgets import LiveTimeline, PlacementExplorer
from widgets.planning import cluster_for, dataflow_for, estimate, model_specs
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
from workbench.planner import AutoMapper, Workload

MOVES = (
    [("response_len", v) for v in (16, 64, 128, 256, 32)]
    + [("global_batch", v) for v in (8, 32, 64, 16)]
    + [("n_samples", v) for v in (1, 4, 8, 2)]
    + [("placement", v) for v in ("split", "standalone", "colocate", "auto")]
)


def slider_latency(rounds: int) -> dict:
    explorer = PlacementExplorer()
    ours, bare, render = [], [], []
    for _ in range(rounds):
        for name, value in MOVES:
            estimate.cache_clear()
            t0 = time.perf_counter()
            explorer.set(**{name: value})
            explorer.data()
            ours.append(time.perf_counter() - t0)
            # The bare planner on the same scenario: auto-mapping from scratch.
            s = explorer.scenario
            flow = dataflow_for(s.algorithm)
            wl = Workload(
                global_batch=s.global_batch,
                n_samples=s.n_samples,
                prompt_len=s.prompt_len,
                response_len=s.response_len,
                ppo_mini_batches=min(8, s.global_batch),
                micro_batch_size=min(8, s.global_batch * s.n_samples),
            )
            t0 = time.perf_counter()
            AutoMapper(flow, flow.model_specs(model_specs(s, flow.models)), wl, cluster_for(s)).run()
            bare.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            explorer.png()
            render.append(time.perf_counter() - t0)
    med = statistics.median
    return {
        "slider_ms": round(med(ours) * 1e3, 2),
        "planner_ms": round(med(bare) * 1e3, 2),
        "slider_vs_planner": round(med(ours) / med(bare), 3),
        "slider_render_ms": round((med(ours) + med(render)) * 1e3, 1),
        "slider_moves": len(ours),
    }


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
        timeline = LiveTimeline(session, since=time.time())
        timeline.widget()  # displayed, as in a notebook: refreshes redraw the figure
        timeline.refresh_seconds.clear()
        timeline.redraw_seconds.clear()
        t0 = time.perf_counter()  # one continuous watched run: what the timeline costs
        grpo.fit([prompts], iterations=pairs * block, log=None, callbacks=[timeline])
        continuous = time.perf_counter() - t0
        # The callback's own time plus every redraw's during the run, as if each redraw took its
        # wall time from the workers (an upper bound: on 2 busy cores they compete one for one).
        spent = sum(timeline.refresh_seconds) + sum(timeline.redraw_seconds)
        redraws, held = list(timeline.redraw_seconds), list(timeline.refresh_seconds)
        timeline.wait_drawn()
        watched_wall = bare_wall = 0.0
        for _ in range(pairs):  # then blocks watched and not, alternating: the measured difference
            t0 = time.perf_counter()
            grpo.fit([prompts], iterations=block, log=None, callbacks=[timeline])
            watched_wall += time.perf_counter() - t0
            t0 = time.perf_counter()
            grpo.fit([prompts], iterations=block, log=None)
            bare_wall += time.perf_counter() - t0
        timeline.wait_drawn()
    med, iterations = statistics.median, pairs * block
    return {
        "timeline_overhead": round(spent / continuous, 4),
        "timeline_ab_slowdown": round(watched_wall / bare_wall - 1, 4),
        "timeline_hold": round(sum(held) / continuous, 5),
        "timeline_refresh_ms": round(med(held) * 1e3, 2),
        "timeline_redraw_ms": round(med(redraws) * 1e3, 1) if redraws else 0.0,
        "timeline_redraws": len(redraws),
        "watched_run_s": round(continuous, 2),
        "iteration_s": round(bare_wall / iterations, 3),
        "iteration_watched_s": round(watched_wall / iterations, 3),
        "timeline_spans": timeline.data()["spans"],
        "pairs": pairs,
        "block": block,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="passes over the slider moves")
    parser.add_argument("--pairs", type=int, default=4, help="alternating watched/unwatched blocks of GRPO iterations")
    parser.add_argument("--block", type=int, default=8, help="iterations per block")
    args = parser.parse_args()
    result = {"bench": "widgets", **slider_latency(args.rounds)}
    print(
        f"explorer: slider change -> figure data {result['slider_ms']} ms (bare planner {result['planner_ms']} ms, "
        f"x{result['slider_vs_planner']}); with the figure drawn {result['slider_render_ms']} ms; goal <= 200 ms"
    )
    with tempfile.TemporaryDirectory() as tmp:
        result |= timeline_overhead(args.pairs, args.block, Path(tmp))
    print(
        f"live timeline: callback and redraws took {result['timeline_overhead']:.2%} "
        f"of a {result['watched_run_s']} s watched run "
        f"(goal <= 2%): the callback holds the loop {result['timeline_refresh_ms']} ms per iteration "
        f"({result['timeline_hold']:.2%}), {result['timeline_redraws']} redraws "
        f"of {result['timeline_redraw_ms']} ms ran on "
        f"the view's thread. Measured A/B: {result['iteration_watched_s']} s per iteration watched, "
        f"{result['iteration_s']} s not ({result['timeline_ab_slowdown']:+.1%}; noisy on a shared machine)"
    )
    result |= {"goal_slider_ms": 200, "goal_timeline_overhead": 0.02}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
