"""Did it learn? `HeldOut` measures a run's held-out accuracy while it trains (a `fit` callback),
and `learning_curves` draws runs side by side: each one's training score per iteration, and its
held-out accuracy from where it started to where it ended. A static matplotlib figure: what a
notebook's before/after cell shows, saved copies included.

    held_out = HeldOut(prompts)                           # greedy accuracy on prompts never trained on
    held_out(grpo)                                        # before
    history = grpo.fit(batches, 12, callbacks=[held_out])  # and after every iteration
    learning_curves({"GRPO": history}, {"GRPO": held_out.accuracy})
"""

from __future__ import annotations

from matplotlib.figure import Figure


class HeldOut:
    """A `fit` callback: the algorithm's mean greedy score on `prompts` (`Algorithm.evaluate`:
    exact-match accuracy for the arithmetic task) after every `every`-th iteration, kept in
    `accuracy` as {iteration: accuracy}. Called with the algorithm alone, it measures now."""

    def __init__(self, prompts, every: int = 1):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"HeldOut: every={every!r}; give a whole number of iterations >= 1")
        self.prompts, self.every = prompts, every
        self.accuracy: dict[int, float] = {}

    def __call__(self, algorithm, batch=None, metrics=None) -> None:
        if metrics is None or algorithm.iteration % self.every == 0:
            self.accuracy[algorithm.iteration] = algorithm.evaluate(self.prompts)

    def __str__(self) -> str:
        if not self.accuracy:
            return "not measured yet"
        first, last = min(self.accuracy), max(self.accuracy)
        return f"{self.accuracy[first]:.2f} at iteration {first} -> {self.accuracy[last]:.2f} at iteration {last}"


def learning_curves(
    histories: dict[str, list[dict]],
    accuracy: dict[str, dict[int, float]],
    score: str = "critic/score/mean",
    title: str = "held-out accuracy (greedy)",
) -> Figure:
    """Left: `score` of every iteration of each run (mean over its samples, noisy: a batch's own
    prompts). Right: each run's held-out accuracy at the iterations it was measured, its first
    and last value in the legend."""
    if not histories or set(accuracy) - set(histories):
        raise ValueError(
            f"learning_curves: give each run's fit history (got {sorted(histories)}) and the held-out accuracy "
            f"of some of them (got {sorted(accuracy)})"
        )
    fig = Figure(figsize=(9, 3))
    trained, held = fig.subplots(1, 2)
    for name, history in histories.items():
        points = [(m.get("iteration", i + 1), m[score]) for i, m in enumerate(history) if score in m]
        colour = trained.plot(*zip(*points), marker=".", label=name)[0].get_color() if points else None
        steps = sorted(accuracy.get(name, {}))
        if steps:
            first, last = accuracy[name][steps[0]], accuracy[name][steps[-1]]
            values = [accuracy[name][s] for s in steps]
            held.plot(steps, values, marker="o", color=colour, label=f"{name}: {first:.2f} -> {last:.2f}")
    trained.set(title=f"score on the training batch ({score})", xlabel="iteration")
    held.set(title=title, xlabel="iteration", ylim=(-0.02, 1.02))
    for ax in (trained, held):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.9, bottom=0.16, wspace=0.2)
    return fig
