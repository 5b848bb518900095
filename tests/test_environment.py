"""environment.yml (conda users) and pyproject.toml (pip, the Makefile) name the same pins."""

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = set(project["dependencies"]) | {d for group in project["optional-dependencies"].values() for d in group}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    python = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python")]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert python == ["python=3.11"] and project["requires-python"].startswith(">=3.11")
    assert set(pip) == pinned, f"only in pyproject: {pinned - set(pip)}; only in environment.yml: {set(pip) - pinned}"
    assert all("==" in d for d in pinned), "every dependency is pinned"
