"""widgets.learning: HeldOut measures a run's held-out accuracy as a fit callback, and
learning_curves draws runs side by side. A stand-in algorithm: no workers needed."""

import pytest

from widgets import HeldOut, learning_curves


class Algorithm:
    """What HeldOut asks of an algorithm: its iteration count and `evaluate(prompts)`."""

    def __init__(self, accuracies):
        self.iteration, self.accuracies, self.asked = 0, list(accuracies), []

    def evaluate(self, prompts):
        self.asked.append(prompts)
        return self.accuracies[self.iteration]


def fit(algorithm, iterations, callbacks):
    history = []
    for _ in range(iterations):
        algorithm.iteration += 1
        metrics = {"iteration": float(algorithm.iteration), "critic/score/mean": 0.1 * algorithm.iteration}
        history.append(metrics)
        for callback in callbacks:
            callback(algorithm, None, metrics)
    return history


def test_held_out_measures_before_and_every_nth_iteration():
    algorithm = Algorithm([0.5, 0.6, 0.7, 0.8, 0.9])
    held = HeldOut("prompts", every=2)
    assert str(held) == "not measured yet"
    held(algorithm)  # called alone: measures now, whatever the iteration
    fit(algorithm, 4, [held])
    assert held.accuracy == {0: 0.5, 2: 0.7, 4: 0.9}
    assert algorithm.asked == ["prompts"] * 3
    assert str(held) == "0.50 at iteration 0 -> 0.90 at iteration 4"
    with pytest.raises(ValueError, match="every=0"):
        HeldOut("prompts", every=0)


def test_learning_curves_draws_each_run_and_its_before_and_after():
    a, b = Algorithm([0.5, 0.6, 0.7]), Algorithm([0.5, 0.5, 0.6])
    held_a, held_b = HeldOut(None), HeldOut(None)
    held_a(a), held_b(b)
    runs = {"A": fit(a, 2, [held_a]), "B": fit(b, 2, [held_b])}
    fig = learning_curves(runs, {"A": held_a.accuracy, "B": held_b.accuracy})
    trained, held = fig.axes
    assert [line.get_ydata().tolist() for line in trained.lines] == [[0.1, 0.2], [0.1, 0.2]]
    assert [text.get_text() for text in held.get_legend().get_texts()] == ["A: 0.50 -> 0.70", "B: 0.50 -> 0.60"]
    assert [line.get_color() for line in held.lines] == [line.get_color() for line in trained.lines]
    with pytest.raises(ValueError, match="held-out accuracy of some of them"):
        learning_curves(runs, {"C": {0: 0.5}})
