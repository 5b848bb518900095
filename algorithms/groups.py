"""The worker groups an algorithm drives, by role (HybridFlow Table 4)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the handle types only: importing workbench.workers would load the model stack
    from workbench.workers.handles import (
        ActorHandle,
        CostModelHandle,
        CriticHandle,
        RewardModelHandle,
        RuleRewardHandle,
    )

NOT_GIVEN: Any = None
"""A role not given is None. Typed Any so that each field below carries its handle type alone
(not `| None`): every algorithm checks its roles with `Groups.require` before calling them."""


@dataclass
class Groups:
    """Live handles, one per role, typed by what the role offers (workbench.workers.handles).
    Any object with the role's methods will do: a WorkerGroup, a fused group's role, or a
    RuleReward for `reward`/`cost`."""

    actor: ActorHandle = NOT_GIVEN
    """generate_sequences, compute_log_prob, update_actor (workbench.workers.ActorRolloutRefWorker)."""
    rollout: ActorHandle = NOT_GIVEN
    """generate_sequences on devices of its own (an ActorRolloutRefWorker group with train=False,
    on another pool): the actor's weights are pushed to it after each update (RolloutLink), and
    `fit(..., asynchronous=True)` overlaps its generations with the actor's training. None: the
    actor generates itself (the hybrid engine)."""
    reference: ActorHandle = NOT_GIVEN
    """compute_ref_log_prob: the actor group itself when it holds the reference copy."""
    critic: CriticHandle = NOT_GIVEN
    """compute_values, update_critic (workbench.workers.critic.CriticWorker)."""
    reward: RewardModelHandle | RuleRewardHandle = NOT_GIVEN
    """compute_reward -> scores: a RewardModelWorker group or a RuleReward."""
    cost: CostModelHandle | RuleRewardHandle = NOT_GIVEN
    """compute_cost -> costs (Safe-RLHF): a CostModelWorker group or a RuleReward(output_key="costs")."""
    cost_critic: CriticHandle = NOT_GIVEN
    """A second critic for the cost's values (Safe-RLHF)."""

    def require(self, algorithm: str, *roles: str) -> None:
        """Refuse, before any remote work, an algorithm whose roles are not all given."""
        missing = [role for role in roles if getattr(self, role) is None]
        if missing:
            given = [f.name for f in fields(self) if getattr(self, f.name) is not None]
            raise ValueError(
                f"{algorithm} needs the role(s) {missing}; given: {given}. "
                f"Pass them as Groups({', '.join(f'{r}=...' for r in missing)})"
            )
