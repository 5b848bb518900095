"""The README's example runs as written (its own process and Ray instance)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs():
    example = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    run = subprocess.run([sys.executable, "-c", example], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tensor([ 0.,  4.,  8., 12., 16.])" in run.stdout  # 5 rows, doubled twice, padding dropped
