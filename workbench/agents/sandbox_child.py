"""The program a tool sandbox runs, in its jail (started by workbench.agents.sandbox as a script;
the workbench imports only its message functions): it loads nothing but the standard library and
cloudpickle, so it starts in a fraction of a second, and a tool's memory limit is not eaten by
torch.

It serves calls one at a time through a call process it forks: the serving process never runs a
tool, so a tool that crashes costs a fork, not a jail. A call process serves up to
calls_per_process calls (1: a fresh process per call, so no call sees what another left) and is
replaced after any failure, a thread left running, or bytes written past its answer. It has the
limits (address space, file size, processes, CPU seconds per call) and an audit hook that
refuses, as a second layer behind the jail, what a tool must not do: sockets, new processes,
signals to other processes, and writes outside the scratch directory. After each call every
other process in the jail is killed.

Protocol, over two pipes that are not the child's stdin/stdout/stderr (those are /dev/null, so a
tool printing to its real stdout reaches nobody): 4-byte big-endian length + body. A request
(parent to child) is a pickle of (function bytes, args, kwargs): the parent is trusted. An answer
(child to parent) is JSON, never a pickle: {"ok": value, "cut": characters cut} or
{"error": kind, "text": what happened}. The parent reads it with a deadline and a size cap.
"""

import contextlib
import ctypes
import errno
import io
import json
import os
import pickle
import resource
import select
import signal
import struct
import sys
import traceback

CLONE_NEWNET = 0x40000000
PR_SET_DUMPABLE = 4
ERROR_TEXT = 4000
"""Characters of an error's text sent back (a traceback is cut from the front: its end says most)."""
CUT_NOTE = 64
"""Characters a cut answer may carry past output_chars: the note saying how much was cut."""


class SandboxViolation(PermissionError):
    """A tool did what the sandbox refuses (the parent names it as a blocked call)."""


class TooLarge(Exception):
    """A message over its cap (its size in bytes)."""


def read_message(fd: int, cap: int | None = None) -> bytes | None:
    """One message's body; None at the end of the stream."""
    header = read_exactly(fd, 4)
    if header is None:
        return None
    (size,) = struct.unpack(">I", header)
    if cap is not None and size > cap:
        raise TooLarge(size)
    return read_exactly(fd, size)


def read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def frame(data: bytes) -> bytes:
    """A message as it goes on a pipe: its length (4 bytes, big-endian), then its bytes."""
    return struct.pack(">I", len(data)) + data


def write_message(fd: int, data: bytes) -> None:
    view = memoryview(frame(data))
    while view:
        view = view[os.write(fd, view) :]


def answer_bytes(answer: dict) -> bytes:
    return json.dumps(answer, ensure_ascii=False, allow_nan=False).encode()


def cut_network() -> bool:
    """A network namespace of its own (only a downed loopback): needs root; False otherwise."""
    try:
        return ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) == 0
    except (OSError, AttributeError):
        return False


def guard(scratch: str, network: bool) -> tuple[list[bool], list[str]]:
    """An audit hook refusing sockets, processes, signals to other processes and writes outside
    `scratch`, armed only while a tool runs (the call process's own pipes stay free)."""
    armed = [False]
    violations: list[str] = []  # what a tool tried, even where it caught the refusal itself
    root = os.path.realpath(scratch)
    refused_events = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty"}
    path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.chmod", "os.truncate"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    own = os.getpid()

    def outside(path) -> bool:
        if isinstance(path, int):  # an already-open descriptor
            return False
        real = os.path.realpath(os.fsdecode(path))
        return real != root and not real.startswith(root + os.sep)

    def refuse(what: str) -> None:
        violations.append(what)
        raise SandboxViolation(what)

    def hook(event: str, args: tuple) -> None:
        if not armed[0]:
            return
        if event.startswith("socket.") and not network:
            refuse(f"no network in the sandbox ({event})")
        if event in refused_events:
            refuse(f"no new processes in the sandbox ({event})")
        if event in ("os.kill", "os.killpg") and args[0] != own or event == "signal.pthread_kill":
            refuse(f"no signals to other processes from the sandbox ({event} {args[0]})")
        if event == "open" and len(args) >= 3 and args[0] is not None:
            mode, flags = args[1], args[2] or 0
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & write_flags)
            if writes and outside(args[0]):
                refuse(f"writes only inside the scratch directory {root}, not {args[0]}")
        if event in path_events and args and outside(args[0]):
            refuse(f"changes files only inside the scratch directory {root} ({event} {args[0]})")

    sys.addaudithook(hook)
    return armed, violations


def result(value, output_chars: int) -> dict:
    """The answer for a tool's return value: text (cut to `output_chars`) or other JSON data."""
    if isinstance(value, str):
        text = str.__str__(value)  # a subclass's own methods do not run past here
        cut = max(len(text) - output_chars, 0)
        if cut:
            text = text[:output_chars] + f"\n... ({cut} more characters cut)"
        return {"ok": text, "cut": cut}
    try:
        data = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return {"error": "result", "text": f"returned a {type(value).__name__}, not data: return text"}
    if len(json.dumps(data)) > output_chars:
        return {"error": "output", "text": f"returned data of more than {output_chars} characters"}
    return {"ok": data, "cut": 0}


def answer_cap(output_chars: int) -> int:
    """The most bytes an answer may take: output_chars and the cut note (4 bytes a character at
    most in UTF-8), or an error's text, and JSON's framing."""
    return 4 * (output_chars + CUT_NOTE) + 4 * ERROR_TEXT + 1024


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_call(fn, args, kwargs, limits: dict, armed: list[bool], violations: list[str]) -> dict:
    """One tool call, guarded; its answer."""
    printed = io.StringIO()
    violations.clear()
    armed[0] = True
    try:
        try:
            with contextlib.redirect_stdout(printed):
                value = fn(*args, **kwargs)
        finally:
            armed[0] = False
        return {"error": "blocked", "text": violations[0]} if violations else result(value, limits["output_chars"])
    except SandboxViolation as err:
        return {"error": "blocked", "text": str(err)}
    except MemoryError:
        return {"error": "memory", "text": ""}
    except BaseException as err:  # a limit on disk, or the tool's own error: its message and where
        if isinstance(err, OSError) and err.errno in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT):
            return {"error": "disk", "text": f"{err.strerror} ({err.filename or 'a write'})"}
        return {"error": "raised", "text": f"{err!r}\n{traceback.format_exc(limit=-2)}"[-ERROR_TEXT:]}


def call_loop(requests: int, answers: int, limits: dict) -> None:
    """The call process: tool calls, one at a time, until the server retires it. RLIMIT_CPU is
    a process's lifetime: each call's soft limit is what was used so far plus the call's
    seconds, under a hard limit of calls_per_process calls' worth (the server retires the process
    before a call could reach it)."""
    per_call = int(limits["seconds"]) + 1
    budget = per_call * (limits["calls_per_process"] + 1)
    resource.setrlimit(resource.RLIMIT_CPU, (budget, budget))
    armed, violations = guard(limits["scratch"], limits["network"])
    loaded: dict[bytes, object] = {}
    while True:
        request = read_message(requests)
        if request is None:
            return
        resource.setrlimit(resource.RLIMIT_CPU, (min(int(cpu_seconds()) + per_call, budget), budget))
        try:
            fn_bytes, args, kwargs = pickle.loads(request)  # from the parent: trusted
            fn = loaded.get(fn_bytes) or loaded.setdefault(fn_bytes, pickle.loads(fn_bytes))
        except Exception as err:
            answer = {"error": "raised", "text": f"cannot load the tool: {err!r}"}
        else:
            answer = run_call(fn, args, kwargs, limits, armed, violations)
        write_message(answers, answer_bytes(answer))


def call_process(limits: dict, keep_closed: tuple[int, ...]) -> tuple[int, int, int]:
    """Fork the call process; (pid, its request pipe, its answer pipe)."""
    request_read, request_write = os.pipe()
    answer_read, answer_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            for fd in (request_write, answer_read, *keep_closed):
                os.close(fd)
            call_loop(request_read, answer_write, limits)
        except BaseException:
            code = 70
        finally:
            os._exit(code)
    os.close(request_read)
    os.close(answer_write)
    return pid, request_write, answer_read


def replace(process: tuple[int, int, int], limits: dict, keep_closed: tuple) -> tuple[dict, tuple[int, int, int]]:
    """Kill and reap `process`; how it ended, and a fresh call process in its place."""
    status = ended(process[0], limits["seconds"], kill=True)
    os.close(process[1])
    os.close(process[2])
    return status, call_process(limits, keep_closed)


def ended(pid: int, seconds: float, kill: bool = False) -> dict:
    """The answer for a call whose process ended without one: how it ended (killed first when
    `kill`: a process that closed its pipe and went on is ended here)."""
    if kill:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return {"error": "timeout", "text": f"used more than {int(seconds) + 1} CPU seconds"}
        return {"error": "crashed", "text": f"was killed by {signal.Signals(sig).name}"}
    return {"error": "crashed", "text": f"ended its process (exit code {os.WEXITSTATUS(status)})"}


def zombie(pid: int) -> bool:
    """Ended, waiting to be reaped (or gone)."""
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] in "ZX"
    except (OSError, IndexError):
        return True


def sweep(keep: set[int]) -> None:
    """Kill every process of the jail but `keep` (and its init): what a tool left running. Again
    until none is found, so a process forking as it goes is caught too."""
    for _ in range(100):
        found = [int(name) for name in os.listdir("/proc") if name.isdigit() and int(name) not in keep | {1}]
        found = [pid for pid in found if not zombie(pid)]
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def exchange(process: tuple[int, int, int], request: bytes, cap: int) -> dict | None:
    """The call process's answer to `request`; None when it ended without one."""
    _, requests, answers = process
    try:
        write_message(requests, request)
        data = read_message(answers, cap)
    except TooLarge as err:
        return {"error": "output", "text": f"sent an answer of {err.args[0]} bytes, over the cap of {cap}"}
    except OSError:
        return None
    if data is None:
        return None
    try:
        answer = json.loads(data)
    except (ValueError, RecursionError):
        answer = None
    if not isinstance(answer, dict) or not ("ok" in answer or isinstance(answer.get("error"), str)):
        return {"error": "crashed", "text": "sent an answer that is not the sandbox's"}
    return {key: answer[key] for key in ("ok", "cut", "error", "text") if key in answer}


def tainted(pid: int, answers: int) -> str | None:
    """Why the call process cannot serve another call (None: it can): a thread left running
    after its answer, or bytes past its answer (a second, forged frame)."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return "ended"
    threads = next((line.split()[1] for line in status.splitlines() if line.startswith("Threads:")), "1")
    if threads != "1":
        return f"left {int(threads) - 1} thread(s) running"
    if select.select([answers], [], [], 0)[0]:
        return "wrote past its answer"
    return None


def serve(request_fd: int, answer_fd: int, limits: dict) -> None:
    """Each request through the call process, and its answer back. The call process serves
    calls_per_process calls at most (1: every call in a fresh process, none sees another's
    state), and is replaced sooner when it ended, failed, left a thread running or wrote past
    its answer; what it started outside itself is killed after each call."""
    cap = answer_cap(limits["output_chars"])
    process = call_process(limits, (request_fd, answer_fd))
    served = 0
    write_message(answer_fd, answer_bytes({"ready": True}))
    while True:
        request = read_message(request_fd)
        if request is None:
            return
        if select.select([process[2]], [], [], 0)[0]:  # it wrote after its last answer: not to be trusted
            (_, process), served = replace(process, limits, (request_fd, answer_fd)), 0
        pid, _, answers = process
        answer = exchange(process, request, cap)
        served += 1
        if limits["jailed"]:
            sweep({os.getpid(), pid})
        why = "ended" if answer is None else tainted(pid, answers)
        if why == "wrote past its answer" and answer is not None and "ok" in answer:  # (errors keep their kind)
            answer = {"error": "crashed", "text": "wrote past its answer (a second answer is not the sandbox's)"}
        failed = answer is None or answer.get("error") not in (None, "raised", "result")  # not the tool's own
        if why is not None or failed or served >= limits["calls_per_process"]:
            (status, process), served = replace(process, limits, (request_fd, answer_fd)), 0
            answer = answer or status
        write_message(answer_fd, answer_bytes(answer))


def main() -> None:
    request_fd, answer_fd, limits = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    sys.dont_write_bytecode = True
    os.chdir(limits["scratch"])
    os.environ.update(TMPDIR=limits["scratch"], HOME=limits["scratch"])
    if not limits["network"] and not limits["jailed"]:
        cut_network()  # a jail has its own network namespace already
    import cloudpickle  # noqa: F401  (loads the functions the parent sends)

    with contextlib.suppress(OSError, AttributeError):  # no tool may open this process's fds via /proc
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    for which, value in (
        (resource.RLIMIT_AS, limits["memory_bytes"]),
        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
        (resource.RLIMIT_NPROC, limits["processes"]),
    ):
        if value > 0:
            resource.setrlimit(which, (value, value))
    serve(request_fd, answer_fd, limits)


if __name__ == "__main__":
    main()
