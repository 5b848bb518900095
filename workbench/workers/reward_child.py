"""The process a reward scorer runs reward functions in (see rule_reward.RewardScorer).

Kept apart from rule_reward so the child imports only the standard library and cloudpickle:
a spawned child imports its target's module, and rule_reward's would load torch, Ray and the
workbench's controller (seconds of a core per child, one child per scorer and per killed
child). What a reward function needs loads when its pickle does."""

import json
import os
import traceback
from typing import Any

import cloudpickle


def child_loop(conn) -> None:
    """Score chunks forever. Acknowledge each chunk once the functions are loaded, then send one
    message per row (so the parent knows which row a hang or crash was on). A function that
    raises with no fallback ends its chunk."""
    os.environ["OMP_NUM_THREADS"] = "1"  # a function that loads torch gets one thread
    loaded: bytes | None = None
    rewards: Any = None  # a RewardSet, unpickled from the first chunk (set before any row is scored)
    while True:
        try:
            fn_bytes, texts, truths, columns = conn.recv()
        except EOFError:
            return
        if fn_bytes != loaded:
            rewards, loaded = cloudpickle.loads(fn_bytes), fn_bytes
        conn.send_bytes(b'["loaded", null]')
        for text, truth, row in zip(texts, truths, columns):
            try:
                values, failed = rewards(text, truth, row)
            except Exception as err:
                conn.send_bytes(json.dumps(["raised", f"{err}\n{traceback.format_exc(limit=-3)}"[-8000:]]).encode())
                break
            conn.send_bytes(json.dumps(["ok", values, failed]).encode())
