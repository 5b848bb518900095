"""Asynchronous split plans in the auto-mapper, their table and bars, and beside synchronous plans."""

import dataclasses

import pytest

from workbench.planner import (
    AsyncPlan,
    AutoMapper,
    Problem,
    Workload,
    automap,
    automap_async,
    cluster_preset,
    d_cost,
    dataflow_preset,
)
from workbench.planner.async_compare import compare_async, placement_estimates
from workbench.planner.asynchronous import Sharing, steady_iteration
from workbench.planner.calibrate import Calibration
from workbench.planner.simulator import Simulator

GRPO = dataflow_preset("grpo")
H100 = cluster_preset("h100", 8)


def workload(max_new_tokens: int) -> Workload:
    return Workload(batch_size=64, n=4, prompt_len=512, max_new_tokens=max_new_tokens)


def test_an_async_plan_is_the_slower_side_plus_the_push_of_its_sets():
    plan = automap_async(Problem(GRPO, "llama2-7b", workload(1024), H100), max_staleness=1)
    assert isinstance(plan, AsyncPlan)
    rollout = plan.set_of("rollout")
    assert rollout.models == ("rollout",) and plan.set_of("actor") is not rollout
    assert set(rollout.devices).isdisjoint(plan.set_of("actor").devices)
    assert plan.dataflow.call("gen").model == "rollout"
    # its pieces are its sets' call times: generation on the rollout set, d_cost of the others
    assert plan.generation_time == pytest.approx(plan.call_times["gen"])
    level = plan.dataflow.levels()
    trainer_sets = [s for s in plan.sets if s is not rollout]
    costs = [
        [
            sum(plan.call_times[c.name] for c in plan.dataflow.calls if c.model in s.models and level[c.name] == k)
            for k in range(plan.dataflow.n_levels)
        ]
        for s in trainer_sets
    ]
    driver = Simulator(H100, workload(1024)).driver_step_time(plan.dataflow)  # the driver's step, as in sync plans
    assert plan.trainer_time == pytest.approx(d_cost(costs) + driver)
    assert plan.push_time > 0
    expected = max(plan.generation_time, plan.trainer_time) + plan.push_time
    assert plan.iteration_time == pytest.approx(expected)
    assert plan.synchronous_time == pytest.approx(plan.generation_time + plan.trainer_time + plan.push_time)
    assert plan.with_staleness(0).iteration_time == pytest.approx(plan.synchronous_time)
    # the rollout never switches layouts: no generation layout, no transition
    a = rollout.assignments["rollout"]
    assert a.generation is None and a.transition is None


def test_on_shared_cores_both_sides_of_an_async_plan_slow_each_other():
    """4 devices time-sharing 2 cores (this machine's calibrated shape): the trainer's side is
    priced as synchronous plans price their levels, generation alone on its set, and the overlap
    by `Sharing`; the same sets on as many cores as devices are faster."""
    flow, wl = dataflow_preset("grpo"), Workload.tiny()
    shared = dataclasses.replace(cluster_preset("local", 4), cores_per_node=2.0)
    plan = automap_async(Problem(flow, "tiny-10m", wl, shared), max_staleness=1)
    rollout = plan.set_of("rollout")
    trainer_devices = sum(s.n_devices for s in plan.sets if s is not rollout)
    assert plan.sharing == Sharing(2.0, trainer_devices, rollout.n_devices)
    generation = plan.call_times["gen"] / plan.sharing.alone(rollout.n_devices)
    assert plan.generation_time == pytest.approx(generation)
    assert plan.iteration_time == pytest.approx(
        steady_iteration(plan.generation_time, plan.trainer_time, plan.push_time, 1, sharing=plan.sharing)
    )
    assert plan.iteration_time > max(plan.generation_time, plan.trainer_time) + plan.push_time  # they slow each other
    assert plan.with_staleness(1).iteration_time == pytest.approx(plan.iteration_time)
    roomy = automap_async(
        Problem(flow, "tiny-10m", wl, dataclasses.replace(shared, cores_per_node=None)), max_staleness=1
    )
    assert roomy.sharing is None and roomy.iteration_time < plan.iteration_time


def test_staleness_zero_plans_the_synchronous_split():
    plan = automap_async(Problem(GRPO, "llama2-7b", workload(1024), H100), max_staleness=0)
    assert plan.iteration_time == pytest.approx(plan.synchronous_time)
    assert plan.iteration_time == pytest.approx(
        steady_iteration(plan.generation_time, plan.trainer_time, plan.push_time, 0)
    )


def test_the_comparison_with_colocation_flips_where_the_numbers_say():
    verdicts = {}
    for max_new_tokens in (128, 1024, 4096):
        cmp = compare_async(Problem(GRPO, "llama2-7b", workload(max_new_tokens), H100), max_staleness=1)
        assert cmp.colocated is not None and cmp.asynchronous is not None
        faster = cmp.asynchronous.iteration_time < cmp.colocated.iteration_time
        assert cmp.beats_colocation == faster
        verdicts[max_new_tokens] = faster
        assert ("does not beat" in cmp.table()) != faster
    # short responses: training dominates and half the devices train; long ones: generation on
    # half the devices dominates; in between the overlap wins
    assert verdicts == {128: False, 1024: True, 4096: False}


def test_automap_takes_the_async_plan_only_when_asked_and_faster():
    wl = workload(1024)
    problem = Problem(GRPO, "llama2-7b", wl, H100)
    sync = automap(problem)
    assert not isinstance(sync, AsyncPlan)  # unchanged by default
    best = automap(problem, max_staleness=1)
    assert isinstance(best, AsyncPlan) and best.iteration_time < sync.iteration_time
    short = workload(128)
    assert not isinstance(automap(Problem(GRPO, "llama2-7b", short, H100), max_staleness=1), AsyncPlan)
    one = cluster_preset("h100", 1)  # no room for a rollout pool: the synchronous plan stands
    assert not isinstance(automap(Problem(GRPO, "tiny-1m", Workload.tiny(), one), max_staleness=1), AsyncPlan)


def test_run_async_needs_a_rollout_role():
    mapper = AutoMapper(Problem(GRPO, "tiny-1m", Workload.tiny(), cluster_preset("local", 4)))
    with pytest.raises(Exception, match="rollout role"):
        mapper.run_async(1)


def test_the_async_table_and_bars_show_one_steady_iteration():
    plan = automap_async(Problem(GRPO, "llama2-7b", workload(1024), H100), max_staleness=1)
    text = plan.table()
    assert "asynchronous, max_staleness 1" in text and f"{plan.iteration_time:.2f}s per iteration" in text
    bars = plan.gantt()
    rollout, actor = plan.set_of("rollout"), plan.set_of("actor")
    gen = next(b for b in bars if b.call == "gen")
    assert gen.start == 0.0 and gen.devices == (rollout.devices.start, rollout.devices.stop)
    trains = [b for b in bars if b.call and b.call != "gen"]
    assert min(b.start for b in trains) == 0.0  # overlapping generation
    assert max(b.end for b in trains) == pytest.approx(plan.trainer_time)
    pushes = [b for b in bars if b.kind == "param"]
    assert {p.devices for p in pushes} == {
        (rollout.devices.start, rollout.devices.stop),
        (actor.devices.start, actor.devices.stop),
    }
    assert all(p.end == pytest.approx(plan.iteration_time) for p in pushes)
    sync = plan.with_staleness(0).gantt()  # one after another
    assert min(b.start for b in sync if b.call and b.call != "gen") == pytest.approx(plan.generation_time)


def test_bench_estimates_put_the_four_placements_on_one_cost_model():
    cal = Calibration(
        peak_flops=1e11,
        train_efficiency=0.7,
        inference_efficiency=0.9,
        step_overhead=5e-3,
        memory_bandwidth=1.5e10,
        bandwidth_efficiency=0.4,
        intra_node_bandwidth=8e8,
        collective_latency=5e-4,
        cores=1.5,
        call_overhead=2e-3,
        driver_bandwidth=3e8,
        train_overhead=0.1,
        inference_overhead=0.03,
    )
    est = placement_estimates(
        "tiny-10m",
        "grpo",
        prompts=8,
        samples=4,
        prompt_len=16,
        max_new_tokens=32,
        calibration=cal,
        skip=("ref", "reward"),
        skip_synchronous=("old_log_prob",),
        iterations=6,
    )
    assert set(est.iteration_s) == {"colocated", "split", "async-s1", "async-s2"}
    split, s1, s2 = (est.pipelines[k] for k in ("split", "async-s1", "async-s2"))
    # the synchronous split is the sum; the stale batches recompute pi_old, so their trainer side is longer
    assert split.iteration_s == pytest.approx(split.generate_s + split.train_s + split.push_s)
    assert s1.train_s > split.train_s and s1.generate_s == split.generate_s
    # two devices on 1.5 cores: the overlap is slowed, so more than the slower side + push
    assert s1.iteration_s > max(s1.generate_s, s1.train_s) + s1.push_s
    assert s2.iteration_s == pytest.approx(s1.iteration_s) and s2.total_s >= s1.total_s
    assert est.tokens_per_s["async-s1"] == pytest.approx(8 * 4 * 32 / est.iteration_s["async-s1"])
    assert est.ratio(est.best_sync) == pytest.approx(1.0)
    assert est.as_dict()["best_sync"] in ("colocated", "split")
    more = placement_estimates(
        "tiny-10m",
        "grpo",
        prompts=8,
        samples=4,
        prompt_len=16,
        max_new_tokens=32,
        calibration=dataclasses.replace(cal, cores=4.0),
        skip=("ref", "reward"),
        skip_synchronous=("old_log_prob",),
    )
    assert more.iteration_s["async-s1"] == pytest.approx(max(s1.generate_s, s1.train_s) + s1.push_s)
    with pytest.raises(ValueError, match="no call"):
        placement_estimates(
            "tiny-10m", "grpo", prompts=8, prompt_len=16, max_new_tokens=32, calibration=cal, skip=("values",)
        )


@pytest.mark.parametrize("allocation", ["aligned", "free"])
def test_async_plans_on_two_machines_pack_their_sets_apart(allocation):
    cluster = cluster_preset("a100_80g", 32)
    plan = automap_async(Problem(dataflow_preset("ppo"), "llama2-7b", Workload(), cluster), 1, allocation=allocation)
    devices = [d for s in plan.sets for d in s.devices]
    assert len(devices) == len(set(devices)) and plan.set_of("rollout").n_devices >= 1
    assert plan.iteration_time == pytest.approx(max(plan.generation_time, plan.trainer_time) + plan.push_time)
