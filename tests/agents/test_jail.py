"""What a hostile tool tries against its jail: each attempt is stopped and named, the driver (this
test process) lives, and the next call answers. Most tools here go under the Python audit hook
(ctypes calls libc directly), so what stops them is the jail itself: namespaces, a uid of its
own, rlimits, and a protocol that carries only JSON."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from workbench.agents import Sandbox, SandboxLimits, ToolEnvironment, ToolError, calculator, jail, python
from workbench.data import arithmetic_chat

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the tools below, sent by value

DRIVER = os.getpid()
SECRET = "workbench-jail-secret-4127"
README = Path(__file__).resolve().parents[2] / "README.md"
MARK = Path("/tmp/workbench-jail-mark")
LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def failed(call: str) -> str:
    """Source that runs a libc call and raises its errno when it fails (prints 'done' when not)."""
    return (
        f"{LIBC}if {call} != 0:\n    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))\nprint('done')"
    )


def jail_processes(uid: int) -> list[int]:
    """Host processes running as a jail's uid."""
    found = []
    for name in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except (OSError, ValueError):
            continue
        if int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1]) == uid:
            found.append(int(name))
    return found


@pytest.fixture(scope="module")
def box():
    os.environ[SECRET] = SECRET  # the driver's environment: must not reach the jail
    # 5 s a call: room for a loaded machine 3x slower than this one (only the timeouts wait it out).
    limits = SandboxLimits(seconds=5, memory_mib=256, disk_mib=8, processes=16, output_chars=1000)
    with Sandbox(limits) as sandbox:
        assert sandbox.jailed, jail.unavailable()
        yield sandbox
    del os.environ[SECRET]


def answers_next(box: Sandbox) -> None:
    os.kill(DRIVER, 0)  # alive
    assert box.call(calculator, ("6 * 7",)) == "42"


# (case, tool source, error kind, words in the error); {driver} and {pgid} are filled in at run
# time (the ids stay the same on every xdist worker).
HOSTILE = [
    # Signals: only its own jail's processes exist for it, and it is not their uid.
    ("kill-driver", failed("libc.kill({driver}, 15)"), "raised", "ProcessLookupError"),
    ("killpg-driver", failed("libc.killpg({pgid}, 15)"), "raised", "ProcessLookupError"),
    ("kill-pid-1", failed("libc.kill(1, 9)"), "raised", "PermissionError"),
    ("os-kill-parent", "import os, signal\nos.kill(os.getppid(), signal.SIGTERM)", "blocked", "no signals to other"),
    ("os-killpg", "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)", "blocked", "no signals"),
    (
        "pthread-kill",
        "import signal, threading\nsignal.pthread_kill(threading.main_thread().ident, 9)",
        "blocked",
        "signals",
    ),
    # Files: nothing of the host's but the interpreter is there to read.
    ("driver-environ", "open('/proc/{driver}/environ', 'rb').read()", "raised", "FileNotFoundError"),
    ("driver-mem", "open('/proc/{driver}/mem', 'rb').read(1)", "raised", "FileNotFoundError"),
    ("etc-passwd", "print(open('/etc/passwd').read())", "raised", "FileNotFoundError"),
    ("project-readme", f"print(open({str(README)!r}).read())", "raised", "FileNotFoundError"),
    (
        "symlink-shadow",
        "import os\nos.symlink('/etc/shadow', 'out')\nprint(open('out').read())",
        "raised",
        "FileNotFound",
    ),
    (
        "symlink-readme",
        f"import os\nos.symlink({str(README)!r}, 'rd')\nprint(open('rd').read())",
        "raised",
        "FileNotFound",
    ),
    # Disk: one file past the size limit, or many filling the scratch directory.
    ("file-size", "open('big', 'wb').write(b'x' * 9 * 2**20)", "disk", "File too large"),
    ("disk-full", "for i in range(12):\n    open(f'part{{i}}', 'wb').write(b'x' * 2**20)", "disk", "No space left"),
    # Processes, memory, time.
    ("fork-bomb", f"{LIBC}while True:\n    libc.fork()", "timeout", "took more than 5 s"),
    ("4-gib", "x = bytearray(4 * 2**30)", "memory", "SandboxLimits.memory_mib=256"),
    (
        "ignores-sigterm",
        "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: pass",
        "timeout",
        "took more than 5 s",
    ),
    # Sockets: refused by the hook; under it (test_sockets_reach_nothing_outside), nothing outside.
    ("udp-socket", "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM)", "blocked", "no network"),
    ("unix-socket", "import socket\nsocket.socket(socket.AF_UNIX, socket.SOCK_STREAM)", "blocked", "no network"),
]


@pytest.mark.parametrize("code, kind, words", [pytest.param(*case[1:], id=case[0]) for case in HOSTILE])
def test_a_hostile_tool_is_stopped_and_named_and_the_next_call_answers(box, code, kind, words):
    started = time.monotonic()
    with pytest.raises(ToolError) as err:
        box.call(python, (code.format(driver=DRIVER, pgid=os.getpgrp()),))
    assert (err.value.kind, err.value.tool) == (kind, "python") and words in str(err.value), str(err.value)
    assert time.monotonic() - started < 15
    answers_next(box)


def test_killing_every_process_it_can_ends_only_its_own_jail(box):
    with pytest.raises(ToolError) as err:
        box.call(python, (failed("libc.kill(-1, 9)"),))
    assert err.value.kind == "crashed" and "ended its sandbox process" in str(err.value)
    answers_next(box)


def test_a_fork_bomb_leaves_no_process_behind(box):
    with pytest.raises(ToolError, match="took more than 5 s"):
        box.call(python, (f"{LIBC}while True:\n    libc.fork()",))
    deadline = time.monotonic() + 10
    while jail_processes(box.uid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert jail_processes(box.uid) == []  # the jail and every process of the bomb: gone
    answers_next(box)
    assert len(jail_processes(box.uid)) == 2  # a fresh jail: its server and its call process


def test_the_drivers_environment_and_processes_are_out_of_sight(box):
    seen = box.call(
        python,
        (
            "import os\n"
            "for pid in os.listdir('/proc'):\n"
            "    try:\n"
            "        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
            "    except (OSError, NotADirectoryError):\n"
            "        pass\n"
            "print(os.environ)",
        ),
    )
    assert SECRET not in seen and str(DRIVER) not in seen.split()
    listing = box.call(python, ("import os\nprint(sorted(os.listdir('/')), os.getuid())",))
    assert "etc" not in listing and "home" not in listing and int(listing.split()[-1]) == box.uid


def test_sockets_reach_nothing_outside(box):
    """Under the hook (ctypes): a UDP datagram to the driver's port and a connection to the
    driver's Unix sockets (abstract and on a path) reach nothing."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.5)
    port = udp.getsockname()[1]
    abstract, path = f"\0workbench-jail-{DRIVER}", f"/tmp/workbench-jail-{DRIVER}.sock"
    listeners = []
    for address in (abstract, path):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen()
        listeners.append(listener)
    try:
        sent = box.call(
            python,
            (
                f"{LIBC}import socket, struct\n"
                "fd = libc.socket(socket.AF_INET, socket.SOCK_DGRAM, 0)\n"
                f"to = struct.pack('<H', socket.AF_INET) + struct.pack('>H', {port}) + bytes([127, 0, 0, 1])\n"
                "to += bytes(8)\n"
                "print(libc.sendto(fd, b'hello', 5, 0, to, len(to)))",
            ),
        )
        with pytest.raises(TimeoutError):
            udp.recvfrom(16)  # whatever sendto said in the jail's own network, nothing arrived here
        for address in (abstract, path):
            name = address.encode()
            with pytest.raises(ToolError) as err:
                box.call(
                    python,
                    (
                        f"{LIBC}import socket, struct\n"
                        "fd = libc.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0)\n"
                        f"to = struct.pack('<H', socket.AF_UNIX) + {name!r}\n"
                        + failed("libc.connect(fd, to, len(to))").removeprefix(LIBC),
                    ),
                )
            assert err.value.kind == "raised" and any(
                w in str(err.value) for w in ("ConnectionRefused", "FileNotFound")
            )
        assert sent.strip()  # the datagram call itself ran
    finally:
        udp.close()
        for listener in listeners:
            listener.close()
        Path(path).unlink(missing_ok=True)
    answers_next(box)


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARK}",))


class EvilText(str):
    def __reduce__(self):
        return (os.system, (f"touch {MARK}",))

    def __setstate__(self, state):
        os.system(f"touch {MARK}")


def returns_evil():
    return Evil()


def returns_evil_text():
    return EvilText("plain words")


def returns_generator():
    return (i for i in range(3))


def returns_data():
    return {"a": [1, 2.5, None], "b": "text"}


def forges_an_answer(size: int, body: bytes):
    """Writes a frame of its own on every descriptor it holds (the protocol pipe among them)."""
    import struct

    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd > 2:
            try:
                os.write(fd, struct.pack(">I", size) + body)
            except OSError:
                pass
    return "forged"


def forges_then_returns(sleep: float):
    """Writes a well-formed answer of its own on every descriptor, then returns its real one
    `sleep` seconds later (so that, with a reused process, it would arrive during the next call)."""
    import json
    import struct
    import time

    frame = json.dumps({"ok": "forged", "cut": 0}).encode()
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd > 2:
            try:
                os.write(fd, struct.pack(">I", len(frame)) + frame)
            except OSError:
                pass
    time.sleep(sleep)
    return "real"


def leaves_a_thread():
    import threading
    import time

    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    return "left one"


def threads() -> int:
    import threading

    return threading.active_count()


def marks_builtins(mark: bool):
    import builtins

    if mark:
        builtins.workbench_mark = True
    return hasattr(builtins, "workbench_mark")


def floods(characters: int):
    return "x" * characters


def prints_to_its_real_stdout():
    import sys

    os.write(1, b"x" * 100_000)
    sys.__stdout__.write("1234 is not a length\n")
    sys.__stdout__.flush()
    return "fine"


def test_results_are_data_never_code(box):
    MARK.unlink(missing_ok=True)
    with pytest.raises(ToolError) as err:
        box.call(returns_evil)
    assert err.value.kind == "result" and "returned a Evil, not data" in str(err.value)
    assert box.call(returns_evil_text) == "plain words"  # as plain text: no method of its runs here
    with pytest.raises(ToolError, match="returned a generator, not data"):
        box.call(returns_generator)
    assert box.call(returns_data) == {"a": [1, 2.5, None], "b": "text"}
    assert box.call(lambda: None) is None
    assert not MARK.exists()
    answers_next(box)


def test_a_forged_answer_is_refused(box):
    import pickle

    with pytest.raises(ToolError) as err:
        box.call(forges_an_answer, (2**31, b""))
    assert err.value.kind == "output" and "over the cap" in str(err.value)
    answers_next(box)
    payload = pickle.dumps(Evil())
    with pytest.raises(ToolError) as err:
        box.call(forges_an_answer, (len(payload), payload))
    assert err.value.kind == "crashed" and "not the sandbox's" in str(err.value)
    assert not MARK.exists()
    answers_next(box)


def test_a_thread_left_running_ends_with_its_process(box):
    assert box.call(leaves_a_thread) == "left one"
    assert box.call(threads) == 1
    answers_next(box)


def test_a_fresh_process_per_call_keeps_calls_independent():
    """calls_per_process=1: nothing one call leaves (a patched module, an answer written late)
    reaches the next."""
    with Sandbox(SandboxLimits(seconds=10, calls_per_process=1)) as fresh:
        assert fresh.call(marks_builtins, (True,)) and not fresh.call(marks_builtins, (False,))
        for late in (0.0, 0.5):  # its own answer is its own to give; it never becomes the next call's
            try:
                assert fresh.call(forges_then_returns, (late,)) == "forged"
            except ToolError as err:  # the real answer came before the check: named
                assert err.kind == "crashed" and "wrote past its answer" in str(err)
            answers_next(fresh)
    # The default: calls share a process, and what a call leaves in it (docs/sandbox.md).
    with Sandbox(SandboxLimits(seconds=10)) as reused:
        assert reused.call(marks_builtins, (True,)) and reused.call(marks_builtins, (False,))


def test_printing_to_the_real_stdout_reaches_nobody(box):
    started = time.monotonic()
    assert box.call(prints_to_its_real_stdout) == "fine"
    assert time.monotonic() - started < 10  # (before the jail: no answer after 43 s)
    answers_next(box)


def test_a_flood_of_output_is_cut_before_anything_reads_it(box):
    started = time.monotonic()
    text = box.call(floods, (50_000_000,))
    assert time.monotonic() - started < 30  # (before: handed whole to the tokenizer, 154 s)
    assert text.startswith("x" * 1000) and text.endswith("(49999000 more characters cut)")
    assert box.last_cut == 49_999_000
    answers_next(box)
    assert box.last_cut == 0


def test_a_cut_answer_is_counted_in_the_observation():
    env = ToolEnvironment({"floods": floods}, arithmetic_chat.score, SandboxLimits(seconds=10, output_chars=100))
    try:
        cut = env.step({}, '<tool_call>{"name": "floods", "arguments": {"characters": 5000}}</tool_call>')
        whole = env.step({}, '<tool_call>{"name": "floods", "arguments": {"characters": 50}}</tool_call>')
    finally:
        env.close()
    assert cut.info == {"tool": "floods", "tool_output_cut": 4900} and len(cut.text) < 200
    assert whole.info == {"tool": "floods"} and whole.text == "x" * 50


def test_without_a_jail_untrusted_tools_are_refused_and_trusted_ones_run():
    """A machine without bubblewrap (here: a PATH without it), in a fresh interpreter."""
    program = (
        "from workbench.agents import Sandbox, SandboxLimits, ToolEnvironment, calculator\n"
        "from workbench.agents.sandbox import SandboxUnavailable\n"
        "try:\n"
        "    ToolEnvironment({'calculator': calculator}, str)\n"
        "except SandboxUnavailable as err:\n"
        "    print('refused:', err)\n"
        "with Sandbox(SandboxLimits(trust_tools=True)) as box:\n"
        "    print('trusted:', box.jailed, box.call(calculator, ('6 * 7',)))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={"PATH": "/nonexistent"},
    )
    assert done.returncode == 0, done.stderr
    refused, trusted = done.stdout.splitlines()
    assert "bubblewrap is not installed" in refused and "SandboxLimits(trust_tools=True)" in refused
    assert trusted == "trusted: False 42"


def test_closing_leaves_no_jail_behind():
    box = Sandbox(SandboxLimits(seconds=10))
    assert box.call(calculator, ("1 + 1",)) == "2"
    assert len(jail_processes(box.uid)) == 2
    box.close()
    deadline = time.monotonic() + 5
    while jail_processes(box.uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert jail_processes(box.uid) == []
