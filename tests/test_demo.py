"""The README's main command runs end to end (in its own process and Ray instance)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_and_writes_a_trace(tmp_path):
    trace = tmp_path / "trace.json"
    run = subprocess.run(
        [sys.executable, "-m", "workbench", "demo", "--prompts", "6", "--trace", str(trace)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "critic all-reduce over its 2 ranks: [3.0, 3.0]" in run.stdout
    assert "Batch(rows=6" in run.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert {"actor.generate_sequences", "critic.compute_values", "reward.compute_reward"} <= {e["name"] for e in events}
