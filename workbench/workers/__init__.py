"""Model workers (HybridFlow Table 4): actor/rollout/reference, critic, reward, cost."""

from workbench.workers.actor import ActorConfig, ActorRolloutRefWorker
