"""The hybrid engine's memory and transfer model equals HybridFlow Table 2 for all three
transition methods, and the generation memory and switch time are built from it."""

import pytest

from workbench import Mesh
from workbench.planner import Simulator, Workload, cluster_preset, model_preset
from workbench.planner.memory import (
    TRANSITION_METHODS,
    WEIGHT_BYTES,
    generation_memory,
    kv_bytes_per_sequence,
    static_memory,
    transition,
)
from workbench.planner.strategy import generation_strategies, strategies

SPEC = model_preset("llama2-13b")
M = SPEC.param_count * WEIGHT_BYTES


def table2(method, t, p, d, tg, pg):
    """Table 2 written out: (comm per device, peak parameter memory, redundancy)."""
    if method == "deepspeed_chat":
        return (t * p * d - 1) / (t * p * d) * M, M, M / (t * p * d)
    if method == "vanilla":
        return (t * p - 1) / (t * p) * M, M, M / (t * p)
    return (t * p - tg * pg) / (tg * pg * t * p) * M, M / (tg * pg), 0.0


LAYOUTS = [
    (train, gen)
    for n in (8, 16, 32)
    for train in strategies(SPEC, n, 8)
    for gen in generation_strategies(train)
    if (gen.tp, gen.pp) != (train.tp, train.pp)
]


@pytest.mark.parametrize("method", TRANSITION_METHODS)
def test_transition_bytes_and_memory_are_table_2(method):
    assert len(LAYOUTS) > 20
    for train, gen in LAYOUTS:
        tr = transition(SPEC, train, gen, method)
        comm, peak, redundant = table2(method, train.tp, train.pp, train.dp, gen.tp, gen.pp)
        assert (tr.comm_bytes, tr.peak_params, tr.redundant) == pytest.approx((comm, peak, redundant))
        assert tr.resident_params == pytest.approx(M / gen.model_parallel + redundant)


def test_hybridflow_moves_least_and_keeps_no_copy():
    for train, gen in LAYOUTS:
        hf, va, ds = (transition(SPEC, train, gen, m) for m in ("hybridflow", "vanilla", "deepspeed_chat"))
        assert hf.comm_bytes <= va.comm_bytes <= ds.comm_bytes
        assert hf.peak_params <= va.peak_params == ds.peak_params == M
        assert hf.redundant == 0 < ds.redundant <= va.redundant


def test_no_switch_when_generation_keeps_the_training_layout():
    s = Mesh(1, 4, 2)
    for method in ("hybridflow", "vanilla"):
        tr = transition(SPEC, s, s, method)
        assert tr.comm_bytes == 0 and tr.redundant == 0 and tr.peak_params == M / 4


@pytest.mark.parametrize("method", TRANSITION_METHODS)
def test_switch_time_is_table_2_bytes_over_the_link_plus_the_buffer_copy(method):
    # By all-gathers (the realloc executor's pricing: tests/planner/test_switch_pricing.py).
    cluster = cluster_preset("a100_80g", 16)
    sim = Simulator(cluster, Workload(transition=method, transition_executor="allgather"))
    train, gen = Mesh(1, 8, 2), Mesh(1, 2, 8)
    bytes_ = table2(method, 8, 1, 2, 2, 1)[0]
    crosses = method == "deepspeed_chat"  # its all-gather spans both machines
    copy = 2 * M / gen.model_parallel / (cluster.memory_bandwidth * cluster.bandwidth_efficiency)
    expected = bytes_ / sim.link_bandwidth(crosses) + cluster.collective_latency + copy
    assert sim.reshard_time(SPEC, train, gen) == pytest.approx(expected)


@pytest.mark.parametrize("method", TRANSITION_METHODS)
def test_generation_memory_is_redundancy_plus_shard_plus_kv(method):
    wl = Workload(transition=method)
    train, gen = Mesh(1, 8, 1), Mesh(1, 2, 4)
    static = static_memory(SPEC, train, True)
    free = 80e9 - static.total
    gm = generation_memory(SPEC, train, gen, wl, static.params, free, method)
    tr = transition(SPEC, train, gen, method)
    assert gm.extra_params == pytest.approx(tr.resident_params - static.params)
    assert gm.peak_extra == pytest.approx(max(0.0, tr.peak_params - static.params))
    per_seq = kv_bytes_per_sequence(SPEC, gen, wl)
    assert gm.concurrency == min(1024 // 4, int((free - gm.extra_params) // per_seq))
    assert gm.dynamic == pytest.approx(max(gm.peak_extra, gm.extra_params + gm.concurrency * per_seq))


def test_frozen_models_are_kept_like_the_workers_keep_them():
    # The reference and reward workers hold their model whole on every data-parallel rank,
    # cut only by tensor parallelism (backend "3d"), under either sharding mode.
    s = Mesh(1, 2, 4)
    for sharding in ("full", "optimizer"):
        assert static_memory(SPEC, s, False, sharding).params == pytest.approx(M / 2)
    trained = static_memory(SPEC, s, True, "full")
    assert trained.params == pytest.approx(M / 8) and trained.grads == pytest.approx(M / 8 * 2)


def test_frozen_models_kept_sharded_or_on_the_host_take_less_device_memory_and_pay_in_time():
    # Workload.frozen_keep (ActorConfig.reference_keep): FSDP shards keep 1/dp of a frozen
    # model per device and gather every layer per forward; host-kept shards keep none and also
    # copy their shard in per forward, at the host link's bandwidth.
    s = Mesh(1, 1, 8)
    assert static_memory(SPEC, s, False, "full", "sharded").params == pytest.approx(M / 8)
    assert static_memory(SPEC, s, False, "full", "host").params == 0
    assert static_memory(SPEC, s, True, "full", "host").params == pytest.approx(M / 8)  # trained: untouched
    # FSDP shards data-parallel layouts only: a tensor-parallel frozen model is kept whole, as the runtime does
    assert static_memory(SPEC, Mesh(1, 2, 4), False, "full", "host").params == pytest.approx(M / 2)
    cluster = cluster_preset("a100_80g", n_nodes=1)
    wl = Workload(batch_size=64, prompt_len=256, max_new_tokens=256, param_sharding="full")
    whole, sharded, host = (
        Simulator(cluster, Workload(**{**wl.__dict__, "frozen_keep": keep})).inference(SPEC, s, trained=False)
        for keep in ("whole", "sharded", "host")
    )
    assert whole < sharded < host
    # The host copy is this rank's shard (1/dp) per micro-batch forward.
    micro = -(-wl.batch_size // s.dp // wl.micro_batch_size)
    assert host - sharded == pytest.approx(micro * M / 8 / cluster.host_bandwidth, rel=1e-6)
    tp = Mesh(1, 2, 4)
    assert Simulator(cluster, Workload(**{**wl.__dict__, "frozen_keep": "host"})).inference(
        SPEC, tp, trained=False
    ) == pytest.approx(Simulator(cluster, wl).inference(SPEC, tp, trained=False))
    # Sharing prompts (GRPO's samples side by side) makes two model calls per micro-batch: two
    # gathers and two host copies.
    grpo = Workload(**{**wl.__dict__, "n": 4, "frozen_keep": "host"})
    assert grpo.shares_prompts(False, 1, SPEC.param_count)
    copies = Simulator(cluster, grpo).inference(SPEC, s, trained=False) - Simulator(
        cluster, Workload(**{**grpo.__dict__, "frozen_keep": "sharded"})
    ).inference(SPEC, s, trained=False)
    assert copies == pytest.approx(2 * micro * 4 * M / 8 / cluster.host_bandwidth, rel=1e-6)
    # A trained model's forward does not change with it, and one data-parallel rank gathers nothing.
    assert Simulator(cluster, Workload(**{**wl.__dict__, "frozen_keep": "host"})).inference(SPEC, s) == pytest.approx(
        Simulator(cluster, wl).inference(SPEC, s)
    )
    one = Mesh(1, 2, 1)
    assert Simulator(cluster, Workload(**{**wl.__dict__, "frozen_keep": "sharded"})).inference(
        SPEC, one, trained=False
    ) == pytest.approx(Simulator(cluster, wl).inference(SPEC, one, trained=False))
    with pytest.raises(ValueError, match="frozen_keep='disk'"):
        Workload(frozen_keep="disk")


def test_lora_keeps_gradients_and_adam_states_for_the_adapters_only():
    full, lora = SPEC, SPEC.with_lora(16)
    assert lora.param_count == full.param_count and lora.trainable_params == lora.adapter_params
    # r·(in + out) per projection: q, o (h→h), k, v (h→kv), gate, up (h→I), down (I→h)
    h, i = SPEC.hidden, SPEC.intermediate
    assert lora.adapter_params == SPEC.n_layers * 16 * (4 * 2 * h + 3 * (h + i))  # no GQA: kv = h
    s = Mesh(1, 1, 8)
    for sharding in ("optimizer", "full"):
        a, b = static_memory(full, s, True, sharding), static_memory(lora, s, True, sharding)
        assert b.grads == pytest.approx(a.grads * lora.trainable_params / full.param_count)
        assert b.optimizer == pytest.approx(a.optimizer * lora.trainable_params / full.param_count)
        assert b.static < a.static / 2  # the goal for an actor process, here in the model
    assert static_memory(full.with_lora(0), s, True) == static_memory(full, s, True)
    assert static_memory(lora, s, False) == static_memory(full, s, False)  # frozen: nothing changes
    critic = SPEC.as_value_model().with_lora(8)
    assert critic.trainable_params == critic.adapter_params + critic.hidden  # the new value head trains whole
    with pytest.raises(ValueError, match=r"with_lora\(rank=-1\)"):
        SPEC.with_lora(-1)
