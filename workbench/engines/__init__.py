"""Engines behind the model workers: rollout (HF generate, vLLM) and training (FSDP, DeepSpeed)."""
