"""The simulator's data-parallel traffic under the two parameter-sharding modes."""

import dataclasses

import pytest

from workbench import Mesh
from workbench.planner import Problem, Simulator, Workload, cluster_preset, dataflow_preset, model_preset
from workbench.planner.automap import AutoMapper
from workbench.planner.memory import GRAD_BYTES, WEIGHT_BYTES
from workbench.planner.simulator import synced_tensors

SPEC = model_preset("tiny-10m")
OPT = Workload(
    batch_size=16,
    n=2,
    prompt_len=16,
    max_new_tokens=16,
    mini_batch_size=8,
    micro_batch_size=4,
    gradient_checkpointing=False,
)
FULL = dataclasses.replace(OPT, param_sharding="full")


def sims():
    cluster = cluster_preset("local", 4)
    return Simulator(cluster, OPT), Simulator(cluster, FULL)


def test_full_sharding_is_free_without_data_parallelism():
    opt, full = sims()
    one = Mesh(1, 1, 1)
    assert full.train(SPEC, one) == opt.train(SPEC, one)
    assert full.inference(SPEC, one) == opt.inference(SPEC, one)


def test_full_sharding_gathers_every_layer_per_micro_batch():
    opt, full = sims()
    dp2 = Mesh(1, 1, 2)
    # 32 sequences over 2 ranks, 4 optimizer steps: one micro-batch of 4 per step and rank;
    # 4 micro-batches per rank in a forward-only pass. 7 FSDP units (6 layers + root).
    # Weights move in the cluster's dtype (fp32 on the local CPU preset), gradients in fp32.
    units, p, w = SPEC.n_layers + 1, SPEC.param_count, full.dtype_bytes
    assert w == 4 and w != WEIGHT_BYTES
    train_ar = full.allreduce(p * (2 * w + GRAD_BYTES) / 2 * 4, 2, n_ops=3 * units * 4)
    optimizer_ar = opt.allreduce(p * (GRAD_BYTES + w) / 2 * 4, 2, n_ops=2 * 4)
    assert full.train(SPEC, dp2) - opt.train(SPEC, dp2) == pytest.approx(train_ar - optimizer_ar)
    infer_ar = full.allreduce(p * w / 2 * 4, 2, n_ops=units * 4)
    assert full.inference(SPEC, dp2) - opt.inference(SPEC, dp2) == pytest.approx(infer_ar)
    assert train_ar > optimizer_ar > 0


def test_frozen_models_gather_nothing_they_are_whole_on_every_rank():
    opt, full = sims()
    dp2 = Mesh(1, 1, 2)
    assert full.inference(SPEC, dp2, trained=False) == opt.inference(SPEC, dp2)
    assert full.inference(SPEC, dp2, trained=False) < full.inference(SPEC, dp2)


def test_generation_after_sharded_training_gathers_the_weights_first():
    opt, full = sims()
    dp2, one = Mesh(1, 1, 2), Mesh(1, 1, 1)
    # tensor by tensor, as the workers' sync gathers them
    gather = full.allreduce(SPEC.param_count * full.dtype_bytes / 2, 2, n_ops=synced_tensors(SPEC))
    assert full.reshard_time(SPEC, dp2, dp2) - opt.reshard_time(SPEC, dp2, dp2) == pytest.approx(gather)
    assert full.reshard_time(SPEC, one, one) == opt.reshard_time(SPEC, one, one)


def test_unknown_sharding_mode_is_refused():
    with pytest.raises(ValueError, match="param_sharding='fsdp'.*'optimizer'.*'full'"):
        dataclasses.replace(OPT, param_sharding="fsdp")


def test_small_per_device_work_stops_tensor_parallelism_from_always_winning():
    # 7B decoding its whole batch at once on 8 A100s: per-kernel, per-step and per-all-reduce
    # fixed costs make tp=8 lose to a smaller degree: they are a larger share of its time.
    spec, gpu = model_preset("llama2-7b"), cluster_preset("a100_80g", 8)
    ideal = dataclasses.replace(
        gpu, kernel_latency=0.0, step_overhead=0.0, collective_latency=0.0, sequence_overhead=0.0
    )
    times = {}
    for name, cluster in (("gpu", gpu), ("ideal", ideal)):
        sim = Simulator(cluster, Workload())
        times[name] = {tp: sim.generate(spec, Mesh(1, tp, 8 // tp)) for tp in (1, 2, 4, 8)}
    assert min(times["gpu"], key=times["gpu"].get) != 8, times
    share = {tp: 1 - times["ideal"][tp] / times["gpu"][tp] for tp in (1, 8)}
    assert share[8] > share[1] > 0


def test_fixed_costs_per_decoding_step_are_kernels_all_reduces_and_step_overhead():
    from workbench.planner.simulator import KERNELS_PER_LAYER

    spec, gpu = model_preset("llama2-7b"), cluster_preset("a100_80g", 8)
    bare = dataclasses.replace(gpu, kernel_latency=0.0, step_overhead=0.0)
    wl = Workload(batch_size=8)  # one wave of 8 sequences per replica at tp=1
    s = Mesh(1, 1, 1)
    extra = Simulator(gpu, wl).generate(spec, s) - Simulator(bare, wl).generate(spec, s)
    per_step = KERNELS_PER_LAYER * spec.n_layers * gpu.kernel_latency + gpu.step_overhead
    assert extra == pytest.approx((wl.max_new_tokens + 1) * per_step)


def test_collectives_cross_machines_where_the_runtime_puts_the_ranks(monkeypatch):
    # 2 machines of 8. Mesh(2, 2, 4) as the runtime lays it out: a replica (pp*tp = 4 ranks) is
    # consecutive, so its pipeline hop stays in a machine, and data-parallel peers are 4 ranks
    # apart, 2 per machine, so the gradient reduction crosses machines. (Megatron's order,
    # pipeline outermost, would be the other way round.)
    spec, cluster = model_preset("llama2-7b"), cluster_preset("a100_80g", 16)
    sim = Simulator(cluster, Workload())
    reductions, hops = [], []
    allreduce, link = sim.allreduce, sim.link_bandwidth

    def spy_allreduce(nbytes, group, n_ops=1, *, members_per_node=None):
        reductions.append((group, members_per_node))
        return allreduce(nbytes, group, n_ops, members_per_node=members_per_node)

    monkeypatch.setattr(sim, "allreduce", spy_allreduce)
    monkeypatch.setattr(sim, "link_bandwidth", lambda crosses: hops.append(crosses) or link(crosses))
    sim.train(spec, Mesh(2, 2, 4))
    assert (4, 2) in reductions and hops == [False]
    hops.clear()
    sim.train(spec, Mesh(4, 4, 1))  # one replica over both machines: its hops cross
    assert hops == [True]


def test_a_lora_weight_sync_moves_the_adapters_only():
    """Under LoRA the frozen base stays in the generation engine: a sync copies the adapters
    (gathered in one collective from FSDP shards), a reallocation sends only them."""
    opt, full = sims()
    lora = SPEC.with_lora(8)
    dp2, one = Mesh(1, 1, 2), Mesh(1, 1, 1)
    adapters = lora.adapter_params * full.dtype_bytes
    assert lora.synced_params == lora.adapter_params < SPEC.param_count == SPEC.synced_params
    assert opt.reshard_time(lora, one, one) == pytest.approx(opt.weight_copy_time(adapters))
    assert opt.reshard_time(lora, one, one) < opt.reshard_time(SPEC, one, one) * 0.2
    gather = full.allreduce(adapters / 2, 2, n_ops=1)
    assert full.reshard_time(lora, dp2, dp2) - opt.reshard_time(lora, dp2, dp2) == pytest.approx(gather)
    latency = opt.cluster.collective_latency * (SPEC.n_layers + 2)  # one per layer unit moved
    moved = opt.realloc_time(lora, dp2, (0, 2), one, (2, 3)) - latency
    assert moved == pytest.approx(
        (opt.realloc_time(SPEC, dp2, (0, 2), one, (2, 3)) - latency) * adapters / (SPEC.param_count * opt.dtype_bytes)
    )


def test_the_weight_push_broadcasts_what_the_rollout_holds_tensor_by_tensor():
    cluster = dataclasses.replace(
        cluster_preset("local", 4),
        intra_node_bandwidth=1e9,
        comm_efficiency=1.0,
        collective_latency=1e-3,
        memory_bandwidth=1e10,
        bandwidth_efficiency=1.0,
        dtype_bytes=4,
        broadcast_tree=False,  # NCCL's pipelined broadcast (gloo's tree: below)
    )
    opt, full = Simulator(cluster, OPT), Simulator(cluster, FULL)
    one, spec = Mesh(1, 1, 1), SPEC  # 6 layers: 9 tensors each + embedding, final norm, head
    nbytes = spec.param_count * 4
    sent = nbytes / 1e9 + 57 * 1e-3  # one latency per tensor
    loaded = 2 * nbytes / 1e10
    assert opt.weight_push_time(spec, one, one, False) == pytest.approx(sent + loaded)
    # three rollout ranks: a pipelined broadcast, each link carries the bytes once
    assert opt.weight_push_time(spec, one, Mesh(1, 1, 3), False) == pytest.approx(sent + loaded)
    # a rollout sharded over 2 tensor-parallel ranks loads half on each
    assert opt.weight_push_time(spec, one, Mesh(1, 2, 1), False) == pytest.approx(sent + loaded / 2)
    # pools on two machines: the network's share of one device
    across = opt.weight_push_time(spec, one, one, True)
    assert across == pytest.approx(nbytes / opt.link_bandwidth(True) + 57 * 1e-3 + loaded)
    # FSDP ranks first gather the whole weights onto rank 0: half an all-reduce's volume per tensor
    gather = nbytes / 2 / 1e9 + 57 * 1e-3
    assert full.weight_push_time(spec, Mesh(1, 1, 2), one, False) == pytest.approx(gather + sent + loaded)
    assert opt.weight_push_time(spec, Mesh(1, 1, 2), one, False) == pytest.approx(sent + loaded)  # rank 0 is whole
    lora = spec.with_lora(8)  # the adapters alone: A and B of 7 projections per layer
    adapters = lora.adapter_params * 4
    expected = adapters / 1e9 + 84 * 1e-3 + 2 * adapters / 1e10
    assert opt.weight_push_time(lora, one, one, False) == pytest.approx(expected)
    # gloo's binomial tree: 2 or 3 receivers take two sends in turn, 4 to 7 three
    tree = Simulator(dataclasses.replace(cluster, broadcast_tree=True), OPT)
    assert tree.weight_push_time(spec, one, one, False) == pytest.approx(sent + loaded)
    for receivers, levels in ((2, 2), (3, 2), (4, 3), (7, 3)):
        pushed = tree.weight_push_time(spec, one, Mesh(1, 1, receivers), False)
        assert pushed == pytest.approx(levels * sent + loaded), receivers


def test_the_pipeline_bubble_is_the_gpipe_schedules_the_runtime_runs(monkeypatch):
    """Training: a step's m micro-batches through one GPipe schedule, (p-1)/(m+p-1) of the step
    idle; scoring: one micro-batch at a time through the stages (workbench.engines.pipeline)."""
    import workbench.planner.simulator as simulator

    bubble = simulator.pipeline_bubble
    for pp, m in ((1, 4), (2, 1), (2, 4), (4, 8)):
        step = bubble(pp, m)  # in units of the bubble-free time
        assert (step - 1) / step == pytest.approx((pp - 1) / (m + pp - 1))
    seen = []
    monkeypatch.setattr(simulator, "pipeline_bubble", lambda pp, m: seen.append((pp, m)) or bubble(pp, m))
    opt, _ = sims()
    opt.train(SPEC, Mesh(2, 1, 1))
    opt.inference(SPEC, Mesh(2, 1, 1))
    # 32 sequences, 4 optimizer steps of 8 rows, micro-batches of 4: m = 2 per step
    assert seen == [(2, 2), (2, 1)]


@pytest.mark.parametrize(("model", "fastest"), [("llama2-7b", 2), ("llama2-13b", 4)])
def test_generation_tensor_parallelism_ranks_as_hybridflow_measured(model, fastest):
    # The actor trained 1-8-2 on 16 A100s (HybridFlow's generation-TP ablation): the smaller
    # generation TP wins, 2 for 7B and 4 for 13B, because every running sequence costs the
    # engine's host a little per step and a big TP replica runs many of them. Without that
    # per-sequence cost the planner ranks TP 8 fastest for both.
    flow = dataflow_preset("ppo")
    times = {}
    for cluster in (
        cluster_preset("a100_80g", 16),
        dataclasses.replace(cluster_preset("a100_80g", 16), sequence_overhead=0.0),
    ):
        mapper = AutoMapper(Problem(flow, model, Workload(), cluster))
        free = cluster.device_memory
        gen = {}
        for layout in mapper.layouts("actor", 16):
            if (layout.strategy.tp, layout.strategy.dp) == (8, 2) and layout.generation.pp == 1:
                choice = mapper._generating_choice("actor", layout, free - layout.static.total)
                gen[layout.generation.tp] = choice.call_times["gen"]
        times[cluster.sequence_overhead > 0] = gen
    assert set(times[True]) == {1, 2, 4, 8}
    assert min(times[True], key=times[True].get) == fastest, times[True]
    assert min(times[False], key=times[False].get) == 8, times[False]


def test_forwards_are_priced_with_each_repeated_prompt_computed_once_where_the_workers_do():
    # workbench.engines.forward.shared_prompt_logits: a micro-batch's rows that repeat a prompt
    # run it once where the saving is worth a second model call, so a training or scoring
    # forward computes prompt/n + response tokens a row.
    big = 1e10  # parameters: 16-32 prompt tokens saved per micro-batch of a 10B model, plenty
    assert OPT.forward_tokens(train=True, params=big) == 16 / 2 + 16
    assert OPT.forward_tokens(train=False, params=big) == 16 / 2 + 16
    assert OPT.forward_tokens(train=False, params=1e6) == 32  # a tiny model: not worth a second call
    assert OPT.forward_tokens(train=True, pp=2, params=big) == 32  # pipeline stages compute rows whole
    checkpointing = dataclasses.replace(OPT, gradient_checkpointing=True)
    assert (
        checkpointing.forward_tokens(True, params=big) == 32 and checkpointing.forward_tokens(False, params=big) == 24
    )
    four = dataclasses.replace(OPT, n=4, micro_batch_size=2)
    assert four.forward_tokens(train=True, params=big) == 16 / 2 + 16  # a micro-batch holds 2 of a prompt's 4 rows
    one = dataclasses.replace(OPT, n=1, batch_size=32)
    assert one.forward_tokens(train=True, params=big) == 32
    cluster = cluster_preset("local", 4)
    spec = model_preset("llama2-7b")
    shared, whole = Simulator(cluster, OPT), Simulator(cluster, one)  # the same 32 sequences
    m = Mesh(1, 1, 1)
    assert shared.train(spec, m) < whole.train(spec, m) and shared.inference(spec, m) < whole.inference(spec, m)
    assert Simulator(cluster, OPT).train(SPEC, m) == Simulator(cluster, one).train(SPEC, m)  # tiny-10m: rows whole


def test_pipelined_generation_saves_memory_not_time_and_pays_hops_and_the_logits():
    """The stages prefill and decode in turn (workbench.engines.pipelined_rollout): each costs what
    one device's does, plus pp-1 hops of the hidden states and a broadcast of the last stage's
    logits to every stage."""
    spec, gpu = model_preset("llama2-7b"), cluster_preset("a100_80g", 8)
    wl = Workload(batch_size=8)  # one wave of 8 sequences per replica
    sim = Simulator(gpu, wl)
    one, piped = sim.generate(spec, Mesh(1, 1, 1)), sim.generate(spec, Mesh(2, 1, 1))
    link = sim.link_bandwidth(False)
    hop = gpu.collective_latency + 8 * spec.hidden * sim.dtype_bytes / link
    logits = gpu.collective_latency + 8 * spec.vocab * sim.dtype_bytes / link
    prefill = gpu.collective_latency + 8 * wl.prompt_len * spec.hidden * sim.dtype_bytes / link + logits
    assert piped - one == pytest.approx(prefill + wl.max_new_tokens * (hop + logits))
    assert logits > hop  # a 32k vocabulary outweighs a 4k hidden state
