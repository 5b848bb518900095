import dataclasses

import pytest

from workbench import Mesh
from workbench.planner import (
    Call,
    Dataflow,
    DeviceRange,
    ExecutionPlan,
    NoMeshError,
    PlanEvaluator,
    Problem,
    Workload,
    cluster_preset,
    dataflow_preset,
    mesh,
    valid_meshes,
)
from workbench.planner.memory import generation_weights, static_memory

S1 = Mesh(1, 1, 1)


def test_valid_meshes_are_node_divisors_or_whole_nodes():
    c = cluster_preset("a100_80g", 16)
    ms = valid_meshes(c)
    # Per machine: 8 + 4 + 2 + 1 aligned slices; plus the two machines together.
    assert len(ms) == 2 * 15 + 1
    assert DeviceRange(0, 16) in ms and DeviceRange(4, 4) in ms and DeviceRange(2, 4) not in ms
    assert mesh(c, 8, 8) == DeviceRange(8, 8)
    with pytest.raises(NoMeshError, match="12"):
        mesh(c, 12)
    with pytest.raises(NoMeshError):
        mesh(c, 4, 2)


def _two_model_flow():
    return Dataflow(
        "toy",
        (
            Call("gen", "actor", "generate"),
            Call("score", "rm", "inference", ("gen",)),
            Call("train", "actor", "train", ("score",)),
        ),
        value_models=("rm",),
    )


def _scored_beside_training():
    """The actor generates, then trains while a frozen scoring model scores the generation."""
    return Dataflow(
        "toy",
        (
            Call("gen", "actor", "generate"),
            Call("train", "actor", "train", ("gen",)),
            Call("score", "rm", "inference", ("gen",)),
        ),
        value_models=("rm",),
    )


def test_consecutive_iterations_overlap_when_dependencies_allow(tiny_workload):
    # Actor on d0-1, a frozen scoring model on d2-3. Iteration 1's generation needs only
    # iteration 0's actor update, not iteration 0's score, so (as ReaLHF's runtime runs them)
    # the score of one iteration runs beside the actor's calls of the same or the next one.
    flow = _scored_beside_training()
    cluster = cluster_preset("local")
    ev = PlanEvaluator(Problem(flow, "tiny-10m", tiny_workload, cluster), n_iterations=2, overlap_iterations=True)
    p2 = Mesh(1, 1, 2)
    plan = ExecutionPlan(
        {"gen": (DeviceRange(0, 2), p2), "train": (DeviceRange(0, 2), p2), "score": (DeviceRange(2, 2), p2)}
    )
    r = ev.evaluate(plan)
    names = [t.name for t in r.graph.tasks]
    at = {n: i for i, n in enumerate(names)}
    start, end = r.schedule.start, r.schedule.end
    g, t = end[at["gen@0"]] - start[at["gen@0"]], end[at["train@0"]] - start[at["train@0"]]
    d = end[at["data gen->score@0"]] - start[at["data gen->score@0"]]
    i = end[at["score@0"]] - start[at["score@0"]]
    # Hand schedule: gen0 [0,g]; train0 [g,g+t]; score0 [g+d, g+d+i] on the other mesh;
    # gen1 [g+t, 2g+t]; train1 [2g+t, 2g+2t]; score1 after gen1 + transfer.
    assert start[at["train@0"]] == pytest.approx(g)
    assert start[at["score@0"]] == pytest.approx(g + d)
    assert start[at["gen@1"]] == pytest.approx(g + t)
    assert start[at["score@1"]] == pytest.approx(2 * g + t + d)
    assert r.makespan == pytest.approx(max(2 * g + 2 * t, 2 * g + t + d + i))
    assert r.time == pytest.approx(r.makespan / 2)
    # No parameter transfer: every actor call uses the home layout.
    assert not any(x.kind == "param" for x in r.graph.tasks)


def test_a_synchronous_step_ends_before_the_next_one_starts(tiny_workload):
    """The workbench's algorithms return a step's metrics before the driver issues the next
    step: no call of iteration 1 (nor its weight push) starts before every call of iteration 0
    has ended, and the iteration is the sum of the steps' critical paths."""
    flow = _scored_beside_training()
    cluster, specs = cluster_preset("local", 4), flow.model_specs("tiny-10m")
    # A deeper scoring model: its score outlasts the actor's update, so the next generation
    # could start before it ends if steps overlapped.
    specs["rm"] = dataclasses.replace(specs["rm"], n_layers=specs["rm"].n_layers * 8)
    plan = ExecutionPlan(
        {
            "gen": (DeviceRange(2, 1), S1),  # a copy of the actor: pushed every step
            "train": (DeviceRange(0, 2), Mesh(1, 1, 2)),
            "score": (DeviceRange(3, 1), S1),
        }
    )
    problem = Problem(flow, specs, tiny_workload, cluster)
    sync = PlanEvaluator(problem, n_iterations=2).evaluate(plan)
    overlapped = PlanEvaluator(problem, n_iterations=2, overlap_iterations=True).evaluate(plan)
    tasks, start, end = sync.graph.tasks, sync.schedule.start, sync.schedule.end
    last_of_0 = max(end[i] for i, t in enumerate(tasks) if t.iteration == 0)
    first_of_1 = min(start[i] for i, t in enumerate(tasks) if t.iteration == 1)
    assert first_of_1 >= last_of_0 > 0
    assert [t.name for t in tasks if t.kind == "param" and t.iteration == 1] == ["push actor->d2@1"]
    assert sync.makespan == pytest.approx(2 * last_of_0)
    ran = {t.name: i for i, t in enumerate(overlapped.graph.tasks)}
    assert overlapped.schedule.start[ran["gen@1"]] < overlapped.schedule.end[ran["score@0"]]
    assert overlapped.makespan < sync.makespan


def test_parameter_transfer_when_layouts_differ(tiny_workload):
    flow = _two_model_flow()
    ev = PlanEvaluator(Problem(flow, "tiny-10m", tiny_workload, cluster_preset("local")), n_iterations=2)
    plan = ExecutionPlan(
        {
            "gen": (DeviceRange(0, 4), Mesh(1, 1, 4)),
            "score": (DeviceRange(0, 4), Mesh(1, 1, 4)),
            "train": (DeviceRange(0, 2), Mesh(1, 2, 1)),
        }
    )
    r = ev.evaluate(plan)
    params = [(i, x) for i, x in enumerate(r.graph.tasks) if x.kind == "param"]
    # A data-parallel copy of the trained actor, as the runtime makes one: its weights pushed
    # through a weight channel after each update.
    assert [x.name for _, x in params] == ["push actor->d0-3@0", "push actor->d0-3@1"]
    spec = ev.specs["actor"]
    assert params[0][1].cost == pytest.approx(ev.sim.weight_push_time(spec, Mesh(1, 2, 1), Mesh(1, 1, 4), False))
    i1, p1 = params[1]
    train0 = [x.name for x in r.graph.tasks].index("train@0")
    step0 = [x.name for x in r.graph.tasks].index("step@0 returns")
    assert p1.parents == (train0, step0)
    assert r.schedule.start[i1] >= r.schedule.end[train0]
    # A tensor-parallel copy, which only ReaLHF's runtime makes: its layer-by-layer reallocation.
    plan.layouts["gen"] = (DeviceRange(0, 4), Mesh(1, 2, 2))
    [tp_copy] = [x for x in ev.evaluate(plan).graph.tasks if x.kind == "param" and x.iteration == 0]
    assert tp_copy.name == "realloc actor->gen@0"
    assert tp_copy.cost == pytest.approx(ev.sim.realloc_time(spec, Mesh(1, 2, 1), (0, 2), Mesh(1, 2, 2), (0, 4)))


def test_a_critics_replica_is_priced_as_its_reallocation_from_every_home_rank(tiny_workload):
    """The critic's values on a data-parallel copy: reallocated into after each update (the
    runtime's WeightLink for FSDP critics), every home rank sending its share of the copy's
    ranks, so a two-rank home sends half of what a one-rank home sends to a two-rank copy."""
    flow = dataflow_preset("ppo")
    ev = PlanEvaluator(Problem(flow, "tiny-10m", tiny_workload, cluster_preset("local", 4)), n_iterations=1)
    layouts = {c.name: (DeviceRange(0, 2), Mesh(1, 1, 2)) for c in flow.calls}
    layouts["values"] = (DeviceRange(2, 2), Mesh(1, 1, 2))
    [task] = [x for x in ev.evaluate(ExecutionPlan(layouts)).graph.tasks if x.kind == "param"]
    spec, copy = ev.specs["critic"], Mesh(1, 1, 2)
    assert task.name == "realloc critic->d2-3@0" and task.devices == ((0, 2), (2, 4))
    assert task.cost == pytest.approx(ev.sim.replica_realloc_time(spec, Mesh(1, 1, 2), copy, False))
    one, two = (ev.sim.replica_realloc_time(spec, Mesh(1, 1, n), copy, False) for n in (1, 2))
    sends = spec.param_count * ev.sim.dtype_bytes / ev.sim.link_bandwidth(False)
    gathers = ev.sim._gather_time(spec, Mesh(1, 1, 2)) - ev.sim._gather_time(spec, Mesh(1, 1, 1))
    assert one - two == pytest.approx(sends - gathers)
    # A DeepSpeed critic's replica takes the broadcast (reallocation reads FSDP and "3d" homes).
    deepspeed = dataclasses.replace(tiny_workload, broadcast_homes=("critic",))
    ev = PlanEvaluator(Problem(flow, "tiny-10m", deepspeed, cluster_preset("local", 4)), n_iterations=1)
    [task] = [x for x in ev.evaluate(ExecutionPlan(layouts)).graph.tasks if x.kind == "param"]
    assert task.name == "push critic->d2-3@0"
    assert task.cost == pytest.approx(ev.sim.weight_push_time(spec, Mesh(1, 1, 2), copy, False))


def test_a_tensor_parallel_replica_is_kept_and_priced_as_its_reallocation(tiny_workload):
    """The critic's values on a tensor-parallel copy (p1t2d1) on other devices: the runtime keeps
    it (its pieces are static memory there) and reallocates into it after each update; the
    busiest home rank sends what the runtime's transfer plan gives it (`realloc_bytes`)."""
    flow = dataflow_preset("ppo")
    ev = PlanEvaluator(Problem(flow, "tiny-10m", tiny_workload, cluster_preset("local", 4)), n_iterations=1)
    layouts = {c.name: (DeviceRange(0, 2), Mesh(1, 1, 2)) for c in flow.calls}
    layouts["values"] = (DeviceRange(2, 2), Mesh(1, 2, 1))
    plan = ExecutionPlan(layouts)
    assert ev._copy_of(flow.call("values"), plan) == "replica"
    [task] = [x for x in ev.evaluate(plan).graph.tasks if x.kind == "param"]
    spec, home, tp = ev.specs["critic"], Mesh(1, 1, 2), Mesh(1, 2, 1)
    assert task.name == "realloc critic->d2-3@0"
    assert task.cost == pytest.approx(ev.sim.replica_realloc_time(spec, home, tp, False))
    # each home rank sends one tensor-parallel rank its pieces: less than a whole copy
    dp = ev.sim.replica_realloc_time(spec, home, Mesh(1, 1, 2), False)
    assert task.cost < dp
    static, *_ = ev.memory(plan)
    layouts["values"] = (DeviceRange(0, 2), Mesh(1, 1, 2))  # at home: no copy on d2-3
    at_home, *_ = ev.memory(ExecutionPlan(layouts))
    assert static[2] - at_home[2] == pytest.approx(generation_weights(spec, tp))
    # a tensor-parallel home sends its own pieces (no gather); a pipeline-parallel one broadcasts
    for c in ("values", "update_critic"):
        layouts[c] = (DeviceRange(0, 2), tp if c == "update_critic" else Mesh(1, 1, 2))
    layouts["values"] = (DeviceRange(2, 2), Mesh(1, 1, 2))
    [task] = [x for x in ev.evaluate(ExecutionPlan(layouts)).graph.tasks if x.kind == "param"]
    assert task.cost == pytest.approx(ev.sim.replica_realloc_time(spec, tp, Mesh(1, 1, 2), False))
    assert ev.sim._gather_time(spec, tp) > 0  # what the pieces save
    layouts["update_critic"] = (DeviceRange(0, 2), Mesh(2, 1, 1))
    [task] = [x for x in ev.evaluate(ExecutionPlan(layouts)).graph.tasks if x.kind == "param"]
    assert task.name == "push critic->d2-3@0"
    assert task.cost == pytest.approx(ev.sim.weight_push_time(spec, Mesh(2, 1, 1), Mesh(1, 1, 2), False))


def test_a_rollout_group_is_priced_as_the_workload_moves_its_weights(tiny_workload):
    """The actor's generation on a data-parallel copy (a rollout group) on other devices: the
    broadcast from the trainer's rank 0 by default; with Workload.rollout_weights="reallocate",
    the reallocation from every trainer rank (AlgoConfig.rollout_weights), which a two-rank
    trainer halves the sends of; under LoRA the adapters are broadcast either way."""
    flow = dataflow_preset("ppo")
    layouts = {c.name: (DeviceRange(0, 2), Mesh(1, 1, 2)) for c in flow.calls}
    layouts["gen"] = (DeviceRange(2, 2), Mesh(1, 1, 2))
    trainer = copy = Mesh(1, 1, 2)

    def push(workload, specs=None):
        ev = PlanEvaluator(Problem(flow, specs or "tiny-10m", workload, cluster_preset("local", 4)), 1)
        [task] = [x for x in ev.evaluate(ExecutionPlan(layouts)).graph.tasks if x.kind == "param"]
        return task, ev.sim, ev.specs["actor"]

    task, sim, spec = push(tiny_workload)
    assert task.name == "push actor->d2-3@0"
    assert task.cost == pytest.approx(sim.weight_push_time(spec, trainer, copy, False))
    reallocating = dataclasses.replace(tiny_workload, rollout_weights="reallocate")
    task, sim, spec = push(reallocating)
    assert task.name == "realloc actor->d2-3@0"
    assert task.cost == pytest.approx(sim.replica_realloc_time(spec, trainer, copy, False))
    assert task.cost != pytest.approx(sim.weight_push_time(spec, trainer, copy, False))
    lora = {m: s.with_lora(8) if m == "actor" else s for m, s in flow.model_specs("tiny-10m").items()}
    task, sim, spec = push(reallocating, lora)
    assert task.name == "push actor->d2-3@0"
    assert task.cost == pytest.approx(sim.weight_push_time(spec, trainer, copy, False))
    # where the runtime cannot reallocate (a tensor- or pipeline-parallel trainer), the broadcast
    assert not any(sim.rollout_reallocates(spec, m) for m in (Mesh(1, 2, 1), Mesh(2, 1, 1)))
    assert sim.rollout_push_time(spec, Mesh(1, 2, 1), copy, False) == sim.weight_push_time(
        spec, Mesh(1, 2, 1), copy, False
    )
    # nor out of an actor another backend trains (Workload.broadcast_homes, from the run's configs)
    task, sim, spec = push(dataclasses.replace(reallocating, broadcast_homes=("actor",)))
    assert task.name == "push actor->d2-3@0" and not sim.rollout_reallocates(spec, trainer, "actor")
    with pytest.raises(ValueError, match="rollout_weights='scatter'"):
        dataclasses.replace(tiny_workload, rollout_weights="scatter")


def _scored_twice():
    """The actor generates, a frozen scoring model scores twice, the actor trains."""
    return Dataflow(
        "toy",
        (
            Call("gen", "actor", "generate"),
            Call("score", "rm", "inference", ("gen",)),
            Call("rescore", "rm", "inference", ("score",)),
            Call("train", "actor", "train", ("rescore",)),
        ),
        value_models=("rm",),
    )


def test_a_frozen_models_copy_moves_nothing_per_iteration(tiny_workload):
    """A frozen model's second call elsewhere reads a copy loaded once: no per-iteration move,
    whatever its layout; a trained model's copy is pushed every iteration."""
    flow = _scored_twice()
    ev = PlanEvaluator(Problem(flow, "tiny-10m", tiny_workload, cluster_preset("local", 4)), n_iterations=2)
    layouts = {c.name: (DeviceRange(0, 2), Mesh(1, 1, 2)) for c in flow.calls}
    layouts["rescore"] = (DeviceRange(2, 2), Mesh(1, 2, 1))
    assert not [x for x in ev.evaluate(ExecutionPlan(layouts)).graph.tasks if x.kind == "param"]
    layouts["gen"] = (DeviceRange(2, 2), Mesh(1, 1, 2))
    moved = [x.name for x in ev.evaluate(ExecutionPlan(layouts)).graph.tasks if x.kind == "param"]
    assert moved == ["push actor->d2-3@0", "push actor->d2-3@1"]


def test_the_copies_the_runtime_keeps_are_static_memory(tiny_workload):
    """A copy the runtime keeps between calls (a frozen model's, a rollout group's) is static on
    its devices, counted once however many calls read it; a layout only ReaLHF's reallocation
    moves into holds its weights for the call alone."""
    flow = _scored_twice()
    specs = flow.model_specs("tiny-10m")
    ev = PlanEvaluator(Problem(flow, specs, tiny_workload, cluster_preset("local", 4)))
    home, apart = (DeviceRange(0, 2), Mesh(1, 1, 2)), (DeviceRange(2, 2), Mesh(1, 1, 2))
    colocated = ExecutionPlan({c.name: home for c in flow.calls})
    static0, dyn0, _ = ev.memory(colocated)
    assert static0[2:] == [0.0, 0.0]
    whole = {m: static_memory(specs[m], S1, False).params for m in ("actor", "rm")}
    copies = ExecutionPlan({**colocated.layouts, "gen": apart, "rescore": apart})
    static, dyn, _ = ev.memory(copies)
    assert static[:2] == static0[:2]
    assert static[2:] == [pytest.approx(whole["actor"] + whole["rm"])] * 2
    assert dyn[2] < whole["actor"]  # the KV cache and activations only
    # The actor's generation tensor-parallel on other devices: reallocated in for the call.
    realloc = ExecutionPlan({**colocated.layouts, "gen": (DeviceRange(2, 2), Mesh(1, 2, 1))})
    static, dyn, _ = ev.memory(realloc)
    assert static[2:] == [0.0, 0.0] and dyn[2] > whole["actor"] / 2


def test_max_mem_and_oom_penalty():
    flow = dataflow_preset("ppo")
    cluster = cluster_preset("a100_80g", 8)
    ev = PlanEvaluator(Problem(flow, "llama2-7b", Workload(), cluster))
    one = ExecutionPlan({c.name: (DeviceRange(0, 1), S1) for c in flow.calls})
    r = ev.evaluate(one)
    assert r.oom and r.max_mem > cluster.device_memory
    assert r.cost == pytest.approx(r.time * 10 * r.max_mem / cluster.device_memory)
    spread = ExecutionPlan({c.name: (DeviceRange(0, 8), Mesh(1, 8, 1)) for c in flow.calls})
    r2 = ev.evaluate(spread)
    assert not r2.oom and r2.cost == r2.time and r2.max_mem < r.max_mem


def test_automap_plan_scores_as_execution_plan():
    from workbench.planner import automap

    flow = dataflow_preset("ppo")
    cluster = cluster_preset("a100_80g", 16)
    problem = Problem(flow, "llama2-7b", Workload(), cluster)
    plan = automap(problem)
    ev = PlanEvaluator(problem, n_iterations=1)
    r = ev.evaluate(plan.to_execution_plan())
    assert not r.oom
    # One iteration, no cross-iteration overlap: TimeCost cannot exceed the stage model.
    assert r.time <= plan.iteration_time * 1.0001


def test_driver_stage_and_dispatch_are_tasks_of_the_iteration(tiny_workload):
    # Everything on one device: the makespan grows by the driver stage (gather the outputs,
    # send the batch to both trained models) and by the dispatches on the critical path (the
    # driver issues calls as futures, so a dispatch overlaps a call already running).
    import dataclasses

    flow = dataflow_preset("ppo")
    base = cluster_preset("local", 1)
    slow = dataclasses.replace(base, call_overhead=0.01, driver_bandwidth=1e8)
    one = ExecutionPlan({c.name: (DeviceRange(0, 1), S1) for c in flow.calls})
    evs = [
        PlanEvaluator(Problem(flow, "tiny-10m", tiny_workload, c), n_iterations=1).evaluate(one) for c in (base, slow)
    ]
    kinds = [t.kind for t in evs[1].graph.tasks]
    assert kinds.count("driver") == 1 and kinds.count("dispatch") == len(flow.calls)
    sim = evs[1].graph  # the driver task waits for every call the updates read
    driver = next(t for t in sim.tasks if t.kind == "driver")
    assert {sim.tasks[p].call for p in driver.parents} == {"gen", "old_log_prob", "ref", "values", "reward"}
    grown = evs[1].makespan - evs[0].makespan
    assert driver.cost + 0.01 - 1e-9 <= grown <= driver.cost + len(flow.calls) * 0.01 + 1e-9
    assert driver.cost > 0


def test_a_generation_layout_on_the_trained_models_devices_costs_the_hybrid_engine_switch():
    # Reallocation's special case: the actor generating at t_g | t on its own devices switches
    # through the 3D-HybridEngine (Table 2's bytes), as the runtime does, not through a general
    # reallocation into a copy; on other devices, or at a layout it cannot switch to, it is one.
    flow = dataflow_preset("ppo")
    cluster = cluster_preset("a100_80g", 16)
    ev = PlanEvaluator(Problem(flow, "llama2-7b", Workload(), cluster), n_iterations=1)
    spec, everywhere, train = ev.specs["actor"], DeviceRange(0, 16), Mesh(1, 8, 2)

    def param_task(gen_mesh, gen):
        layouts = {c.name: (everywhere, train) for c in flow.calls}
        layouts["gen"] = (gen_mesh, gen)
        graph = ev.evaluate(ExecutionPlan(layouts)).graph
        return next(t for t in graph.tasks if t.kind == "param" and t.call == "gen")

    switch = param_task(everywhere, Mesh(1, 2, 8))
    assert switch.cost == pytest.approx(ev.sim.reshard_time(spec, train, Mesh(1, 2, 8)))
    assert switch.cost < ev.sim.realloc_time(spec, train, (0, 16), Mesh(1, 2, 8), (0, 16))
    moved = param_task(DeviceRange(0, 8), Mesh(1, 2, 4))  # half the devices: reallocated
    assert moved.cost == pytest.approx(ev.sim.realloc_time(spec, train, (0, 16), Mesh(1, 2, 4), (0, 8)))
