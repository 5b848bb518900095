"""The wheels the lent GPU machine lacks, in .cache/gpu_wheels (ignored; `run` carries it).

    .venv/bin/python bench/gpu_wheels.py      # then: run(..., carry=[".cache/gpu_wheels"])
    .venv/bin/python bench/gpu_wheels.py --steps   # also TRL and SmolLM2's shape (bench/gpu_steps.sh)

That machine has Python 3.12, torch 2.11 (CUDA), transformers, peft, accelerate, cloudpickle,
psutil, pyyaml, msgpack, protobuf, aiohttp and most of Ray's other needs, but no Ray, tensordict
or pyvers and no network. Ray's wheel (79 MB) is over what a call carries beside the tree
(64 MiB in all), so it travels trimmed: without the Java jar, the dashboard's web client and the
libraries the workbench never imports (RLlib, Data, Serve, Tune, Train, LLM). What stays starts a
local cluster with include_dashboard=False: the raylet, the GCS, the core worker, and the
dashboard and runtime-env agents that every node starts. bench/gpu_run.sh installs them there.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".cache" / "gpu_wheels"
PINS = ("ray==2.60.0", "tensordict==0.15.3", "pyvers==0.2.3", "jsonschema==4.26.0") + (
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==0.30.0",
)
"""Versions of the project's pins (pyproject.toml) where it pins them; the rest are tensordict's
(pyvers) and Ray's (jsonschema and its needs) dependencies that the image lacks."""
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
RAY_DROPPED = (
    "ray/jars/",
    "ray/dashboard/client/",
    "ray/rllib/",
    "ray/data/",
    "ray/serve/",
    "ray/tune/",
    "ray/train/",
    "ray/llm/",
)
"""Path prefixes inside Ray's wheel that a local cluster without the dashboard never reads."""


def download(pin: str, into: Path) -> None:
    tags = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", *tags, "-d", str(into), pin]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def trim(wheel: Path, dropped: tuple[str, ...]) -> None:
    """Rewrite `wheel` in place without the files under `dropped`; RECORD lists what is kept
    (pip installs from it, so it must not name absent files)."""
    out = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in src.infolist():
            if info.filename.startswith(dropped) or info.filename == record_name:
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{info.filename},sha256={digest},{len(data)}")
        rows.append(f"{record_name},,")
        dst.writestr(record_name, "\n".join(rows) + "\n")
    out.replace(wheel)


STEPS_PINS = ("trl==1.16.0",)
"""--steps (bench/gpu_steps.sh): TRL 1.16 for the real-model step against it. Its other needs
(accelerate, datasets, ...) must be in the image or added here: pip download them the same way
and check the carried total stays under 64 MiB."""
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def main() -> int:
    WHEELS.mkdir(parents=True, exist_ok=True)
    pins = PINS + (STEPS_PINS if "--steps" in sys.argv else ())
    if "--steps" in sys.argv:  # the model's shape and tokenizer (3.5 MB); its weights are made there
        from workbench.models.gguf_import import import_gguf

        model = import_gguf("smollm2")
        (WHEELS / "smollm2").mkdir(exist_ok=True)
        for name in MODEL_FILES:
            if (model / name).exists():
                (WHEELS / "smollm2" / name).write_bytes((model / name).read_bytes())
    for pin in pins:
        name = pin.split("==")[0].replace("-", "_")
        if not any(WHEELS.glob(f"{name}-{pin.split('==')[1]}-*.whl")):
            download(pin, WHEELS)
    (ray,) = WHEELS.glob("ray-*.whl")
    with zipfile.ZipFile(ray) as z:
        trimmed = not any(n.startswith(RAY_DROPPED) for n in z.namelist())
    if not trimmed:
        trim(ray, RAY_DROPPED)
    total = 0
    for wheel in sorted(WHEELS.glob("*.whl")):
        total += wheel.stat().st_size
        print(f"{wheel.stat().st_size / 2**20:8.2f} MiB  {wheel.name}")
    print(f"{total / 2**20:8.2f} MiB  in all ({WHEELS})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
