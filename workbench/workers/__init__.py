"""Model workers (HybridFlow Table 4): actor/rollout/reference, critic, reward, cost."""

from workbench.workers.actor import ActorConfig, ActorRolloutRefWorker
from workbench.workers.rollout_link import RolloutLink
