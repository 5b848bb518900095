"""The reward role of multi-turn episodes: the environment judged each episode while it ran
(`generate_episodes` returns `episode_reward`), so the reward step only hands that over.

    grpo = GRPO(Groups(actor=actor, reference=actor, reward=EpisodeReward()),
                GRPOConfig(env=ToolEnvironment(...), sampling=SamplingConfig(n=4)))
"""

from __future__ import annotations

from workbench.data.batch import Batch
from workbench.errors import DispatchError


class EpisodeReward:
    """compute_reward(episodes) -> scores = the episodes' own rewards, without remote work."""

    def compute_reward(self, gen) -> _Scores:
        return _Scores(gen)

    def __repr__(self) -> str:
        return "EpisodeReward()"


class _Scores:
    """Ready as soon as the episodes are: nothing of its own to wait for (no refs for the clock)."""

    metas = outputs = ()

    def __init__(self, gen):
        self.gen = gen

    def get(self) -> Batch:
        episodes = self.gen.get() if hasattr(self.gen, "get") else self.gen
        if "episode_reward" not in episodes:
            raise DispatchError(
                "EpisodeReward scores multi-turn episodes: the batch has no 'episode_reward' (generate "
                "with generate_episodes: set the algorithm's config env=... )"
            )
        return Batch({"scores": episodes["episode_reward"]})
