"""The README's main command runs end to end (in its own process and Ray instance)."""

import json
import re
import subprocess
import sys
from pathlib import Path

from workbench.stages.arithmetic_policy import DEFAULT_CACHE

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_real_workers_and_writes_a_trace(tmp_path):
    trace = tmp_path / "trace.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench",
            "demo",
            "--prompts",
            "6",
            "--iterations",
            "2",
            # The kit's SFT policy (200 steps) where the notebooks find it: trained once per machine.
            "--workdir",
            str(DEFAULT_CACHE),
            "--trace",
            str(trace),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Batch(rows=12" in run.stdout  # 6 prompts x 2 samples
    assert len(re.findall(r"^iter +\d+ .*vf_loss=", run.stdout, re.M)) == 2
    for when in ("before PPO", "after 2 PPO iterations"):
        accuracy = float(re.search(rf"accuracy \(greedy\) {when}: ([0-9.]+)", run.stdout).group(1))
        assert 0.0 <= accuracy <= 1.0
    events = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert {
        "actor.generate_sequences",
        "actor.compute_ref_log_prob",
        "critic.compute_values",
        "critic.update_critic",
        "actor.update_actor",
        "actor.hybrid.sync_weights",
    } <= events
