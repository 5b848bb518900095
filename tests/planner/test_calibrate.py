"""Fitting the local preset: recovers known figures from synthetic timings, round-trips."""

import dataclasses

import pytest

from workbench.planner import TaskGraph, Workload, cluster_preset, time_cost
from workbench.planner.calibrate import CollectiveTiming, Timing, fit, fit_cores, fit_link, load_calibration
from workbench.planner.simulator import Simulator
from workbench.planner.specs import ModelSpec

SMALL = ModelSpec("kit-1m", 4, 128, 4, 4, 352, 262)
MEDIUM = ModelSpec("kit-10m", 6, 384, 6, 6, 1024, 262)
PEAK, MEM_BW = 100e9, 8e9
TRUE = dict(
    train_efficiency=0.55,
    inference_efficiency=0.7,
    step_overhead=2.5e-3,
    train_overhead=0.04,
    inference_overhead=0.02,
    bandwidth_efficiency=0.3,
    intra_node_bandwidth=0.4e9,
    collective_latency=3e-4,
    shard_overhead=4e-3,
    gather_overhead=1.5e-3,
    sequence_overhead=2e-4,  # sampling and log-probs per row per decoding step
)


def _truth():
    return dataclasses.replace(
        cluster_preset("local"), peak_flops=PEAK, memory_bandwidth=MEM_BW, comm_efficiency=1.0, **TRUE
    )


def _synthetic():
    truth = _truth()
    timings = []
    for model in (SMALL, MEDIUM):
        for b, t in [(8, 48), (32, 48), (16, 96), (16, 16)]:
            timings.append(Timing("inference", model, b, t, 0, 4))
            timings.append(Timing("train", model, b, t, 0, 4, mini_batches=max(1, b // 8)))
        for b, p, r in [(1, 16, 16), (8, 16, 16), (32, 16, 16), (32, 16, 32)]:
            timings.append(Timing("generate", model, b, p, r, b))
        # The same model sharded over two devices (FSDP), and its weights gathered whole.
        timings.append(Timing("inference", model, 16, 16, 16, 4, dp=2))
        timings.append(Timing("train", model, 32, 8, 8, 4, mini_batches=2, dp=2))
        timings.append(Timing("sync", model, 1, 0, 0, 1, dp=2))
    timings = [dataclasses.replace(t, seconds=t.predict(truth)) for t in timings]
    coll = [CollectiveTiming(n, 2, 0.0) for n in (4e3, 1e6, 4e6, 16e6)]
    coll = [dataclasses.replace(c, seconds=c.predict(truth)) for c in coll]
    return timings, coll


def test_fit_recovers_known_constants_from_synthetic_timings():
    timings, coll = _synthetic()
    cal = fit(timings, coll, peak_flops=PEAK, memory_bandwidth=MEM_BW, slowdown={1: 1.0, 2: 1.0, 3: 1.5, 4: 2.0})
    for name, value in TRUE.items():
        assert getattr(cal, name) == pytest.approx(value, rel=1e-3), name
    assert cal.cores == pytest.approx(2.0, abs=0.02)
    for _, measured, predicted in cal.residuals():
        assert predicted == pytest.approx(measured, rel=1e-6)


def test_fit_is_robust_to_noise():
    timings, coll = _synthetic()
    noisy = [dataclasses.replace(t, seconds=t.seconds * (1.05 if i % 2 else 0.95)) for i, t in enumerate(timings)]
    cal = fit(noisy, coll, peak_flops=PEAK, memory_bandwidth=MEM_BW, slowdown={1: 1.0})
    assert cal.train_efficiency == pytest.approx(TRUE["train_efficiency"], rel=0.1)
    assert cal.inference_efficiency == pytest.approx(TRUE["inference_efficiency"], rel=0.1)


def test_sharded_calls_cost_their_fixed_costs_per_collective_and_per_tensor():
    truth = _truth()
    free = dataclasses.replace(truth, shard_overhead=0.0, gather_overhead=0.0)
    forward = Timing("inference", MEDIUM, 16, 16, 16, 4, dp=2)  # 2 micro-batches per rank
    sync = Timing("sync", MEDIUM, 1, 0, 0, 1, dp=2)
    # One all-gather per FSDP unit (6 layers + the root) per micro-batch; one gather per tensor.
    assert forward.predict(truth) - forward.predict(free) == pytest.approx(2 * 7 * 4e-3)
    assert sync.predict(truth) - sync.predict(free) == pytest.approx((9 * 6 + 3) * 1.5e-3)
    alone = Timing("inference", MEDIUM, 16, 16, 16, 4)  # one device: nothing is gathered
    assert alone.predict(truth) == alone.predict(free)


def test_a_gather_cheaper_than_the_fitted_latency_is_fitted_not_floored():
    timings, coll = _synthetic()
    truth = dataclasses.replace(_truth(), gather_overhead=-1e-4)  # latency 3e-4 + overhead > 0
    timings = [dataclasses.replace(t, seconds=t.predict(truth)) if t.kind == "sync" else t for t in timings]
    cal = fit(timings, coll, peak_flops=PEAK, memory_bandwidth=MEM_BW, slowdown={1: 1.0})
    assert cal.gather_overhead == pytest.approx(-1e-4, rel=1e-3)


def test_fit_cores_from_slowdown():
    assert fit_cores({1: 1.0, 2: 1.0, 4: 2.0}) == pytest.approx(2.0, abs=0.02)
    assert fit_cores({1: 1.0, 2: 1.5, 3: 2.25}) == pytest.approx(4 / 3, abs=0.02)


def test_calibration_round_trips_and_builds_the_local_preset(tmp_path):
    timings, coll = _synthetic()
    cal = fit(
        timings,
        coll,
        peak_flops=PEAK,
        memory_bandwidth=MEM_BW,
        slowdown={1: 1.0, 4: 2.0},
        machine={"cpu_count": 2, "loadavg": [0.1, 0.2, 0.3]},
    )
    path = cal.save(tmp_path / "cal.json")
    again = load_calibration(path)
    assert again == cal
    local = cluster_preset("local", 4, calibration=path)
    assert local.calibrated and local.n_devices == 4 and local.cores_per_node == again.cores
    assert local.step_overhead == pytest.approx(TRUE["step_overhead"], rel=1e-3)
    assert cluster_preset("local", 2, calibration=again).devices_per_node == 2
    with pytest.raises(ValueError, match="only the 'local' preset"):
        cluster_preset("h100", calibration=again)
    with pytest.raises(FileNotFoundError, match="bench/calibration.py"):
        load_calibration(tmp_path / "missing.json")


def test_from_hf_config_reads_a_llama_config():
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        num_hidden_layers=6,
        hidden_size=384,
        num_attention_heads=6,
        num_key_value_heads=6,
        intermediate_size=1024,
        vocab_size=262,
        model_type="llama",
    )
    assert ModelSpec.from_hf_config(cfg, "kit-10m") == MEDIUM
    assert MEDIUM.param_count == 10_823_040  # the tiny kit's exact count (workbench.models)


def _two_parallel_tasks(cores=None):
    g = TaskGraph()
    g.add("a", 2.0, (0, 1))
    g.add("b", 1.0, (1, 2))
    g.add("c", 1.0, (2, 3))
    return time_cost(g, None if cores is None else (4, cores))


def test_shared_cores_slow_concurrent_tasks_down():
    assert _two_parallel_tasks().makespan == 2.0
    assert _two_parallel_tasks(cores=4).end == _two_parallel_tasks().end
    # 3 busy devices on 2 cores: rate 2/3 until b and c end at 1.5; then a runs alone.
    s = _two_parallel_tasks(cores=2)
    assert s.end[1] == pytest.approx(1.5) and s.end[2] == pytest.approx(1.5)
    assert s.makespan == pytest.approx(2.5)


def test_shared_schedule_matches_list_scheduling_without_contention():
    g = TaskGraph()
    a = g.add("a", 1.0, (0, 2))
    b = g.add("b", 2.0, (0, 1), [a])
    c = g.add("c", 0.5, (1, 2), [a])
    g.add("d", 1.0, (0, 2), [b, c])
    g.add("e", 0.0, (), [a])
    plain, shared = time_cost(g), time_cost(g, (2, 2.0))
    assert shared.start == plain.start and shared.end == plain.end


def test_workload_of_a_timing_has_no_checkpointing_and_sharded_weights():
    t = Timing("train", SMALL, 16, 48, 0, 4, mini_batches=2)
    wl = Workload(
        batch_size=16,
        prompt_len=48,
        max_new_tokens=0,
        mini_batch_size=8,
        micro_batch_size=4,
        gradient_checkpointing=False,
        param_sharding="full",  # as the profiler's FSDP engine
    )
    assert t.workload() == wl and wl.mini_batches == 2


def test_fit_pins_a_zero_overhead_at_zero():
    timings, _ = _synthetic()
    truth = dataclasses.replace(_truth(), step_overhead=0.0)
    timings = [dataclasses.replace(t, seconds=t.predict(truth)) for t in timings]
    cal = fit(timings, _synthetic()[1], peak_flops=PEAK, memory_bandwidth=MEM_BW, slowdown={1: 1.0})
    assert cal.step_overhead == pytest.approx(0.0, abs=1e-9)
    assert cal.train_efficiency == pytest.approx(TRUE["train_efficiency"], rel=1e-3)


def test_fit_stays_inside_physical_bounds_when_decoding_is_overhead_bound():
    # Decoding that no bandwidth explains (all fixed cost): the unbounded fit would send the
    # decode rate to infinity; the bounded one pins it at EFFICIENCY_BOUNDS and moves the time
    # into the per-step overhead.
    from workbench.planner.calibrate import EFFICIENCY_BOUNDS

    truth = dataclasses.replace(_truth(), bandwidth_efficiency=1e6, step_overhead=4e-3)
    timings = [dataclasses.replace(t, seconds=t.predict(truth)) for t in _synthetic()[0]]
    cal = fit(timings, _synthetic()[1], peak_flops=PEAK, memory_bandwidth=MEM_BW, slowdown={1: 1.0})
    assert cal.bandwidth_efficiency <= EFFICIENCY_BOUNDS["bandwidth_efficiency"] * (1 + 1e-9)
    assert cal.train_efficiency <= EFFICIENCY_BOUNDS["train_efficiency"] * (1 + 1e-9)
    # The per-step overhead takes what the bounded read time does not explain (the reads now
    # cost a little of each step's 4 ms), and decoding is still predicted about as measured.
    assert 3e-3 < cal.step_overhead < 4e-3
    errors = [abs(p / m - 1) for label, m, p in cal.residuals() if label.startswith("generate")]
    assert sum(errors) / len(errors) < 0.1


def test_measured_fixed_costs_reach_the_local_preset():
    timings, coll = _synthetic()
    cal = fit(
        timings,
        coll,
        peak_flops=PEAK,
        memory_bandwidth=MEM_BW,
        slowdown={1: 1.0},
        kernel_latency=7e-6,
        call_overhead=3e-3,
    )
    local = cal.cluster(1, 4)
    assert (local.kernel_latency, local.call_overhead) == (7e-6, 3e-3)


def test_a_link_between_hosts_is_fitted_and_prices_cross_host_transfers(tmp_path):
    timings, coll = _synthetic()
    cal = fit(timings, coll, peak_flops=PEAK, memory_bandwidth=MEM_BW, slowdown={1: 1.0}, machine={})
    assert cal.inter_node_bandwidth == 0 and cal.cluster(2, 1).inter_node_bandwidth == cal.intra_node_bandwidth
    link = dataclasses.replace(_truth(), n_nodes=2, devices_per_node=1, inter_node_bandwidth=0.1e9)
    samples = [  # a rank on each of two hosts, as profiler.measure_link times them
        CollectiveTiming(n, 2, Simulator(link, Workload.tiny()).allreduce(n, 2, members_per_node=1))
        for n in (1 << 16, 1 << 20, 1 << 24)
    ]
    bandwidth = fit_link(samples, cal.collective_latency)
    assert bandwidth == pytest.approx(0.1e9, rel=0.01)
    cal = dataclasses.replace(cal, inter_node_bandwidth=bandwidth, links=samples)
    again = load_calibration(cal.save(tmp_path / "cal.json"))
    assert again == cal and again.cluster(2, 1).inter_node_bandwidth == bandwidth
    sim = Simulator(again.cluster(2, 1), Workload.tiny())
    assert sim.data_transfer_time(1e8, True) == pytest.approx(1e8 / bandwidth + again.collective_latency)
    assert sim.data_transfer_time(1e8, True) > 3 * sim.data_transfer_time(1e8, False)
