"""Hooks for every test item, the notebooks included: the numerical configuration in the header
and the time report per module."""

import json
import os
from pathlib import Path


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


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _times[module] = _times.get(module, 0.0) + report.duration
    if report.when == "call":
        _counts[module] = _counts.get(module, 0) + 1


def pytest_terminal_summary(terminalreporter):
    if not _times:
        return
    total = sum(_times.values())
    terminalreporter.section("time per module")
    for module, seconds in sorted(_times.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(
            f"{seconds:8.1f} s {100 * seconds / total:5.1f}% {_counts.get(module, 0):4d}  {module}"
        )
    terminalreporter.write_line(f"{total:8.1f} s in {len(_times)} modules")
    report = {"total_s": round(total, 1), "modules": {m: round(s, 2) for m, s in _times.items()}}
    Path(terminalreporter.config.rootpath, ".pytest_times.json").write_text(json.dumps(report, indent=1))
