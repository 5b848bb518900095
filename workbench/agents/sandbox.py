"""Tool sandboxes: long-lived child processes that run tool calls under limits.

    sandbox = Sandbox(SandboxLimits(seconds=2, memory_mib=256))
    sandbox.call(calculator, ("123 * 45",))      # -> "5535", run in the child
    sandbox.call(python, ("while True: pass",))  # -> ToolError: ... took more than 2 s; killed

A sandbox is started once and reused by every call (a process per call would cost its start
each turn of every episode). Each call gets a deadline enforced from outside: the parent waits
on the child's answer and SIGKILLs it when the deadline passes, so a tool that loops, sleeps or
ignores signals is still stopped; the next call starts a fresh child. Inside, the child
(workbench/agents/sandbox_child.py) has its own scratch directory as working directory, a
memory cap, no network and no new processes, and may write only inside its scratch directory.
Every failure is a ToolError naming the tool, what went wrong (`kind`) and how to fix it.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle

from workbench import checks
from workbench.agents.sandbox_child import read_message, write_message
from workbench.errors import WorkbenchError

CHILD = Path(__file__).with_name("sandbox_child.py")
START_TIMEOUT = 30.0
"""Seconds a fresh child may take to start (imports), apart from the call's own limit."""


class ToolError(WorkbenchError):
    """A tool call failed: `kind` is "timeout", "memory", "blocked", "raised" or "crashed"."""

    def __init__(self, tool: str, kind: str, detail: str):
        self.tool, self.kind, self.detail = tool, kind, detail
        super().__init__(f"tool {tool!r} {detail}")


@dataclass(frozen=True)
class SandboxLimits:
    """What one tool call may use."""

    seconds: float = 5.0
    """Wall-clock limit per call; the child is killed when it passes."""
    memory_mib: int = 512
    """Address-space cap of the child (RLIMIT_AS): an unbounded allocation fails there."""
    network: bool = False
    """Allow sockets (off: no network namespace access, socket creation refused)."""

    def __post_init__(self):
        checks.real("SandboxLimits", "seconds", self.seconds, 0, low_open=True, fix="give seconds per call > 0")
        checks.whole("SandboxLimits", "memory_mib", self.memory_mib, low=64, fix="give at least 64 MiB")


class Sandbox:
    """One child process that runs tool functions (picklable callables) one call at a time."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), name: str = "sandbox"):
        self.limits, self.name = limits, name
        self.scratch = Path(tempfile.mkdtemp(prefix=f"workbench-{name}-"))
        """The child's working directory: the one place a tool may write."""
        self._child: subprocess.Popen | None = None
        self.starts = 0
        """Children started so far (a killed or crashed child is replaced on the next call)."""

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None and self._child.poll() is None else None

    def call(self, fn, args: tuple = (), kwargs: dict | None = None, tool: str | None = None) -> Any:
        """fn(*args, **kwargs) in the child, within the limits; ToolError when it fails.
        `tool` names it in errors (default: the function's name)."""
        tool = tool or getattr(fn, "__name__", repr(fn))
        child = self._running()
        try:
            write_message(child.stdin, (cloudpickle.dumps(fn), tuple(args), dict(kwargs or {})), cloudpickle.dumps)
        except (BrokenPipeError, OSError):
            self._kill()
            raise ToolError(
                tool, "crashed", "found its sandbox process gone; a fresh one starts on the next call"
            ) from None
        answer = self._answer(child, tool, self.limits.seconds)
        if answer[0] == "ok":
            return answer[1]
        _, kind, text = answer
        if kind == "memory":
            raise ToolError(
                tool, kind, f"ran out of memory (the limit is SandboxLimits.memory_mib={self.limits.memory_mib})"
            )
        if kind == "blocked":
            raise ToolError(tool, kind, f"was refused by the sandbox: {text}")
        raise ToolError(tool, kind, f"raised {text}")

    def close(self) -> None:
        """Stop the child and remove the scratch directory."""
        self._kill()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # a dropped sandbox leaves no process behind
        try:
            self.close()
        except Exception:
            pass

    # ---- the child -----------------------------------------------------------------------------
    def _running(self) -> subprocess.Popen:
        if self._child is None or self._child.poll() is not None:
            self._kill()
            self._child = subprocess.Popen(
                [
                    sys.executable,
                    "-I",  # no user site, no PYTHON* variables, not the script's folder: nothing of ours
                    str(CHILD),
                    str(self.scratch),
                    str(self.limits.memory_mib * 2**20),
                    "1" if self.limits.network else "0",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=self.scratch,
                start_new_session=True,  # a notebook's interrupt goes to the kernel, not the tool
            )
            self.starts += 1
            # Its start (interpreter, cloudpickle) is not the tool's time: wait for it apart.
            ready, _, _ = select.select([self._child.stdout], [], [], START_TIMEOUT)
            if not ready or read_message(self._child.stdout) != ("ready",):
                self._kill()
                raise ToolError(self.name, "crashed", f"could not start its sandbox process within {START_TIMEOUT} s")
        return self._child

    def _answer(self, child: subprocess.Popen, tool: str, seconds: float):
        """The child's answer, or kill it once `seconds` pass."""
        ready, _, _ = select.select([child.stdout], [], [], seconds)
        if not ready:
            self._kill()
            raise ToolError(
                tool,
                "timeout",
                f"took more than {seconds} s; its sandbox process was killed (make the call cheaper, or raise "
                f"SandboxLimits.seconds)",
            )
        answer = read_message(child.stdout)
        if answer is None:  # the process ended mid-call: a crash, or the kernel's OOM killer
            code = child.wait(5)
            self._child = None
            raise ToolError(
                tool, "crashed", f"ended its sandbox process (exit code {code}); a fresh one starts next call"
            )
        return answer

    def _kill(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        if child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGKILL)  # the child and anything it left behind
            except ProcessLookupError:
                pass
        child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
