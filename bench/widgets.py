"""How responsive the widgets are, measured in one run.

  slider_ms          - median time from a slider change in the PlacementExplorer to its updated
                       figure data (a fresh planner estimate each time: the cache is cleared),
                       on this machine's scenario (goal <= 200 ms, at most 500 ms);
                       `slider_vs_planner` is that over a bare planner call on the same scenario,
                       and `slider_render_ms` adds drawing the figure (what a browser waits for);
  timeline_overhead  - how much longer an iteration of a real tiny GRPO run (2 workers) takes with a
                       displayed LiveTimeline as its `fit` callback than without: median over pairs
                       of watched and unwatched iterations, alternating in one run (goal <= 0.02);
                       `timeline_hold` is the share of the iteration the callback itself holds the
                       loop (draining spans; the figure is redrawn on the view's own thread, whose
                       time is `timeline_redraw_ms`).
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

from algorithms import GRPO, GRPOConfig, Groups
from widgets import LiveTimeline, PlacementExplorer
from widgets.planning import cluster_for, dataflow_for, estimate, model_specs
from workbench import (ActorConfig, ActorRolloutRefWorker, OptimConfig, RuleReward, SamplingConfig, Session,
                       arithmetic, tokenize_prompts)
from workbench.models import load, make_tiny
from workbench.planner import AutoMapper, Workload

MOVES = [("response_len", v) for v in (16, 64, 128, 256, 32)] + [("global_batch", v) for v in (8, 32, 64, 16)] + \
        [("n_samples", v) for v in (1, 4, 8, 2)] + [("placement", v) for v in ("split", "standalone", "colocate", "auto")]


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
            wl = Workload(global_batch=s.global_batch, n_samples=s.n_samples, prompt_len=s.prompt_len,
                          response_len=s.response_len, ppo_mini_batches=min(8, s.global_batch),
                          micro_batch_size=min(8, s.global_batch * s.n_samples))
            t0 = time.perf_counter()
            AutoMapper(flow, flow.model_specs(model_specs(s, flow.models)), wl, cluster_for(s)).run()
            bare.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            explorer.png()
            render.append(time.perf_counter() - t0)
    med = statistics.median
    return {"slider_ms": round(med(ours) * 1e3, 2), "planner_ms": round(med(bare) * 1e3, 2),
            "slider_vs_planner": round(med(ours) / med(bare), 3),
            "slider_render_ms": round((med(ours) + med(render)) * 1e3, 1), "slider_moves": len(ours)}


def timeline_overhead(pairs: int, workdir: Path) -> dict:
    model_dir = make_tiny("1m", workdir / "policy", seed=0)
    tokenizer = load(model_dir).tokenizer
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 8, seed=1)
    prompts = tokenize_prompts([p.__dict__ for p in problems], tokenizer, max_prompt_length=32)
    with Session(num_devices=2) as session:
        actor = session.group("actor", ActorRolloutRefWorker, session.pool("actor_pool", 2),
                              ActorConfig(model_path=str(model_dir), reference=True, optim=OptimConfig(lr=1e-5)))
        grpo = GRPO(Groups(actor=actor, reference=actor, reward=RuleReward(arithmetic.score)),
                    GRPOConfig(sampling=SamplingConfig(max_new_tokens=16, n=4, seed=0)))
        grpo.fit([prompts], iterations=1, log=None)  # warm-up: first calls load and compile
        timeline = LiveTimeline(session, since=time.time())
        timeline.widget()  # displayed, as in a notebook: every refresh redraws the figure
        timeline.refresh_seconds.clear()
        timeline.redraw_seconds.clear()
        watched, bare, held = [], [], []
        for _ in range(pairs):  # alternate: two iterations watched, two not; keep the second of each
            # (the first watched redraw runs during the second iteration, off the loop's thread)
            history = grpo.fit([prompts], iterations=2, log=None, callbacks=[timeline])
            watched.append(history[1]["timing_s/step"])  # the first iteration's redraw ran during it
            held.append(timeline.refresh_seconds[-1])  # the callback's own time, between iterations
            timeline.wait_drawn()
            bare.append(grpo.fit([prompts], iterations=2, log=None)[1]["timing_s/step"])
    med = statistics.median
    return {"timeline_overhead": round((med(watched) + med(held)) / med(bare) - 1, 4),
            "timeline_hold": round(med(held) / med(bare), 5),
            "timeline_refresh_ms": round(med(timeline.refresh_seconds) * 1e3, 2),
            "timeline_redraw_ms": round(med(timeline.redraw_seconds) * 1e3, 1),
            "iteration_s": round(med(bare), 3), "iteration_watched_s": round(med(watched), 3),
            "timeline_spans": timeline.data()["spans"], "pairs": pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="passes over the slider moves")
    parser.add_argument("--pairs", type=int, default=8, help="watched/unwatched pairs of GRPO iterations")
    args = parser.parse_args()
    result = {"bench": "widgets", **slider_latency(args.rounds)}
    print(f"explorer: slider change -> figure data {result['slider_ms']} ms (bare planner {result['planner_ms']} ms, "
          f"x{result['slider_vs_planner']}); with the figure drawn {result['slider_render_ms']} ms; goal <= 200 ms")
    with tempfile.TemporaryDirectory() as tmp:
        result |= timeline_overhead(args.pairs, Path(tmp))
    print(f"live timeline: an iteration takes {result['iteration_watched_s']} s watched, {result['iteration_s']} s not "
          f"-> {result['timeline_overhead']:+.1%}; goal <= 2%. The callback holds the loop "
          f"{result['timeline_refresh_ms']} ms ({result['timeline_hold']:.2%}); the redraw, on its own thread, "
          f"takes {result['timeline_redraw_ms']} ms")
    result |= {"goal_slider_ms": 200, "goal_timeline_overhead": 0.02}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
