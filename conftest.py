"""Hooks for every test item, the notebooks included: the numerical configuration in the header
and the time report per module."""

import json
import os
from pathlib import Path

import pytest


def pytest_report_header(config):
    import torch

    # Which floating-point configuration runs (`make test-numerics` changes both): say it up front.
    mkl = os.environ.get("MKL_CBWR", "unset")
    return f"numerics: ATen kernels {torch.backends.cpu.get_cpu_capability()}, MKL_CBWR={mkl}"


# The suite's time per module, printed at the end of every run (and kept in .pytest_times.json),
# so growth is visible where it happens: setup, call and teardown of each test, module-scoped
# fixtures included (they are charged to the module's first test).
_times: dict[str, float] = {}
_counts: dict[str, int] = {}
# Ray actors (worker processes) each module started on the test process's Ray: each costs seconds
# of imports, so this count, not the work per iteration, is most of the suite's time. Notebooks
# and subprocesses run their own Ray: not counted.
_processes: dict[str, int] = {}
_seen: dict[str, int] = {}  # Ray session -> actors it had at the last count


def _count_processes(module: str) -> None:
    import ray

    if not ray.is_initialized():
        return
    try:
        session, total = ray.get_runtime_context().get_session_name(), len(ray._private.state.actors())
    except Exception:  # a Ray going down mid-test: nothing to count
        return
    _processes[module] = _processes.get(module, 0) + total - _seen.get(session, 0)
    _seen[session] = total


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _times[module] = _times.get(module, 0.0) + report.duration
    if report.when == "call":
        _counts[module] = _counts.get(module, 0) + 1


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    # Once per module, as its last test's teardown begins (before the session's Ray may stop;
    # tearing down starts no actor): one query of Ray's actor table per module, not per test.
    module = item.nodeid.split("::")[0]
    if nextitem is None or nextitem.nodeid.split("::")[0] != module:
        _count_processes(module)


def pytest_terminal_summary(terminalreporter):
    if not _times:
        return
    total = sum(_times.values())
    terminalreporter.section("time per module")
    terminalreporter.write_line("   time      share tests processes  module")
    for module, seconds in sorted(_times.items(), key=lambda kv: -kv[1]):
        started = _processes.get(module)
        terminalreporter.write_line(
            f"{seconds:8.1f} s {100 * seconds / total:5.1f}% {_counts.get(module, 0):5d} "
            f"{'-' if started is None else started:>9}  {module}"
        )
    terminalreporter.write_line(
        f"{total:8.1f} s in {len(_times)} modules, {sum(_processes.values())} Ray worker processes started"
    )
    report = {
        "total_s": round(total, 1),
        "modules": {m: round(s, 2) for m, s in _times.items()},
        "processes": _processes,
    }
    Path(terminalreporter.config.rootpath, ".pytest_times.json").write_text(json.dumps(report, indent=1))
