"""The shared forward's inputs: trimmed of all-padding columns, and never views, so a compiled
forward (LoadConfig.compile) keeps one graph whatever the trimming."""

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo

from workbench import Batch
from workbench.engines.forward import response_log_probs, sequence_nll, trim_padding
from workbench.models import load, make_tiny


def batch(prompt_pad: int, response_len: int, rows: int = 4, prompt: int = 6, r: int = 5) -> Batch:
    """Left-padded prompts (the first `prompt_pad` columns padding in every row) and responses
    of `response_len` tokens out of `r` (the rest padding in every row)."""
    attention = torch.ones(rows, prompt + r, dtype=torch.long)
    attention[:, :prompt_pad] = 0
    attention[:, prompt + response_len :] = 0
    response_mask = attention[:, prompt:].clone()
    input_ids = torch.randint(3, 200, (rows, prompt + r)) * attention
    return Batch(
        {
            "input_ids": input_ids,
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "responses": input_ids[:, prompt:],
            "response_mask": response_mask,
        }
    )


@pytest.mark.parametrize("prompt_pad, response_len", [(0, 5), (2, 3)], ids=["nothing-trimmed", "trimmed"])
def test_trimmed_inputs_are_fresh_tensors(prompt_pad, response_len):
    inputs, kept = trim_padding(batch(prompt_pad, response_len))
    assert kept == response_len
    assert inputs["input_ids"].shape[1] == 6 - prompt_pad + response_len
    for name, tensor in inputs.items():
        assert tensor.is_contiguous() and tensor._base is None, (
            f"{name} is a view: a compiled forward would guard on its base"
        )


def test_the_pretraining_forward_gets_fresh_tensors_from_a_micro_batch_view():
    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            seen.append((input_ids._base, attention_mask._base))
            return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 200))

    rows = batch(0, 5)
    micro = rows["input_ids"][1:3], rows["attention_mask"][1:3]  # slices of the mini-batch, as the engines cut them
    assert micro[0]._base is not None
    sequence_nll(Recorder(), *micro, loss_mask=micro[1])
    assert seen == [(None, None)]


def test_a_compiled_forward_does_not_recompile_when_the_trimming_changes(tmp_path):
    model = load(make_tiny("1m", tmp_path / "tiny", seed=0)).model.eval()
    model.compile(dynamic=True)
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for prompt_pad, response_len in ((0, 5), (2, 3), (0, 5), (1, 4)):  # untrimmed slices were views
            log_probs, _ = response_log_probs(model, batch(prompt_pad, response_len))
            assert torch.isfinite(log_probs).all()
