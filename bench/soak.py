"""Soak: does memory stay flat over a long run? 200 iterations of tiny PPO (issue 14, item 5).

PPO on the arithmetic kit with the 1m tiny model: the actor (FSDP2, HF rollout, with its
reference copy) on one device, the critic on another, an exact-match rule reward in the
session's long-lived scoring processes. Few prompts and tokens, so an iteration takes about a
second on 2 cores. Every iteration records:

- the RSS (and USS: pages no other process shares) of the driver, of each worker process (actor,
  critic), of the rule reward's scorer actors and their scoring children, and of Ray's raylet
  and GCS server (psutil);
- the driver's own bookkeeping: spans in `session.records`, span tags kept per host set,
  object references the driver holds (Ray's reference table), metrics rows in `algo.history`;
- every `--store-every` iterations, the Ray object store's objects and bytes (the raylet's
  memory info, as `ray memory --stats-only` reads it).

The trace is drained every `--trace-every` iterations, as a live timeline or a run recorder
would (`session.trace()`); 0 never drains it (spans then wait in the workers' buffers).

After `--warmup` iterations each process's RSS is fitted with a line (least squares): the slope
in MB per 100 iterations, its standard error, and the residual spread. A process "grows" when its
slope is above 3 standard errors, the fitted growth over the window is larger than twice the
residual spread (a wobble of the allocator is not a trend), and the slope passes `--floor`. Ray actors, placement
groups and processes are counted before the run, after it, after `session.clear()` and after
`session.shutdown()` (Ray is started here, so the session attaches and Ray outlives it: what the
session leaves behind can still be counted). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import ray
import torch

from algorithms import PPO, Groups, PPOConfig
from workbench import Session
from workbench.data import arithmetic
from workbench.data.prompts import tokenize_prompts
from workbench.engines.contract import OptimConfig
from workbench.engines.rollout import SamplingConfig
from workbench.models import load, make_tiny
from workbench.session import WORKER_ENV
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.rule_reward import RuleReward

MB = 1024 * 1024


# ---- what is measured ------------------------------------------------------------------------
def ray_counts() -> dict[str, int]:
    """Ray actors not dead, placement groups not removed, and Ray worker processes."""
    actors = ray._private.state.actors()
    groups = ray.util.placement_group_table()
    return {
        "actors": sum(a["State"] != "DEAD" for a in actors.values()),
        "placement_groups": sum(g["state"] != "REMOVED" for g in groups.values()),
        "worker_processes": len(ray_worker_processes()),
    }


def ray_worker_processes() -> list[psutil.Process]:
    """Ray's worker processes (children of the raylet titled ray::..., actors and idle task
    workers; not its agents)."""
    raylet = next((p for p in psutil.Process().children(recursive=True) if p.name() == "raylet"), None)
    out = []
    for child in raylet.children() if raylet is not None else []:
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith("ray::"):
                out.append(child)
        except psutil.Error:
            pass
    return out


def object_store() -> dict[str, int]:
    """Objects and bytes in the Ray object store (every node), from the raylet."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    try:
        stats = get_memory_info_reply(state).store_stats
    finally:
        state.disconnect()
    return {"objects": int(stats.num_local_objects), "bytes": int(stats.object_store_bytes_used)}


def driver_refs() -> int:
    """Object references the driver's Ray core worker holds (owned or borrowed)."""
    return len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())


class Processes:
    """The processes of the run by kind, and their memory per sample."""

    def __init__(self, ppo: PPO):
        me = psutil.Process()
        found: dict[str, list[int]] = {"driver": [me.pid]}
        for role in ("actor", "critic"):
            found[role] = [ident[0] for ident in getattr(ppo.groups, role).hostset.identities]
        pairs = ppo.groups.reward.process_ids()
        found["scorer"] = [p for p, _ in pairs]
        found["scorer_child"] = [c for _, c in pairs]
        for name in ("raylet", "gcs_server"):
            found[name] = [p.pid for p in me.children(recursive=True) if p.name() == name]
        self.kinds = found
        self.procs = {pid: psutil.Process(pid) for pids in found.values() for pid in pids}
        self.rss: dict[int, list[float]] = {pid: [] for pid in self.procs}
        self.uss: dict[int, list[float]] = {pid: [] for pid in self.procs}

    def sample(self) -> None:
        for pid, proc in self.procs.items():
            try:
                info = proc.memory_full_info()
                self.rss[pid].append(info.rss / MB)
                self.uss[pid].append(info.uss / MB)
            except psutil.Error:  # gone: the series stops (and the process counts as lost)
                self.rss[pid].append(float("nan"))
                self.uss[pid].append(float("nan"))

    def label(self, pid: int) -> str:
        kind = next(k for k, pids in self.kinds.items() if pid in pids)
        return kind if len(self.kinds[kind]) == 1 else f"{kind}[{self.kinds[kind].index(pid)}]"


def span_bytes(records: list) -> float:
    """Mean in-memory size of a trace span on the driver (the record, its fields, its extra
    dict; sys.getsizeof, so strings shared between spans are counted in each)."""
    sample = records[-500:]
    if not sample:
        return 0.0
    total = 0
    for r in sample:
        fields = vars(r)
        total += sys.getsizeof(r) + sys.getsizeof(fields) + sum(sys.getsizeof(v) for v in fields.values())
        total += sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in r.extra.items())
    return total / len(sample)


def row_bytes(rows: list[dict]) -> float:
    """Mean in-memory size of a metrics row of `algo.history` (the dict, its keys and values)."""
    sample = rows[-50:]
    if not sample:
        return 0.0
    return sum(sys.getsizeof(r) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in r.items()) for r in sample) / len(
        sample
    )


def trend(series: list[float], start: int, floor: float = 0.0) -> dict[str, float]:
    """Least-squares line through series[start:] against the iteration: slope per 100
    iterations, its standard error, the residual spread, and whether it is growth beyond noise
    (and above `floor`, in units per 100 iterations)."""
    ys = [y for y in series[start:] if y == y]  # drop NaN (process gone)
    n = len(ys)
    if n < 3:
        return {"slope": float("nan"), "stderr": float("nan"), "resid_std": float("nan"), "grows": False}
    xs = list(range(n))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = [y - (my + slope * (x - mx)) for x, y in zip(xs, ys)]
    resid_std = (sum(r * r for r in resid) / (n - 2)) ** 0.5
    stderr = resid_std / sxx**0.5
    fitted_growth = slope * (n - 1)
    grows = slope > 3 * stderr and fitted_growth > 2 * resid_std and slope * 100 > floor
    return {
        "slope": slope * 100,
        "stderr": stderr * 100,
        "resid_std": resid_std,
        "grows": bool(grows),
        "first": ys[0],
        "last": ys[-1],
    }


# ---- the run ---------------------------------------------------------------------------------
def build(session: Session, workdir: Path, args) -> tuple[PPO, object]:
    model_dir = make_tiny("1m", workdir / "tiny-1m", seed=0)
    tokenizer = load(model_dir).tokenizer
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), args.prompts, seed=1)
    prompts = tokenize_prompts([p.__dict__ for p in problems], tokenizer, max_prompt_length=32)
    rows = args.prompts * args.n  # one optimizer step per update
    optim = OptimConfig(lr=1e-5)
    actor = session.group(
        "actor",
        ActorRolloutRefWorker,
        session.pool("actor_pool", 1),
        ActorConfig(
            model_path=str(model_dir), reference=True, optim=optim, mini_batch_size=rows, micro_batch_size=rows
        ),
    )
    critic = session.group(
        "critic",
        CriticWorker,
        session.pool("critic_pool", 1),
        CriticConfig(model_path=str(model_dir), optim=optim, mini_batch_size=rows, micro_batch_size=rows),
    )
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, n=args.n, seed=0)
    ppo = PPO(
        Groups(actor=actor, reference=actor, critic=critic, reward=RuleReward(arithmetic.score)),
        PPOConfig(sampling=sampling),
    )
    return ppo, prompts


def bookkeeping(session: Session, ppo: PPO) -> dict[str, int]:
    hostsets = {id(g.hostset): g.hostset for g in session.groups.values()}.values()
    return {
        "session_records": len(session.records),
        "call_tags": sum(len(h.call_tags) for h in hostsets),
        "history_rows": len(ppo.history),
        "driver_refs": driver_refs(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=40, help="iterations left out of the slope fits")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    parser.add_argument("--n", type=int, default=2, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--trace-every", type=int, default=1, help="drain the trace every k iterations (0: never)")
    parser.add_argument(
        "--max-trace-records",
        type=int,
        default=None,
        help="Session(max_trace_records=...): spans the driver keeps (default: the Session's)",
    )
    parser.add_argument("--store-every", type=int, default=10, help="read the object store's stats every k iterations")
    parser.add_argument("--print-every", type=int, default=20)
    parser.add_argument(
        "--floor",
        type=float,
        default=0.5,
        help="MB per 100 iterations a slope must pass to count as growth (RSS moves in allocator pages)",
    )
    parser.add_argument(
        "--series", type=Path, help="also write the per-iteration series (RSS, USS, store, bookkeeping) here as JSON"
    )
    args = parser.parse_args()
    if not 0 <= args.warmup < args.iterations - 2:
        parser.error(f"--warmup={args.warmup} must leave at least 3 of the {args.iterations} iterations to fit")
    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))

    # Ray is started here, so the session attaches to it and Ray outlives session.shutdown():
    # whatever the session leaves behind can still be counted.
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": dict(WORKER_ENV)})
    counts = {"before": ray_counts()}
    store = {"before": object_store()}
    refs = {"before": driver_refs()}
    session = Session(**({} if args.max_trace_records is None else {"max_trace_records": args.max_trace_records}))
    ppo, prompts = build(session, workdir, args)
    procs = Processes(ppo)
    print("processes: " + ", ".join(f"{procs.label(pid)}={pid}" for pid in procs.procs), flush=True)

    store_series: list[tuple[int, dict]] = []
    books: list[dict] = []
    step_seconds: list[float] = []
    header = (
        f"{'iter':>5} {'s/it':>6} "
        + " ".join(f"{procs.label(p)[:12]:>12}" for p in procs.procs)
        + f" {'store obj':>9} {'store MB':>8} {'spans':>6} {'refs':>5}"
    )
    print("RSS in MB\n" + header, flush=True)
    start = time.monotonic()
    for it in range(1, args.iterations + 1):
        t0 = time.monotonic()
        ppo.step(prompts)
        step_seconds.append(time.monotonic() - t0)
        if args.trace_every and it % args.trace_every == 0:
            session.trace()
        procs.sample()
        books.append(bookkeeping(session, ppo))
        if it % args.store_every == 0 or it in (1, args.warmup):
            store_series.append((it, object_store()))
        if it % args.print_every == 0 or it == 1:
            s = store_series[-1][1]
            print(
                f"{it:>5} {statistics.fmean(step_seconds[-args.print_every :]):>6.2f} "
                + " ".join(f"{procs.rss[p][-1]:>12.1f}" for p in procs.procs)
                + f" {s['objects']:>9} {s['bytes'] / MB:>8.2f}"
                + f" {books[-1]['session_records']:>6} {books[-1]['driver_refs']:>5}",
                flush=True,
            )
    run_seconds = time.monotonic() - start

    bytes_per_span, bytes_per_row = span_bytes(session.records), row_bytes(ppo.history)
    counts["after_run"] = ray_counts()
    store["after_run"] = object_store()
    refs["after_run"] = driver_refs()
    expected_groups = counts["after_run"]["actors"]
    session.clear()
    counts["after_clear"] = ray_counts()
    store["after_clear"] = object_store()
    refs["after_clear"] = driver_refs()
    tracked = dict(procs.procs)
    session.shutdown()
    time.sleep(2.0)  # let killed processes be reaped
    counts["after_shutdown"] = ray_counts()
    store["after_shutdown"] = object_store()
    refs["after_shutdown"] = driver_refs()
    ray_system = {pid for kind in ("driver", "raylet", "gcs_server") for pid in procs.kinds[kind]}
    lingering = [
        procs.label(pid)
        for pid, p in tracked.items()
        if pid not in ray_system and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]
    ray.shutdown()

    # ---- report ----
    w = args.warmup
    fits = {
        pid: {"rss": trend(procs.rss[pid], w, args.floor), "uss": trend(procs.uss[pid], w, args.floor)}
        for pid in procs.procs
    }
    print(
        f"\nmemory after the {w}-iteration warm-up, iterations {w + 1}..{args.iterations} "
        f"(slopes in MB per 100 iterations; 'grows' = slope > 3 stderr, fitted growth > 2 x residual spread "
        f"and slope > {args.floor} MB)"
    )
    print(
        f"{'process':<16} {'pid':>8} {'RSS first':>9} {'RSS last':>9} {'slope':>8} {'stderr':>7} {'resid sd':>8} "
        f"{'USS slope':>9}  verdict"
    )
    for pid in procs.procs:
        r, u = fits[pid]["rss"], fits[pid]["uss"]
        verdict = "GROWS" if r["grows"] else "flat"
        print(
            f"{procs.label(pid):<16} {pid:>8} {r.get('first', float('nan')):>9.1f} {r.get('last', float('nan')):>9.1f} "
            f"{r['slope']:>+8.2f} {r['stderr']:>7.2f} {r['resid_std']:>8.2f} {u['slope']:>+9.2f}  {verdict}"
        )

    after_warmup = next(s for i, s in store_series if i >= w)
    end_store = store_series[-1][1]
    book_fit = {k: trend([float(b[k]) for b in books], w) for k in books[0]}
    print(
        f"\nobject store: {store['before']['objects']} objects before; {after_warmup['objects']} after warm-up, "
        f"{end_store['objects']} at the end ({(end_store['bytes'] - after_warmup['bytes']) / MB:+.3f} MB); "
        f"{store['after_clear']['objects']} after clear, {store['after_shutdown']['objects']} after shutdown"
    )
    print(
        "driver bookkeeping at the end (slope per 100 iterations after warm-up): "
        + ", ".join(f"{k} {books[-1][k]} ({book_fit[k]['slope']:+.1f})" for k in books[0])
        + f"; on the driver a span takes ~{bytes_per_span:.0f} B, a history row ~{bytes_per_row:.0f} B"
    )
    print(
        "Ray counts: "
        + "; ".join(f"{when}: " + ", ".join(f"{k} {v}" for k, v in c.items()) for when, c in counts.items())
    )
    print(f"processes still running after shutdown: {lingering or 'none'}")

    if args.series:
        args.series.write_text(
            json.dumps(
                {
                    "rss_mb": {procs.label(p): [round(v, 3) for v in procs.rss[p]] for p in procs.procs},
                    "uss_mb": {procs.label(p): [round(v, 3) for v in procs.uss[p]] for p in procs.procs},
                    "object_store": [[i, s] for i, s in store_series],
                    "bookkeeping": books,
                }
            )
        )

    def by_kind(key: str, field: str) -> dict[str, float]:
        """Per kind: the worst (largest) value over its processes."""
        return {
            kind: round(max(fits[pid][key][field] for pid in pids), 3) for kind, pids in procs.kinds.items() if pids
        }

    # What the driver keeps on purpose: a metrics row per iteration (algo.history) and the trace
    # spans (session.records, up to max_trace_records). Growth beyond that is unexplained.
    kept_mb = (
        book_fit["history_rows"]["slope"] * bytes_per_row + book_fit["session_records"]["slope"] * bytes_per_span
    ) / MB
    print(
        f"driver: {fits[procs.kinds['driver'][0]]['rss']['slope']:+.2f} MB per 100 iterations, of which "
        f"{kept_mb:.2f} MB is what it keeps on purpose (metrics rows and trace spans)"
    )
    leaked = {k: counts["after_shutdown"][k] - counts["before"][k] for k in counts["before"]}
    grows = sorted({procs.label(pid) for pid in procs.procs if fits[pid]["rss"]["grows"]})
    print(
        json.dumps(
            {
                "bench": "soak",
                "iterations": args.iterations,
                "warmup": w,
                "seconds_per_iteration": round(statistics.fmean(step_seconds[w:]), 3),
                "run_seconds": round(run_seconds, 1),
                "rss_slope_mb_per_100it": by_kind("rss", "slope"),
                "rss_slope_stderr_mb_per_100it": by_kind("rss", "stderr"),
                "rss_resid_std_mb": by_kind("rss", "resid_std"),
                "uss_slope_mb_per_100it": by_kind("uss", "slope"),
                "rss_first_mb": by_kind("rss", "first"),
                "rss_last_mb": by_kind("rss", "last"),
                "grows": grows,
                "object_store_growth_bytes": end_store["bytes"] - after_warmup["bytes"],
                "object_store_growth_objects": end_store["objects"] - after_warmup["objects"],
                "object_store": {
                    "before": store["before"],
                    "after_warmup": after_warmup,
                    "end": end_store,
                    "after_clear": store["after_clear"],
                    "after_shutdown": store["after_shutdown"],
                },
                "driver_refs": refs | {"after_warmup": books[w - 1]["driver_refs"] if w else refs["before"]},
                "bookkeeping_end": books[-1],
                "driver_kept_mb_per_100it": round(kept_mb, 3),
                "span_bytes": round(bytes_per_span),
                "history_row_bytes": round(bytes_per_row),
                "max_trace_records": getattr(session, "max_trace_records", None),
                "dropped_records": getattr(session, "dropped_records", None),
                "bookkeeping_slope_per_100it": {k: round(v["slope"], 2) for k, v in book_fit.items()},
                "ray_counts": counts,
                "actors_during_run": expected_groups,
                "leaked_actors": leaked["actors"],
                "leaked_placement_groups": leaked["placement_groups"],
                "leaked_worker_processes": leaked["worker_processes"],
                "lingering_processes": lingering,
                "processes": {procs.label(pid): pid for pid in procs.procs},
                "cores": os.cpu_count(),
                "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
                | {"model": "1m", "python": sys.version.split()[0]},
            }
        )
    )


if __name__ == "__main__":
    main()
