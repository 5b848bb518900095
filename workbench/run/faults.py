"""Telling failures apart: a dead worker group (recover it and redo the iteration) from a
reward or cost function that raised or ran out of time (retry the iteration, or stop naming
the row), from everything else (stop)."""

from __future__ import annotations

import re

from workbench.errors import GroupRemovedError, WorkbenchError, WorkerCallError, WorkerDiedError

RULE_REWARD_ROLE = "rule_reward"  # the role name RuleReward's calls carry (workbench.workers.rule_reward)


class RunStopped(WorkbenchError):
    """The run could not go on; says at which iteration, why, and what was tried."""


class RewardFunctionError(RunStopped):
    """The reward (or cost) function raised, returned a non-finite value or ran out of time."""

    def __init__(self, iteration: int, function: str, detail: str, attempts: int):
        self.iteration, self.function, self.detail, self.attempts = iteration, function, detail, attempts
        tried = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(
            f"iteration {iteration}: the reward function {function} failed{tried}: {detail}. "
            f"Fix the function (or raise data.reward_timeout), or let the run retry the iteration "
            f"(faults.reward_retries=N)."
        )


def dead_role(error: BaseException) -> str | None:
    """The role whose worker group died (or was removed), when that is what `error` says."""
    if isinstance(error, (WorkerDiedError, GroupRemovedError)):
        return error.role
    return None


def reward_failure(error: BaseException) -> tuple[str, str] | None:
    """(function name, what went wrong on which row) when `error` is a rule reward's failure."""
    if not isinstance(error, WorkerCallError) or error.role != RULE_REWARD_ROLE:
        return None
    # The scorer's RuleRewardError names the row (uid, response); keep that line, not the traceback.
    found = re.findall(r"RuleRewardError: (.+)", error.remote_traceback)
    return error.method, (found[-1] if found else error.remote_traceback.strip().splitlines()[-1])
