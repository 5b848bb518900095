"""Tool sandboxes: real jailed processes under real limits. A tool that sleeps, loops, writes
outside its directory, opens a socket, starts a process, allocates without bound or kills its
own process is stopped and named, and the next call runs in a fresh (or the same) process.
What a hostile tool tries against the jail itself is in test_jail.py."""

import os
import time

import pytest

from workbench.agents import Sandbox, SandboxLimits, ToolError, calculator, python
from workbench.errors import ConfigError


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxLimits(seconds=1.5, memory_mib=256)) as box:
        yield box


def test_a_call_runs_in_a_long_lived_child(sandbox):
    assert sandbox.call(calculator, ("123 * 45",)) == "5535"
    pid = sandbox.pid
    assert pid is not None and pid != os.getpid()
    assert sandbox.call(python, ("print(sum(range(10)))",)) == "45\n"
    assert sandbox.pid == pid  # no process per call


@pytest.mark.parametrize(
    "code, kind, words",
    [
        ("import time\ntime.sleep(30)", "timeout", "took more than 1.5 s"),
        ("while True:\n    pass", "timeout", "took more than 1.5 s"),
        ("import os\nos._exit(3)", "crashed", "exit code 3"),
        ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "blocked", "no network"),
        ("import subprocess\nsubprocess.run(['true'])", "blocked", "no new processes"),
        ("import os\nos.system('true')", "blocked", "no new processes"),
        ("open('/tmp/workbench-escape.txt', 'w').write('x')", "blocked", "/tmp/workbench-escape.txt"),
        ("import os\nos.remove('/etc/hostname')", "blocked", "only inside the scratch directory"),
        ("try:\n    open('/tmp/workbench-escape.txt', 'a')\nexcept OSError:\n    pass", "blocked", "scratch"),
        ("raise RuntimeError('broken tool')", "raised", "broken tool"),
    ],
)
def test_a_misbehaving_tool_is_stopped_named_and_the_next_call_runs(sandbox, code, kind, words):
    started = time.monotonic()
    with pytest.raises(ToolError) as err:
        sandbox.call(python, (code,))
    assert err.value.kind == kind and err.value.tool == "python" and words in str(err.value)
    assert time.monotonic() - started < 15
    assert not os.path.exists("/tmp/workbench-escape.txt")
    assert sandbox.call(calculator, ("6 * 7",)) == "42"  # the next call is unaffected


def test_a_memory_bomb_is_stopped_by_the_memory_limit_not_the_clock():
    # Time to spare: on a loaded machine filling 256 MiB can outlast a tight clock.
    with Sandbox(SandboxLimits(seconds=30, memory_mib=256)) as box:
        with pytest.raises(ToolError) as err:
            box.call(python, ("x = []\nwhile True:\n    x.append(bytearray(10**7))",))
        assert err.value.kind == "memory" and "memory_mib=256" in str(err.value)
        assert box.call(calculator, ("6 * 7",)) == "42"  # the next call runs


def test_a_tool_writes_and_reads_in_its_own_scratch_directory(sandbox):
    assert sandbox.call(python, ("open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())",)) == "kept\n"
    assert (
        sandbox.call(python, ("import os\nprint(os.getcwd(), open('notes.txt').read())",))
        == f"{sandbox.scratch} kept\n"
    )


def test_the_calculator_computes_arithmetic_and_nothing_else(sandbox):
    assert sandbox.call(calculator, ("(2 + 3) ** 2 / 5",)) == "5"
    assert sandbox.call(calculator, ("7 / 2",)) == "3.5" and sandbox.call(calculator, ("-3 * -4 % 5",)) == "2"
    for bad, words in [
        ("__import__('os').system('true')", "only numbers"),
        ("abs(-3)", "only numbers"),
        ("2 ** 10 ** 10", "too large"),
        ("12 +", "not an arithmetic expression"),
        ("1 / 0", "ZeroDivisionError"),
    ]:
        with pytest.raises(ToolError, match=words) as err:
            sandbox.call(calculator, (bad,))
        assert err.value.kind == "raised"


def test_limits_are_checked_where_they_are_set():
    with pytest.raises(ConfigError, match="SandboxLimits.seconds"):
        SandboxLimits(seconds=0)
    with pytest.raises(ConfigError, match="SandboxLimits.memory_mib"):
        SandboxLimits(memory_mib=8)
    with pytest.raises(ConfigError, match="SandboxLimits.output_chars"):
        SandboxLimits(output_chars=0)
    with pytest.raises(ConfigError, match="SandboxLimits.disk_mib"):
        SandboxLimits(disk_mib=0)


def test_closing_stops_the_process():
    box = Sandbox(SandboxLimits(seconds=5))
    assert box.call(calculator, ("1 + 1",)) == "2"
    pid = box.pid
    box.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_calls_sent_without_waiting_answer_in_order_and_a_failure_does_not_lose_the_calls_behind_it(sandbox):
    """A rollout sends a turn's calls at once (Sandbox.submit) and reads them later: the jail
    runs them back to back. A call that times out kills the jail; the calls sent after it go to
    a fresh one and answer."""
    calls = [sandbox.submit(calculator, (f"{i} * 7",)) for i in range(40)]
    calls.insert(20, sandbox.submit(python, ("while True:\n    pass",)))
    calls += [sandbox.submit(calculator, (f"{i} + 1",)) for i in range(40)]
    starts = sandbox.starts
    started = time.monotonic()
    while not calls[0].ready():  # read without waiting: the first answers within the limit
        assert time.monotonic() - started < 10
        time.sleep(0.01)
    with pytest.raises(ToolError) as err:
        calls[20].result()
    assert err.value.kind == "timeout" and err.value.tool == "python"
    answers = [call.result() for i, call in enumerate(calls) if i != 20]
    assert answers == [str(i * 7) for i in range(40)] + [str(i + 1) for i in range(40)]
    assert sandbox.starts == starts + 1  # one fresh jail for the calls behind the failure


def test_more_calls_than_the_pipe_holds_do_not_wait_on_each_other(sandbox):
    """Requests that would overfill the pipe wait for earlier answers to be read first: a
    jail blocked on its unread answers never blocks the caller's writes."""
    payload = "x" * 20_000
    calls = [sandbox.submit(len, (payload + str(i),), tool="len") for i in range(120)]
    assert [call.result() for call in calls] == [20_000 + len(str(i)) for i in range(120)]
    nothing = sandbox.submit(dict.get, ({}, "absent"), tool="get")  # an answer of None (JSON null) is an answer
    nothing.result()
    assert nothing.ready() and nothing.result() is None


def test_calls_still_unanswered_fail_by_name_when_the_sandbox_closes():
    box = Sandbox(SandboxLimits(seconds=5))
    calls = [box.submit(python, ("import time\ntime.sleep(0.5)",)) for _ in range(3)]
    box.close()
    for call in calls:
        with pytest.raises(ToolError, match="its sandbox was closed"):
            call.result()
