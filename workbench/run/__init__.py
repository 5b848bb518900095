"""Run-level tools: whole-run checkpoints (checkpoint.py)."""
