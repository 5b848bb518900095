"""The planner is pure Python: every module of it imports, and it plans a built-in algorithm,
in an interpreter where Ray, torch and the rest of the model stack cannot be imported at all
(the import-linter contract "pure-planner" holds the code to the same)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("ray", "torch", "transformers", "tensordict", "vllm", "deepspeed")
NOT_LOADED = (*FORBIDDEN, "algorithms")  # found to read its files, never run

BARE = f"""
import importlib, pkgutil, sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {FORBIDDEN!r}:
            raise ImportError("the planner imported " + name)

sys.meta_path.insert(0, Refuse())
import workbench.planner as planner
for module in pkgutil.iter_modules(planner.__path__):
    importlib.import_module("workbench.planner." + module.name)
from workbench.planner import Problem, Workload, automap, cluster_preset, dataflow_preset, search
plan = automap(Problem(dataflow_preset("ppo"), "llama2-7b", Workload(), cluster_preset("a100_80g", 16)))
local = cluster_preset("local", 2)
found = search(Problem(dataflow_preset("grpo"), "tiny-1m", Workload.tiny(), local), max_steps=200, seeds=(0,))
loaded = sorted(name for name in sys.modules if name.split(".")[0] in {NOT_LOADED!r})
print(len(plan.sets), found.plan is not None, loaded)
"""


def test_the_planner_loads_and_plans_without_the_model_stack():
    run = subprocess.run(
        [sys.executable, "-c", BARE], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    sets, found, loaded = run.stdout.split(" ", 2)
    assert int(sets) >= 1 and found == "True" and loaded.strip() == "[]"
