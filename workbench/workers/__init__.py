"""Model workers (HybridFlow Table 4): actor/rollout/reference, critic, reward, cost, an LLM judge."""

from typing import TYPE_CHECKING

from workbench.lazy import exports

if TYPE_CHECKING:
    from workbench.workers.actor import ActorConfig, ActorRolloutRefWorker
    from workbench.workers.judge import VERDICTS, JudgeConfig, JudgeWorker, score_on, yes_no
    from workbench.workers.rollout_link import RolloutLink

# Imported on first use: a process that needs one worker module (a reward scorer's process
# loads workbench.workers.rule_reward) does not load the actor's model stack (seconds).
_LAZY = {
    "ActorConfig": "workbench.workers.actor",
    "ActorRolloutRefWorker": "workbench.workers.actor",
    "VERDICTS": "workbench.workers.judge",
    "JudgeConfig": "workbench.workers.judge",
    "JudgeWorker": "workbench.workers.judge",
    "score_on": "workbench.workers.judge",
    "yes_no": "workbench.workers.judge",
    "RolloutLink": "workbench.workers.rollout_link",
}
__all__ = list(_LAZY)
__getattr__ = exports(__name__, _LAZY)
