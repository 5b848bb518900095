"""The peers' own virtualenvs, and running a peer script in one (bench/vs_trl.py, bench/real_model.py).

A peer (TRL) brings its own transformers and accelerate, so it runs as a subprocess of a
virtualenv built once under .cache/peers/ (torch first, pinned to the CPU wheel), reading its
settings from a JSON file and printing its result as the last line of stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".cache" / "peers"
PEER_SCRIPTS = ROOT / "bench" / "peers"


def peer_python(requirement: str, extras: tuple[str, ...] = ()) -> Path:
    """A virtualenv holding torch (the CPU pin), `requirement` and `extras`, built once under
    .cache/peers (an extra added later is installed into the existing environment).
    $PEER_PYTHON, when set, is used instead as it is: a machine without network (the lent GPU
    machine, bench/gpu_steps.sh) brings the peer's packages itself."""
    if os.environ.get("PEER_PYTHON"):
        return Path(os.environ["PEER_PYTHON"])
    venv = PEERS / requirement.replace("==", "-")
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    stamp = venv / ".installed"
    if not stamp.exists():
        print(f"building the peer environment {venv} ({requirement}) ...", flush=True)
        subprocess.run(["python3.11", "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU wheel first, as the Makefile does
        subprocess.run([*pip, requirement], check=True)
        stamp.touch()
    for extra in extras:
        extra_stamp = venv / f".installed-{extra.replace('==', '-')}"
        if not extra_stamp.exists():
            print(f"adding {extra} to the peer environment {venv} ...", flush=True)
            subprocess.run([*pip, extra], check=True)
            extra_stamp.touch()
    return python


def run_peer(
    script: str,
    requirement: str,
    settings: dict,
    threads: int,
    extras: tuple[str, ...] = (),
    echo: bool = False,
) -> dict:
    """Run bench/peers/<script> in the peer's environment on `settings`; its last stdout line
    (JSON) is the result. `echo` shows the peer's stderr (its progress) as it runs."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(settings, f)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(PEER_SCRIPTS),
    }
    try:
        out = subprocess.run(
            [str(peer_python(requirement, extras)), str(PEER_SCRIPTS / script), f.name],
            stdout=subprocess.PIPE,
            stderr=None if echo else subprocess.PIPE,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),
        )
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        detail = "its stderr is above" if echo else out.stderr[-4000:]
        raise RuntimeError(f"peer {script} ({requirement}) failed with exit code {out.returncode}:\n{detail}")
    if echo:
        sys.stderr.flush()
    return json.loads(out.stdout.strip().splitlines()[-1])
