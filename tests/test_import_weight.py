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
    # A reward scorer's process and its scoring child load no model stack.
    "workbench.workers.rule_reward": ["workbench.workers.actor", "transformers", "torch._dynamo"],
    # A notebook's kernel or a run's driver imports the algorithms; the engines are the workers'.
    "algorithms": ["workbench.engines.snapshot", "workbench.engines.fsdp", "torch.distributed.fsdp"],
}


@pytest.mark.parametrize("module", sorted(KEPT_OUT))
def test_an_import_loads_only_what_its_process_uses(module):
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = set(json.loads(run.stdout.strip().splitlines()[-1]))
    assert module in loaded and "torch" in loaded
    assert [m for m in KEPT_OUT[module] if m in loaded] == []
