"""The asynchronous plan's iteration model, on hand-computed cases."""

import pytest

from workbench.planner.asynchronous import estimate, steady_iteration


def test_staleness_zero_is_the_sequential_split_iteration():
    assert steady_iteration(2.0, 3.0, 0.5, 0) == pytest.approx(5.5)
    assert estimate(2.0, 3.0, 0.5, 0, iterations=4).total_s == pytest.approx(22.0)


@pytest.mark.parametrize("staleness", [1, 2, 5])
def test_overlap_costs_the_slower_side_plus_the_push(staleness):
    assert steady_iteration(2.0, 3.0, 0.5, staleness) == pytest.approx(3.5)
    assert steady_iteration(4.0, 3.0, 0.5, staleness) == pytest.approx(4.5)
    run = estimate(2.0, 3.0, 0.5, staleness, iterations=10)
    assert run.total_s == pytest.approx(2.0 + 10 * 3.5)  # one generation fills the pipeline
    assert run.bottleneck == "trainer"
    assert run.idle_trainer == pytest.approx(0.0)
    assert run.idle_rollout == pytest.approx(1 - 2.5 / 3.5)


def test_bad_seconds_are_refused():
    with pytest.raises(ValueError, match="max_staleness"):
        steady_iteration(1.0, 1.0, 0.0, -1)
