"""Hooks for every test item, the notebooks included: the numerical configuration in the header,
the time report per module, and the order modules run in (longest first, so that `make test`'s
parallel workers finish together)."""

import json
import os
from pathlib import Path

import pytest

# `make test` runs modules in parallel (pytest-xdist, `-n auto`): one worker per core, each with
# its own Ray, kernels and warm processes, so memory caps it too (two workers peaked at 15.6 GiB
# in use together on a 24 GiB machine); more than 4 has not been tried.
WORKER_GIB = 8
MAX_WORKERS = 4


# Notebooks that each hold SmolLM2 on a 2-rank actor (~2.8 GB a rank, beside their kernel and Ray):
# one xdist work unit, run one after another on one worker. Two of them side by side, with another
# module's workers, took the machine past Ray's memory monitor (95%), which then killed workers.
ONE_AT_A_TIME = "SmolLM2 notebooks"
SMOLLM2_NOTEBOOKS = frozenset(
    f"notebooks/{name}.ipynb" for name in ("08_real_model", "09_your_own_task", "11_replay_and_compare")
)


def _unit(module: str) -> str:
    """The work unit a module runs in under `make test`: itself, or the SmolLM2 notebooks' unit."""
    return ONE_AT_A_TIME if module in SMOLLM2_NOTEBOOKS else module


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByUnit(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(super()._split_scope(nodeid))

    return ByUnit(config, log)


def pytest_xdist_auto_num_workers(config):
    import psutil

    by_memory = int(psutil.virtual_memory().total / 2**30 // WORKER_GIB)
    return max(1, min(os.cpu_count() or 1, by_memory, MAX_WORKERS))


def pytest_report_header(config):
    import torch

    # Which floating-point configuration runs (`make test-numerics` changes both): say it up front.
    mkl = os.environ.get("MKL_CBWR", "unset")
    return f"numerics: ATen kernels {torch.backends.cpu.get_cpu_capability()}, MKL_CBWR={mkl}"


# The suite's time per module, printed at the end of every run, so growth is visible where it
# happens: setup, call and teardown of each test, module-scoped fixtures included (they are
# charged to the module's first test). Kept per machine beside the kit's cached models (a fresh
# clone finds it), merged with earlier runs, to order the next run.
TIMES = Path.home() / ".cache" / "hybridflow-workbench" / "test-times.json"
# A fresh machine has no record: one run's times here, kept in the repo, order its first run
# (a long module left last by file order leaves the other worker idle for minutes).
SEED_TIMES = Path(__file__).parent / "tests" / "module_times.json"
_times: dict[str, float] = {}
_counts: dict[str, int] = {}
# Ray actors (worker processes) each module started on the test process's Ray: each costs seconds
# of imports, so this count, not the work per iteration, is most of the suite's time. Notebooks
# and subprocesses run their own Ray: not counted.
_processes: dict[str, int] = {}
_seen: dict[str, int] = {}  # Ray session -> actors it had at the last count


def _count_processes() -> int | None:
    """Actors started on this process's Ray since the last count."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        session, total = ray.get_runtime_context().get_session_name(), len(ray._private.state.actors())
    except Exception:  # a Ray going down mid-test: nothing to count
        return None
    started = total - _seen.get(session, 0)
    _seen[session] = total
    return started


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_runtest_logreport(report):
    # Under xdist this runs on the controller too, with the workers' reports.
    module = _module(report.nodeid)
    _times[module] = _times.get(module, 0.0) + report.duration
    if report.when == "call":
        _counts[module] = _counts.get(module, 0) + 1
    for key, value in report.user_properties:
        if key == "ray_processes" and report.when == "teardown":
            _processes[module] = _processes.get(module, 0) + value


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    # Once per module, as its last test's teardown begins (before the session's Ray may stop;
    # tearing down starts no actor): one query of Ray's actor table per module, not per test.
    # The count rides on the teardown report, so an xdist worker's reaches the controller.
    if nextitem is None or _module(nextitem.nodeid) != _module(item.nodeid):
        started = _count_processes()
        if started is not None:
            item.user_properties.append(("ray_processes", started))


def _recorded_times() -> dict[str, float]:
    """This machine's record over the repo's seed: a new machine's first run is ordered too."""
    times: dict[str, float] = {}
    for path in (SEED_TIMES, TIMES):
        try:
            times.update(json.loads(path.read_text())["modules"])
        except (OSError, ValueError, KeyError):
            pass
    return times


def pytest_collection_modifyitems(config, items):
    # Longest module first (by this machine's last runs; unknown modules count as long): the
    # parallel workers take modules in this order, and a long module taken last would leave
    # the other worker idle. Tests keep their order inside a module (module fixtures are shared).
    # A work unit of several modules (ONE_AT_A_TIME) counts their times together.
    recorded: dict[str, float] = {}
    for module, seconds in _recorded_times().items():
        recorded[_unit(module)] = recorded.get(_unit(module), 0.0) + seconds
    first = {}
    for i, item in enumerate(items):
        first.setdefault(_module(item.nodeid), i)

    def key(item):
        module = _module(item.nodeid)
        return -recorded.get(_unit(module), float("inf")), first[module]

    items.sort(key=key)


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
    TIMES.parent.mkdir(parents=True, exist_ok=True)
    modules = {**_recorded_times(), **{m: round(s, 2) for m, s in _times.items()}}
    report = {"last_run_s": round(total, 1), "modules": modules, "processes": _processes}
    TIMES.write_text(json.dumps(report, indent=1))
