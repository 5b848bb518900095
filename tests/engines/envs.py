"""Environments the multi-turn tests share (sent to Ray workers by value)."""

import time

from workbench.agents import Answered, Environment, Observation, Pending, SandboxEnvironment, SandboxLimits, ToolBox
from workbench.agents.tools import calculator


class Replies(Environment):
    """Answers every turn with an observation until the row's turns (its ground_truth) are done;
    the reward is the number of turns taken."""

    def start(self, row):
        return {"left": int(row["ground_truth"]), "taken": 0}

    def step(self, state, text):
        state["left"] -= 1
        state["taken"] += 1
        if state["left"] == 0:
            return Observation(None, reward=float(state["taken"]), done=True)
        return Observation(f"result {state['taken']}: ok", info={"tool": "probe"})


class Floods(Environment):
    """One observation of `words` words (its tool cut it: counted), then the end."""

    def __init__(self, words: int):
        self.words = words

    def start(self, row):
        return {"turn": 0}

    def step(self, state, text):
        state["turn"] += 1
        if state["turn"] == 1:
            return Observation("word " * self.words, info={"tool": "flood", "tool_output_cut": 1})
        return Observation(None, reward=1.0, done=True)


class SlowStart(Replies):
    """`Replies`, with the first step of every episode of `slow_turns` turns taking `seconds`
    (a slow tool): continuous scheduling does not make the other episodes wait for it."""

    def __init__(self, slow_turns: int, seconds: float):
        self.slow_turns, self.seconds = slow_turns, seconds

    def step(self, state, text):
        if state["taken"] == 0 and state["left"] == self.slow_turns:
            time.sleep(self.seconds)
        return super().step(state, text)


class _Later(Pending):
    """An observation that is in at `at` (time.time()), like a tool working in another process."""

    def __init__(self, observation: Observation, at: float):
        self.observation, self.at = observation, at

    def ready(self) -> bool:
        return time.time() >= self.at

    def result(self) -> Observation:
        time.sleep(max(self.at - time.time(), 0.0))
        return self.observation


class SlowSubmit(SlowStart):
    """`SlowStart`'s slow first step, submitted (`Environment.submit`): it answers `seconds`
    later without holding the caller, as a tool's sandbox does."""

    def submit(self, state, text):
        slow = state["taken"] == 0 and state["left"] == self.slow_turns
        return _Later(Replies.step(self, state, text), time.time() + (self.seconds if slow else 0.0))


class _Calculated(Pending):
    def __init__(self, call):
        self.call = call

    def ready(self) -> bool:
        return self.call.ready()

    def result(self) -> Observation:
        return Observation(f"result {self.call.result()}: ok", info={"tool": "calculator"})


class Calculated(SandboxEnvironment):
    """`Replies`, each observation a calculator call's answer from the tool sandbox (sent
    without waiting: the rollout decodes while the jail computes it)."""

    def __init__(self):
        self.toolbox = ToolBox({"calculator": calculator}, SandboxLimits(seconds=10))

    start = Replies.start

    def _send(self, state, text):
        counted = Replies.step(self, state, text)  # its turn counting, answered by the sandbox
        if counted.done:
            return Answered(counted)
        return _Calculated(self.toolbox.submit("calculator", {"expression": f"{state['taken']} * 7"}))
