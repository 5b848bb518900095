"""The program a tool sandbox runs (started by workbench.agents.sandbox as a script; the
workbench imports only its two message functions): it loads nothing but the standard library
and cloudpickle, so it starts in a fraction of a second, and a tool's memory limit is not eaten
by torch.

At start it takes its limits from the command line, moves into its scratch directory, caps its
memory (RLIMIT_AS), cuts itself off the network where the kernel allows (a network namespace of
its own, when run as root) and installs an audit hook that refuses, inside a tool, what a tool
must not do: sockets, new processes, and writes or deletions outside the scratch directory. The
hook is Python-level: it stops honest mistakes and the usual ways out, not native code bent on
escaping (run untrusted code in a container).

Protocol, over stdin/stdout: 4-byte big-endian length + a pickle. Each request is
(function bytes, args, kwargs); each answer ("ok", value) | ("raised", kind, text).
"""

import contextlib
import ctypes
import io
import os
import pickle
import resource
import struct
import sys
import traceback

CLONE_NEWNET = 0x40000000


class SandboxViolation(PermissionError):
    """A tool did what the sandbox refuses (the parent names it as a blocked call)."""


def read_message(stream):
    header = stream.read(4)
    if len(header) < 4:
        return None
    (size,) = struct.unpack(">I", header)
    return pickle.loads(stream.read(size))


def write_message(stream, message, dumps=pickle.dumps) -> None:
    data = dumps(message)
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def cut_network() -> bool:
    """A network namespace of its own (only a downed loopback): needs root; False otherwise."""
    try:
        return ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) == 0
    except (OSError, AttributeError):
        return False


def guard(scratch: str, network: bool):
    """An audit hook refusing sockets, processes and writes outside `scratch`, armed only while
    a tool runs (the sandbox's own pipe and imports stay free)."""
    armed = [False]
    violations: list[str] = []  # what a tool tried, even where it caught the refusal itself
    root = os.path.realpath(scratch)
    refused_events = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty"}
    path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.chmod", "os.truncate"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

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
        if event == "open" and len(args) >= 3 and args[0] is not None:
            mode, flags = args[1], args[2] or 0
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & write_flags)
            if writes and outside(args[0]):
                refuse(f"writes only inside the scratch directory {root}, not {args[0]}")
        if event in path_events and args and outside(args[0]):
            refuse(f"changes files only inside the scratch directory {root} ({event} {args[0]})")

    sys.addaudithook(hook)
    return armed, violations


def main() -> None:
    scratch, memory_bytes, network = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    sys.dont_write_bytecode = True
    os.chdir(scratch)
    os.environ.update(TMPDIR=scratch, HOME=scratch)
    if not network:
        cut_network()
    import cloudpickle  # noqa: F401  (loads the functions the parent sends)

    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    armed, violations = guard(scratch, network)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a tool's prints must not corrupt the protocol
    write_message(stdout, ("ready",))
    loaded: dict[bytes, object] = {}
    while True:
        request = read_message(stdin)
        if request is None:
            return
        fn_bytes, args, kwargs = request
        try:
            fn = loaded.get(fn_bytes) or loaded.setdefault(fn_bytes, pickle.loads(fn_bytes))
            printed = io.StringIO()
            violations.clear()
            armed[0] = True
            try:
                with contextlib.redirect_stdout(printed):
                    value = fn(*args, **kwargs)
            finally:
                armed[0] = False
            answer = ("raised", "blocked", violations[0]) if violations else ("ok", value)
        except SandboxViolation as err:
            answer = ("raised", "blocked", str(err))
        except MemoryError:
            answer = ("raised", "memory", "")
        except Exception as err:  # the tool's own error: its message and where
            answer = ("raised", "raised", f"{err!r}\n{traceback.format_exc(limit=-2)}")
        try:
            write_message(stdout, answer)
        except (TypeError, pickle.PicklingError, AttributeError) as err:
            write_message(stdout, ("raised", "raised", f"the tool's result cannot be sent back: {err!r}"))


if __name__ == "__main__":
    main()
