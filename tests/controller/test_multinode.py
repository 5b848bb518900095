"""A pool spanning two nodes of a simulated multi-node cluster (separate Ray in a subprocess,
since the test session's own Ray is single-node)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_group_ranks_sit_on_both_nodes_and_all_reduce():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "tests.controller.multinode_check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    nodes = result["nodes_by_rank"]
    assert len(set(result["cluster_nodes"])) == 2
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # ranks ordered node by node
    assert nodes == result["pool_nodes"]
    assert result["all_reduce"] == [10.0] * 4 and result["world"] == [4] * 4
