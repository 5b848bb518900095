"""The asynchronous plan's iteration model, on hand-computed cases."""

import pytest

from workbench.planner.asynchronous import (
    COST_MODEL,
    MEASURED,
    Sharing,
    estimate,
    from_measured,
    hosted_iteration,
    schedule,
    steady_iteration,
    trainer_seconds,
)

G, T, W = 2.0, 3.0, 0.5  # generation, trainer side, push: trainer-bound


def test_staleness_zero_is_the_sequential_split_iteration():
    assert steady_iteration(G, T, W, 0) == pytest.approx(5.5)
    run = estimate(G, T, W, 0, iterations=4)
    assert run.total_s == pytest.approx(22.0)  # push, gen, train; x4
    assert run.sequential_s == pytest.approx(run.iteration_s)
    assert run.idle_rollout == pytest.approx(3.0 / 5.5)  # waits while the trainer trains
    assert run.idle_trainer == pytest.approx(2.0 / 5.5)  # waits while the rollout generates


@pytest.mark.parametrize("staleness", [1, 2, 5])
def test_overlap_costs_the_slower_side_plus_the_push(staleness):
    assert steady_iteration(G, T, W, staleness) == pytest.approx(3.5)
    assert steady_iteration(4.0, T, W, staleness) == pytest.approx(4.5)
    run = estimate(G, T, W, staleness, iterations=10)
    assert run.bottleneck == "trainer"
    assert run.idle_trainer == pytest.approx(0.0)
    assert run.idle_rollout == pytest.approx(1 - 2.5 / 3.5)
    assert run.overlap_gain == pytest.approx(5.5 / 3.5)
    generation_bound = estimate(4.0, T, W, staleness, iterations=10)
    assert generation_bound.bottleneck == "rollout"
    assert generation_bound.idle_trainer == pytest.approx(1 - 3.5 / 4.5)


@pytest.mark.parametrize(
    "g, staleness, total",
    [
        # Trainer-bound, 10 iterations. s=1: push [0,.5], gen0 [.5,2.5], gen1 [2.5,4.5], train0
        # [2.5,5.5], push0 [5.5,6], then 3.5 s per update: 6 + 8*3.5 + 3 = 37.
        (2.0, 1, 37.0),
        # s=2: the first push queues behind gen2 [4.5,6.5]: push0 [6.5,7], one second later.
        (2.0, 2, 38.0),
        (2.0, 5, 44.0),  # push0 behind gen5, which ends at .5 + 6*2 = 12.5
        # Generation-bound (g=4): s=1: push0 after gen1 [4.5,8.5], then 4.5 s per update.
        (4.0, 1, 48.0),
        (4.0, 2, 52.0),
    ],
)
def test_a_run_pays_the_fill_and_the_staleness_bound_decides_the_first_push(g, staleness, total):
    run = estimate(g, T, W, staleness, iterations=10)
    assert run.total_s == pytest.approx(total)
    # the closed form of the module docstring
    closed = 2 * W + max(g + T, (staleness + 1) * g) + 8 * (max(g, T) + W) + T
    assert run.total_s == pytest.approx(closed)
    assert run.mean_iteration_s == pytest.approx(total / 10)


def test_one_iteration_overlaps_nothing_and_the_first_push_is_optional():
    for s in (0, 1, 3):
        assert estimate(G, T, W, s).total_s == pytest.approx(W + G + T)
        assert estimate(G, T, W, s, initial_push=False).total_s == pytest.approx(G + T)


def test_the_schedule_follows_the_runtime_order():
    spans = schedule(G, T, W, 2, iterations=4)
    by = {(sp.side, sp.iteration): sp for sp in spans}
    # batches 0..s are launched at once; the rollout runs them back to back
    assert [by["rollout", j].start for j in range(3)] == pytest.approx([0.5, 2.5, 4.5])
    for k in range(3):  # the push after update k waits for update k and for batch k+s, and blocks both
        push = by["push", k]
        assert push.start == pytest.approx(max(by["trainer", k].end, by["rollout", k + 2].end))
        assert by["trainer", k + 1].start == pytest.approx(max(push.end, by["rollout", k + 1].end))
        assert by["rollout", k + 3].start == pytest.approx(push.end)
    assert ("push", 3) not in by  # the run ends with the last update
    assert ("rollout", 5) in by  # generations launched for batches past the run still run


def test_shared_cores_slow_both_sides_while_they_overlap():
    # Two devices on 1.5 cores: alone each runs at full speed, together at 0.75. Generation's
    # 2 s of work ends at 2/0.75 = 2.667 s; the trainer then has 1 s left alone: 3.667 + push.
    two = Sharing(cores=1.5)
    assert steady_iteration(G, T, W, 1, sharing=two) == pytest.approx(2 / 0.75 + 1 + W)
    assert steady_iteration(G, T, W, 0, sharing=two) == pytest.approx(G + T + W)  # one side at a time
    assert steady_iteration(G, T, W, 1, sharing=Sharing(cores=2.0)) == pytest.approx(3.5)  # enough cores
    run = estimate(G, T, W, 1, iterations=12, sharing=two)
    ends = sorted(sp.end for sp in run.spans if sp.side == "trainer")
    assert ends[-1] - ends[-2] == pytest.approx(run.iteration_s)  # TimeCost's sharing agrees
    assert run.idle_trainer == pytest.approx(0.0)
    assert run.idle_rollout == pytest.approx(1 - (2 / 0.75 + W) / run.iteration_s)


def test_trainer_side_calls_on_one_pool_take_turns_and_sets_run_side_by_side_per_level():
    calls = {"old_log_prob": 1.0, "ref": 0.5, "values": 0.25, "update_critic": 2.0, "update_actor": 3.0}
    assert trainer_seconds(calls) == pytest.approx(6.75)
    levels = {"old_log_prob": 1, "ref": 1, "values": 1, "update_critic": 2, "update_actor": 2}
    sets = [("old_log_prob", "ref", "update_actor"), ("values", "update_critic")]
    assert trainer_seconds(calls, sets, levels) == pytest.approx(max(1.5, 0.25) + max(3.0, 2.0))
    with pytest.raises(ValueError, match="dependency levels"):
        trainer_seconds(calls, sets)
    with pytest.raises(ValueError, match="exactly one set"):
        trainer_seconds(calls, [("old_log_prob",)], levels)


def test_from_measured_call_times_and_the_source_is_named():
    calls = {"gen": 2.0, "old_log_prob": 0.5, "update_actor": 2.0}
    run = from_measured(calls, W, 1, iterations=3, other_s=0.5)
    assert (run.generate_s, run.train_s, run.push_s) == pytest.approx((2.0, 3.0, 0.5))
    assert run.iteration_s == pytest.approx(3.5) and run.source == MEASURED
    assert estimate(G, T, W, 1, source=COST_MODEL).source == COST_MODEL
    with pytest.raises(ValueError, match="generation call"):
        from_measured({"update_actor": 1.0}, W, 1)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="max_staleness"):
        steady_iteration(1.0, 1.0, 0.0, -1)
    with pytest.raises(ValueError, match=">= 0"):
        estimate(1.0, -1.0, 0.0, 1)
    with pytest.raises(ValueError, match="iterations"):
        estimate(1.0, 1.0, 0.0, 1, iterations=0)
    with pytest.raises(ValueError, match="source"):
        estimate(1.0, 1.0, 0.0, 1, source="guess")
    with pytest.raises(ValueError, match="cores"):
        Sharing(cores=0)


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_a_rollout_pool_hosting_nothing_is_the_split_model(staleness):
    for g in (0.5, 2.0, 6.0):
        levels = [(1.0, 0.0), (2.0, 0.0)]  # the trainer's two levels, 3 s
        assert hosted_iteration(g, levels, W, staleness) == pytest.approx(steady_iteration(g, 3.0, W, staleness))


def test_a_critic_beside_the_rollout_is_ppos_synchronous_critical_path_again():
    """PPO with the critic in the rollout's processes: reference R beside values V, the actor's
    update beside the critic's. Synchronously G + max(R, V) + max(Ua, Uc) + W; overlapped, the
    next generation runs between the critic's values and its update: V + max(Ua, G + Uc) + W
    (R <= V), which gains nothing where the two updates cost the same."""
    g, r, v, ua, uc = 0.5, 0.1, 0.12, 0.4, 0.4
    levels = [(r, v), (ua, uc)]
    assert hosted_iteration(g, levels, W, 0) == pytest.approx(g + v + ua + W)
    assert hosted_iteration(g, levels, W, 1) == pytest.approx(v + g + uc + W)
    assert hosted_iteration(g, levels, W, 1) == pytest.approx(hosted_iteration(g, levels, W, 0))
    # A costlier actor update (or a longer generation hidden under it) is where overlap pays.
    heavy = [(r, v), (1.5, uc)]
    assert hosted_iteration(g, heavy, W, 1) == pytest.approx(v + 1.5 + W)
    assert hosted_iteration(g, heavy, W, 0) - hosted_iteration(g, heavy, W, 1) == pytest.approx(g)
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        hosted_iteration(g, [(r, -v)], W, 1)
