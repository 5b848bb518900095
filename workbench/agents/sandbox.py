"""Tool sandboxes: long-lived jailed processes that run tool calls under limits.

    sandbox = Sandbox(SandboxLimits(seconds=2, memory_mib=256))
    sandbox.call(calculator, ("123 * 45",))      # -> "5535", run in the jail
    sandbox.call(python, ("while True: pass",))  # -> ToolError: ... took more than 2 s; killed

A sandbox is started once and reused by every call (a process per call would cost its start
each turn of every episode). It runs in a jail (workbench/agents/jail.py: an unprivileged user,
namespaces of its own, only the interpreter visible, a private scratch directory), where its
program (workbench/agents/sandbox_child.py) runs each call in a process of its own with limits.
Each call has a deadline enforced from outside: the parent waits on the answer with the deadline
on every read, a cap on its size, and SIGKILLs the jail when either is passed; the next call
starts a fresh one. Answers are JSON: nothing a tool sends can run code here.
Every failure is a ToolError naming the tool, what went wrong (`kind`) and the limit.

Where no jail can be built (no bubblewrap, no namespaces), a sandbox refuses to start unless the
tools are trusted (`SandboxLimits(trust_tools=True)`): then it runs unjailed, with the same
protocol, limits and audit hook, in a scratch directory on the host.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle

from workbench import checks
from workbench.agents import jail
from workbench.agents.sandbox_child import CUT_NOTE, answer_cap, frame, result
from workbench.errors import WorkbenchError

CHILD = Path(__file__).with_name("sandbox_child.py")
CHILD_IN_JAIL = "/sandbox/sandbox_child.py"
PIPE_BYTES = 1 << 20
"""The request pipe's size asked for (Linux's default is 64 KiB; a request carries its tool's
pickle, ~4 KiB for the calculator): a rollout's turn of calls fits unanswered."""
START_TIMEOUT = 30.0
"""Seconds a fresh child may take to start (imports), apart from the call's own limit."""


class SandboxUnavailable(WorkbenchError):
    """No jail can be built here and the tools are not declared trusted."""


KINDS = ("timeout", "memory", "disk", "output", "result", "blocked", "raised", "crashed")
"""What can go wrong in a sandbox (ToolError.kind)."""


class ToolError(WorkbenchError):
    """A tool call failed. `kind`: one of KINDS, or "unknown" (a tool not in the ToolBox)."""

    def __init__(self, tool: str, kind: str, detail: str):
        self.tool, self.kind, self.detail = tool, kind, detail
        super().__init__(f"tool {tool!r} {detail}")

    def __reduce__(self):  # raised in a worker, it reaches the driver whole (Ray pickles it)
        return ToolError, (self.tool, self.kind, self.detail)


@dataclass(frozen=True)
class SandboxLimits:
    """What one tool call may use."""

    seconds: float = 5.0
    """Wall-clock limit per call; the jail is killed when it passes (and RLIMIT_CPU stops a call's
    process past seconds + 1 CPU seconds)."""
    memory_mib: int = 512
    """Address-space cap of a call's process (RLIMIT_AS): an unbounded allocation fails there."""
    disk_mib: int = 64
    """The scratch directory's size (a tmpfs in the jail), and the largest file (RLIMIT_FSIZE)."""
    processes: int = 32
    """Processes the jail's user may run at once (RLIMIT_NPROC): a fork bomb ends there."""
    output_chars: int = 4000
    """Characters of a tool's answer kept; the rest is cut before anything reads it (and counted)."""
    calls_per_process: int = 32
    """Calls one process in the jail serves before a fresh one is forked (sooner after a failure,
    a thread left running or a forged answer). 1: every call in a fresh process, so no call can
    leave state (a patched module, a thread) for the next; a fork costs ~1-3 ms a call."""
    network: bool = False
    """Share the host's network (off: the jail has only a loopback of its own; sockets refused)."""
    trust_tools: bool = False
    """Run the tools unjailed where no jail can be built (they are yours). Off: refuse to start."""

    def __post_init__(self):
        checks.real("SandboxLimits", "seconds", self.seconds, 0, low_open=True, fix="give seconds per call > 0")
        checks.whole("SandboxLimits", "memory_mib", self.memory_mib, low=64, fix="give at least 64 MiB")
        checks.whole("SandboxLimits", "disk_mib", self.disk_mib, low=1, fix="give at least 1 MiB")
        checks.whole("SandboxLimits", "processes", self.processes, low=2, fix="give at least 2 processes")
        checks.whole("SandboxLimits", "output_chars", self.output_chars, low=16, fix="give at least 16 characters")
        checks.whole("SandboxLimits", "calls_per_process", self.calls_per_process, fix="give 1 or more calls")


def check_jail(limits: SandboxLimits) -> bool:
    """Whether tools run jailed here; SandboxUnavailable when they cannot and are not trusted."""
    why = jail.unavailable()
    if why is not None and not limits.trust_tools:
        raise SandboxUnavailable(
            f"tools cannot be jailed here: {why}. Install bubblewrap, or pass "
            f"SandboxLimits(trust_tools=True) to run tools you trust without a jail"
        )
    return why is None


def _widened(fd: int) -> int:
    """Half the pipe's size, after asking for PIPE_BYTES (as far as /proc/sys/fs/pipe-max-size
    allows); 8 KiB where pipes cannot be sized (not Linux)."""
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return 8 * 1024
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:  # over pipe-max-size for this user: the size it has
        pass
    return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) // 2


def _ready(fd: int, event: int, seconds: float) -> bool:
    """Whether `fd` is ready for `event` (or hung up) within `seconds` (poll: select refuses fd
    numbers past 1024, which a long-lived worker can hold)."""
    poller = select.poll()
    poller.register(fd, event | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(seconds * 1000))


_UNANSWERED = object()


class Call:
    """A tool call sent to a sandbox (`Sandbox.submit`): `ready()` says without waiting whether
    its answer is in, `result()` waits for it and returns it, or raises the call's ToolError."""

    def __init__(self, sandbox: Sandbox, tool: str, request: bytes):
        self.sandbox, self.tool, self.request = sandbox, tool, request
        self.outcome: Any = _UNANSWERED
        """The answer once read (a ToolError when the call failed)."""
        self.cut = 0
        """Characters the answer lost to SandboxLimits.output_chars."""

    @property
    def answered(self) -> bool:
        return self.outcome is not _UNANSWERED

    def ready(self) -> bool:
        return self.answered or self.sandbox._collect(self, wait=False)

    def result(self) -> Any:
        if not self.answered:
            self.sandbox._collect(self, wait=True)
        if isinstance(self.outcome, ToolError):
            raise self.outcome
        return self.outcome


class Sandbox:
    """A jailed process that runs tool functions (picklable callables) one call at a time."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), name: str = "sandbox"):
        self.limits, self.name = limits, name
        self.jailed = check_jail(limits)
        self.scratch = jail.SCRATCH if self.jailed else tempfile.mkdtemp(prefix=f"workbench-{name}-")
        """The tools' working directory, as they see it: in the jail, a tmpfs of its own (gone
        with the jail); unjailed, a folder on the host."""
        self.uid: int | None = None
        """The running jail's own uid (started as root; a fresh one each start), else None."""
        self._child: subprocess.Popen | None = None
        self._requests = self._answers = -1
        self._sent: collections.deque[Call] = collections.deque()
        """Calls sent to the running jail whose answers are not read yet, in order."""
        self._room = 0
        """Bytes of requests that may be unanswered at once: half the request pipe."""
        self._head_since = 0.0
        """When the first of them could start: the answers before it had been read."""
        self.starts = 0
        """Jails started so far (a killed or crashed one is replaced on the next call)."""
        self.last_cut = 0
        """Characters the last call's answer lost to SandboxLimits.output_chars."""
        self._cap = answer_cap(limits.output_chars)

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None and self._child.poll() is None else None

    def call(self, fn, args: tuple = (), kwargs: dict | None = None, tool: str | None = None) -> Any:
        """fn(*args, **kwargs) in the jail, within the limits; ToolError when it fails.
        `tool` names it in errors (default: the function's name)."""
        return self.submit(fn, args, kwargs, tool).result()

    def submit(self, fn, args: tuple = (), kwargs: dict | None = None, tool: str | None = None) -> Call:
        """`call`, sent without waiting for the answer: the caller goes on (a rollout decodes)
        while the jail works, and reads the answer from the returned Call. The jail runs its
        calls one after another, in the order they were sent; a call's time limit counts from
        when the answers before its own have been read (never sooner than it started)."""
        tool = tool or str(getattr(fn, "__name__", repr(fn)))
        call = Call(self, tool, frame(cloudpickle.dumps((cloudpickle.dumps(fn), tuple(args), dict(kwargs or {})))))
        # Unread requests never fill the pipe: a write then never waits on a jail that is
        # itself waiting for its answers to be read.
        while self._sent and sum(len(c.request) for c in self._sent) + len(call.request) > self._room:
            self._collect(self._sent[0], wait=True)
        self._send(call)
        return call

    def _send(self, call: Call) -> None:
        try:
            self._running()
            if not self._sent:
                self._head_since = time.monotonic()
            self._give(call.request, call.tool, time.monotonic() + self.limits.seconds)
        except ToolError as err:
            call.outcome = err
            self._resend()  # a write that failed killed the jail: the calls before it go again
            return
        self._sent.append(call)

    def _resend(self) -> None:
        """The calls sent to a jail that has since been killed, sent to a fresh one."""
        if self._child is None and self._sent:
            calls = list(self._sent)
            self._sent.clear()
            for call in calls:
                self._send(call)

    def _collect(self, target: Call, wait: bool) -> bool:
        """Read answers, in the order sent, up to `target`'s; without `wait`, only those already
        in (and a call past its deadline, whose jail is then killed). Whether `target` has one."""
        while not target.answered and self._sent:
            head = self._sent[0]
            deadline = self._head_since + self.limits.seconds
            if not wait and time.monotonic() < deadline and not _ready(self._answers, select.POLLIN, 0):
                return False
            try:
                head.outcome = self._answered(head, deadline)
            except ToolError as err:
                head.outcome = err
            self._sent.popleft()
            self._head_since = time.monotonic()
            self._resend()  # after a failure that killed the jail, the calls behind it go again
        return target.answered

    def _answered(self, call: Call, deadline: float) -> Any:
        """`call`'s answer (the jail's next), checked; ToolError when it failed."""
        tool = call.tool
        answer = self._answer(tool, deadline)
        if "ok" in answer:
            # Checked again here: the jail is not trusted (its own note on a cut answer may stay).
            checked = result(answer["ok"], self.limits.output_chars + CUT_NOTE)
            if "error" in checked:
                raise ToolError(tool, checked["error"], checked["text"] + self._limit(checked["error"]))
            cut = answer.get("cut")
            cut = cut if type(cut) is int and 0 < cut < 2**53 else 0
            call.cut = self.last_cut = max(cut, checked["cut"])
            return checked["ok"]
        self.last_cut = 0
        kind, text = answer["error"], str(answer.get("text", ""))
        if kind not in KINDS:  # not one the sandbox sends
            kind, text = "crashed", f"answered with an unknown kind of error {kind!r:.40}"
        detail = {
            "memory": "ran out of memory",
            "disk": f"wrote past its disk limit: {text}",
            "blocked": f"was refused by the sandbox: {text}",
            "raised": f"raised {text}",
        }.get(kind, text)
        raise ToolError(tool, kind, detail + self._limit(kind))

    def close(self) -> None:
        """Stop the jail (and remove an unjailed sandbox's scratch directory); calls still
        unanswered fail."""
        for call in self._sent:
            call.outcome = ToolError(call.tool, "crashed", "was not answered: its sandbox was closed")
        self._sent.clear()
        self._kill()
        if not self.jailed:
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
    def _limit(self, kind: str) -> str:
        """The limit a failure ran into, named so it can be raised."""
        limits = self.limits
        return {
            "timeout": f" (SandboxLimits.seconds={limits.seconds})",
            "memory": f" (SandboxLimits.memory_mib={limits.memory_mib})",
            "disk": f" (SandboxLimits.disk_mib={limits.disk_mib})",
            "output": f" (SandboxLimits.output_chars={limits.output_chars})",
        }.get(kind, "")

    def _running(self) -> None:
        if self._child is not None and self._child.poll() is None:
            return
        self._kill()
        self.uid = jail.new_uid() if self.jailed else None
        requests_read, self._requests = os.pipe()
        self._room = _widened(self._requests)
        self._answers, answers_write = os.pipe()
        settings = {
            "scratch": self.scratch,
            "jailed": self.jailed,
            "seconds": self.limits.seconds,
            "memory_bytes": self.limits.memory_mib * 2**20,
            "file_bytes": self.limits.disk_mib * 2**20,
            # RLIMIT_NPROC counts a uid's processes: jailed, the jail's own uid (as root) or its
            # user namespace's; unjailed it would count all of the caller's.
            "processes": self.limits.processes if self.jailed else 0,
            "output_chars": self.limits.output_chars,
            "calls_per_process": self.limits.calls_per_process,
            "network": self.limits.network,
        }
        program = CHILD_IN_JAIL if self.jailed else str(CHILD)
        # -I: no user site, no PYTHON* variables, not the script's folder: nothing of ours.
        command = [sys.executable, "-I", program, str(requests_read), str(answers_write), json.dumps(settings)]
        if self.jailed:
            command = jail.jail_command(
                command,
                self.limits.disk_mib,
                network=self.limits.network,
                files={CHILD_IN_JAIL: str(CHILD)},
                uid=self.uid,
            )
        try:
            self._child = subprocess.Popen(
                command,
                pass_fds=(requests_read, answers_write),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # a tool printing to its real stdout reaches nobody
                stderr=subprocess.DEVNULL,
                cwd=None if self.jailed else self.scratch,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},  # none of the caller's
                start_new_session=True,  # a notebook's interrupt goes to the kernel, not the tool
            )
        finally:
            os.close(requests_read)
            os.close(answers_write)
        self.starts += 1
        # Its start (jail, interpreter, cloudpickle) is not the tool's time: waited for apart.
        try:
            ready = self._answer(self.name, time.monotonic() + START_TIMEOUT)
        except ToolError as err:
            ready = {"failed": f"no answer within {START_TIMEOUT} s" if err.kind == "timeout" else err.detail}
        if ready != {"ready": True}:
            self._kill()
            raise ToolError(
                self.name,
                "crashed",
                f"could not start its sandbox process ({ready.get('failed', 'a wrong first answer')}); "
                f"run `{' '.join(command[:3])} ...` by hand to see why",
            )

    def _answer(self, tool: str, deadline: float) -> dict:
        """One answer from the child, read by `deadline` and within the size cap, or the child
        is killed and the failure named."""
        size = struct.unpack(">I", self._take(4, tool, deadline))[0]
        if size > self._cap:
            self._kill()
            raise ToolError(tool, "output", f"sent an answer of {size} bytes, over the cap of {self._cap}; killed")
        try:
            answer = json.loads(self._take(size, tool, deadline))
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            answer = None
        if not isinstance(answer, dict) or not ("ok" in answer or "ready" in answer or "error" in answer):
            self._kill()
            raise ToolError(tool, "crashed", "sent an answer that is not the sandbox's; killed")
        return answer

    def _wait(self, fd: int, event: int, tool: str, deadline: float) -> None:
        """Until `fd` is ready for `event`, or kill the jail at `deadline`."""
        left = deadline - time.monotonic()
        if left <= 0 or not _ready(fd, event, left):
            self._kill()
            raise ToolError(
                tool,
                "timeout",
                f"took more than {self.limits.seconds} s; its sandbox process was killed (make "
                f"the call cheaper, or raise SandboxLimits.seconds)",
            )

    def _give(self, data: bytes, tool: str, deadline: float) -> None:
        """Write a request by `deadline` (a jail that stops reading cannot hold the caller)."""
        view = memoryview(data)
        os.set_blocking(self._requests, False)
        while view:
            self._wait(self._requests, select.POLLOUT, tool, deadline)
            try:
                view = view[os.write(self._requests, view) :]
            except BlockingIOError:
                continue
            except OSError:
                self._kill()
                raise ToolError(
                    tool, "crashed", "found its sandbox process gone; a fresh one starts on the next call"
                ) from None

    def _take(self, size: int, tool: str, deadline: float) -> bytes:
        data = b""
        while len(data) < size:
            self._wait(self._answers, select.POLLIN, tool, deadline)
            chunk = os.read(self._answers, size - len(data))
            if not chunk:  # the jail ended mid-call (a tool that killed its own server)
                code = self._kill()
                raise ToolError(
                    tool, "crashed", f"ended its sandbox process (exit code {code}); a fresh one starts next call"
                )
            data += chunk
        return data

    def _kill(self) -> int | None:
        """Stop the jail: the process group of bwrap (the jail's processes die with it)."""
        child, self._child = self._child, None
        for fd in (self._requests, self._answers):
            if fd >= 0:
                os.close(fd)
        self._requests = self._answers = -1
        if child is None:
            return None
        if child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return child.wait()
