"""Model workers (HybridFlow Table 4): actor/rollout/reference, critic, reward, cost, an LLM judge."""

from workbench.workers.actor import ActorConfig, ActorRolloutRefWorker
from workbench.workers.judge import VERDICTS, JudgeConfig, JudgeWorker, score_on, yes_no
from workbench.workers.rollout_link import RolloutLink
