"""The shared forward's inputs: trimmed of all-padding columns, and never views, so a compiled
forward (LoadConfig.compile) keeps one graph whatever the trimming."""

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo

from tests.kit import make_one_block
from workbench import Batch
from workbench.engines import forward
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
    model = load(make_one_block(tmp_path / "tiny", seed=0)).model.eval()
    model.compile(dynamic=True)
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for prompt_pad, response_len in ((0, 5), (2, 3), (0, 5), (1, 4)):  # untrimmed slices were views
            log_probs, _ = response_log_probs(model, batch(prompt_pad, response_len))
            assert torch.isfinite(log_probs).all()


# ---- chunked log-probs: a real vocabulary without B x R x V fp32 at once -------------------------
def large_vocab_logits(rows=3, r=5, vocab=50_000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, r, vocab, generator=generator)
    return logits, torch.randint(0, vocab, (rows, r), generator=generator)


def within(got: torch.Tensor, exact: torch.Tensor, tolerance: float = 1e-6) -> bool:
    """|got - exact| <= tolerance, relative to the largest |exact| (log-probs of -20 are only
    exact to ~2e-6 in fp32: one unit in the last place)."""
    return bool((got.double() - exact).abs().max() <= tolerance * max(1.0, exact.abs().max().item()))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_equal_the_full_softmax_and_its_gradients(monkeypatch, temperature):
    logits, tokens = large_vocab_logits()
    monkeypatch.setitem(forward.CHUNK_ELEMENTS, "cpu", 4 * logits.shape[-1])  # 15 positions: chunks of 4, 4, 4, 3
    weights = torch.randn(2, *tokens.shape, generator=torch.Generator().manual_seed(1))
    results = {}
    # The full softmax in float64 is the truth; fp32 one-shot and chunked are both measured against it.
    for how in ("exact", "full", "chunked"):
        leaf = logits.to(torch.float64 if how == "exact" else torch.float32).clone().requires_grad_()
        if how == "exact":
            log_p = torch.log_softmax(leaf / temperature, -1)
            log_probs, entropy = log_p.gather(-1, tokens[..., None])[..., 0], -(log_p.exp() * log_p).sum(-1)
        else:
            log_probs, entropy = forward.token_log_probs(leaf, tokens, temperature, True, chunked=how == "chunked")
        ((weights[0] * log_probs).sum() + (weights[1] * entropy).sum()).backward()
        results[how] = log_probs.detach(), entropy.detach(), leaf.grad
    for name, exact, full, chunked in zip(("log_probs", "entropy", "gradient"), *results.values()):
        assert chunked.dtype == torch.float32 and chunked.shape == exact.shape, name
        assert within(chunked, exact), name
        # no worse than the one-shot fp32 log_softmax it replaces
        assert (chunked.double() - exact).abs().max() <= (full.double() - exact).abs().max() + 1e-9, name
    assert results["exact"][2].abs().max() > 1e-3  # the gradients compared are not all zero


def test_chunked_log_probs_without_entropy_and_from_bf16(monkeypatch):
    logits, tokens = large_vocab_logits(rows=2, r=3, vocab=9000)
    monkeypatch.setitem(forward.CHUNK_ELEMENTS, "cpu", 2 * logits.shape[-1])
    leaf = logits.bfloat16().requires_grad_()
    log_probs, entropy = forward.token_log_probs(leaf, tokens)  # 9000 >= CHUNKED_VOCAB: chunked by default
    assert entropy is None and log_probs.dtype == torch.float32
    assert within(log_probs, torch.log_softmax(leaf.double(), -1).gather(-1, tokens[..., None])[..., 0])
    log_probs.sum().backward()
    assert leaf.grad.dtype == torch.bfloat16 and torch.isfinite(leaf.grad).all()


def test_the_tiny_kits_vocabulary_keeps_the_one_shot_log_softmax(monkeypatch):
    def refuse(*args):
        raise AssertionError("a 262-token vocabulary took the chunked path")

    monkeypatch.setattr(forward.ChunkedLogProbs, "apply", refuse)
    logits, tokens = large_vocab_logits(vocab=262)
    log_probs, entropy = forward.token_log_probs(logits, tokens, with_entropy=True)
    log_p = torch.log_softmax(logits, -1)
    assert torch.equal(log_probs, log_p.gather(-1, tokens[..., None])[..., 0])
    assert torch.equal(entropy, -(log_p.exp() * log_p).sum(-1))


def test_pretraining_nll_of_a_large_vocabulary_is_chunked_and_equal():
    logits, input_ids = large_vocab_logits(rows=2, r=6, vocab=20_000)

    class Fixed(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return SimpleNamespace(logits=logits)

    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])
    got = sequence_nll(Fixed(), input_ids, torch.ones_like(input_ids), loss_mask)
    exact = logits.double()[:, :-1].transpose(1, 2)
    nll = torch.nn.functional.cross_entropy(exact, input_ids[:, 1:], reduction="none")
    mask = loss_mask[:, 1:].float()
    assert within(got, ((nll * mask).sum(1) / mask.sum(1)).double())


def repeated_prompts(rows_per_prompt: int = 3, prompts: int = 3, prompt: int = 7, r: int = 6, seed: int = 0) -> Batch:
    """Each of `prompts` left-padded prompts (lengths differ) `rows_per_prompt` times, rows
    shuffled, with responses of different lengths: GRPO's n samples per prompt."""
    g = torch.Generator().manual_seed(seed)
    rows = prompts * rows_per_prompt
    prompt_mask = (torch.arange(prompt)[None] >= torch.tensor([0, 2, 3][:prompts])[:, None]).long()
    prompt_ids = torch.randint(3, 200, (prompts, prompt), generator=g) * prompt_mask
    order = torch.randperm(rows, generator=g)
    prompt_ids = prompt_ids.repeat_interleave(rows_per_prompt, 0)[order]
    prompt_mask = prompt_mask.repeat_interleave(rows_per_prompt, 0)[order]
    lengths = torch.randint(1, r + 1, (rows,), generator=g)
    response_mask = (torch.arange(r)[None] < lengths[:, None]).long()
    responses = torch.randint(3, 200, (rows, r), generator=g) * response_mask
    attention = torch.cat([prompt_mask, response_mask], 1)
    return Batch(
        {
            "input_ids": torch.cat([prompt_ids, responses], 1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": response_mask,
        }
    )


def log_probs_and_grads(model, rows: Batch, share: bool) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    log_probs, entropy = response_log_probs(model, rows, with_entropy=True, share_prompts=share)
    (log_probs.sum() + entropy.sum()).backward()
    return log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("r", [6, 1], ids=["responses", "one-token"])
def test_each_prompt_computed_once_gives_the_plain_forwards_log_probs_and_gradients(tmp_path, r):
    model = load(make_tiny("1m", tmp_path / "m", seed=1)).model.train()
    rows = repeated_prompts(r=r)
    assert forward.saved_prompt_tokens(rows) == (9 - 3) * 7 and forward.can_share_prompts(model)
    calls = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    plain, plain_grads = log_probs_and_grads(model, rows, False)
    shared, shared_grads = log_probs_and_grads(model, rows, True)
    # plain: one call over every row; shared: the 3 distinct prompts, then every row's responses
    assert calls[0][0] == 9 and calls[1] == (3, 7) and (r == 1 or calls[2] == (9, r - 1))
    assert torch.allclose(shared, plain, atol=1e-5, rtol=0), (shared - plain).abs().max()
    assert plain_grads.keys() == shared_grads.keys() and len(plain_grads) > 0
    for name, grad in plain_grads.items():
        assert torch.allclose(shared_grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_prompts_are_shared_only_where_rows_repeat_them_the_model_can_and_it_pays(tmp_path, monkeypatch):
    model = load(make_tiny("1m", tmp_path / "m", seed=1)).model
    assert forward.saved_prompt_tokens(batch(0, 5)) == 0  # random prompts: no two rows alike
    assert forward.saved_prompt_tokens(repeated_prompts(rows_per_prompt=1)) == 0
    calls = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs.get("use_cache")), with_kwargs=True
    )
    rows = repeated_prompts()
    response_log_probs(model, rows)  # auto: 42 prompt tokens of a 1m model save less than a call costs
    assert calls == [None]
    monkeypatch.setattr(forward, "SHARE_MIN_PARAM_TOKENS", 42 * forward.parameter_count(model))
    response_log_probs(model, rows)  # auto, where the saving is worth it
    assert calls[1:] == [True, True]
    response_log_probs(model, rows, share_prompts=False)
    assert calls[3:] == [None]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not forward.can_share_prompts(model.train())  # transformers drops the cache there
    assert forward.can_share_prompts(model.eval())
    model.gradient_checkpointing_disable()
    model.compile()
    assert not forward.can_share_prompts(model)  # a compiled forward keeps one graph
