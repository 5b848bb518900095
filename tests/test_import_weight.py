"""What a fresh process loads when it imports one part of the workbench: every Ray worker process
pays its imports at start (a run starts dozens), so a module that pulls in what its process
never uses costs seconds each time. Each import runs in a process of its own."""

import json
import subprocess
import sys

import pytest

# module imported -> modules that must not have come with it (and why)
KEPT_OUT = {
    # A worker host (every Ray worker) holds Batches; it compiles nothing unless a model does.
    "workbench.controller.worker": ["torch._dynamo"],
    # A reward scorer's process loads no model stack.
    "workbench.workers.rule_reward": ["workbench.workers.actor", "transformers", "torch._dynamo"],
    # Its scoring child (one per scorer, and again for each child killed at its time limit)
    # loads what the reward function's pickle needs, and a task's own reward needs no torch.
    "workbench.workers.reward_child": ["torch", "ray", "workbench.controller"],
    "workbench.data.arithmetic": ["torch", "tensordict"],
    # A notebook's kernel or a run's driver imports the algorithms; the engines are the workers'.
    "algorithms": ["workbench.engines.snapshot", "workbench.engines.fsdp", "torch.distributed.fsdp"],
}


@pytest.mark.parametrize("module", sorted(KEPT_OUT))
def test_an_import_loads_only_what_its_process_uses(module):
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = set(json.loads(run.stdout.strip().splitlines()[-1]))
    assert module in loaded
    assert [m for m in KEPT_OUT[module] if m in loaded] == []
