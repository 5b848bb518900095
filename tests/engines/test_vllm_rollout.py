"""VLLMRollout against Hugging Face transformers on a tiny Llama: real vLLM, real generation.

One engine for the whole module (it takes 10-25 s to start). Tests that load other weights
put the base weights back, so they can run in any order.
"""

import copy
import os
from pathlib import Path

import pytest
import torch

from workbench.data.prompts import tokenize_prompts
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.rollout import SamplingConfig
from workbench.engines.vllm_rollout import VLLMRollout, VLLMRolloutConfig
from workbench.models import load_tokenizer, make_tiny

TOL = 1e-3
PROMPTS = ["Q: 3+4=? A:", "Q: 12+30=? A:", "Q: 7+5=? Answer", "Q: 100+250=? A: "]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The 1m tiny kit with a sharper output head.

    A random-init head gives near-uniform next-token distributions (every log-prob close
    to -log V), too flat for a wrong temperature or a truncated softmax to show; scaled by
    10 the logits spread over several nats.
    """
    from transformers import AutoModelForCausalLM

    kit = make_tiny("1m", tmp_path_factory.mktemp("kit") / "tiny-1m", seed=0)
    model = AutoModelForCausalLM.from_pretrained(kit, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    out = tmp_path_factory.mktemp("kit") / "tiny-1m-sharp"
    model.save_pretrained(out)
    load_tokenizer(kit)[0].save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)[0]


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def rollout(model_dir, tmp_path_factory):
    shm_before = set(os.listdir("/dev/shm"))
    cache = tmp_path_factory.mktemp("vllm-cache")
    cfg = VLLMRolloutConfig(max_model_len=96, max_num_seqs=16, cache_root=str(cache))
    engine = VLLMRollout(model_dir, cfg)
    print(f"vLLM engine start: {engine.start_seconds:.1f} s")
    yield engine
    engine.shutdown()
    for name in set(os.listdir("/dev/shm")) - shm_before:  # segments this engine left behind
        if name.startswith("psm_"):
            Path("/dev/shm", name).unlink(missing_ok=True)


@pytest.fixture
def restore_weights(rollout, hf_model):
    """Put the checkpoint's weights back into the shared engine after the test."""
    yield
    rollout.load_weights(hf_model.state_dict().items())


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return tokenize_prompts([{"prompt": p, "ground_truth": ""} for p in PROMPTS], tokenizer, 32)


def hf_log_softmax(model, batch, temperature):
    """The training-side forward: fp32 log_softmax(logits / T) at each response position."""
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    start = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    return torch.log_softmax(logits[:, start - 1 : -1].float() / temperature, dim=-1)


def hf_log_probs(model, batch, temperature):
    """`hf_log_softmax` at the generated tokens, 0 where masked."""
    log_softmax = hf_log_softmax(model, batch, temperature)
    return log_softmax.gather(-1, batch["responses"][..., None]).squeeze(-1) * batch["response_mask"]


def hf_greedy(model, prompts, max_new_tokens, tokenizer):
    """HF `generate` (greedy, KV cache), right-padded to max_new_tokens with pad ids."""
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts["input_ids"],
            attention_mask=prompts["attention_mask"],
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    responses = out[:, prompts["input_ids"].shape[1] :]
    missing = max_new_tokens - responses.shape[1]
    return torch.nn.functional.pad(responses, (0, missing), value=tokenizer.pad_token_id)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_new_tokens=16, temperature=1.0, n=2, seed=1),
        SamplingConfig(max_new_tokens=16, temperature=0.7, n=2, seed=2),
        SamplingConfig(max_new_tokens=16, temperature=0.7, top_p=0.8, top_k=20, n=2, seed=3),
        SamplingConfig(max_new_tokens=16, greedy=True),
    ],
    ids=["T1", "T0.7", "T0.7-top_p-top_k", "greedy"],
)
def test_rollout_log_probs_match_hf_forward(rollout, hf_model, prompts, sampling):
    batch = rollout.generate(prompts, sampling)
    temperature = 1.0 if sampling.greedy else sampling.temperature
    log_softmax = hf_log_softmax(hf_model, batch, temperature)
    mask = batch["response_mask"]
    expected = log_softmax.gather(-1, batch["responses"][..., None]).squeeze(-1) * mask
    diff = (batch["rollout_log_probs"] - expected).abs().max().item()
    print(f"max |rollout - HF| log-prob: {diff:.2e}")
    assert diff <= TOL

    # The test can tell: the values are far from uniform, and log-probs renormalised over
    # the top-20 tokens (what vLLM's "processed" modes return) would be off by more than TOL.
    real = expected[mask.bool()]
    assert (real - real.mean()).abs().max() > 0.5
    lost = -log_softmax.topk(20, dim=-1).values.logsumexp(-1)[mask.bool()]
    assert lost.max() > 10 * TOL


def test_seeded_sampling_is_reproducible_and_independent_per_prompt(rollout, prompts):
    twins = prompts[[0, 0]]  # the same prompt twice
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.0, n=2, seed=7)
    first, again = rollout.generate(twins, sampling), rollout.generate(twins, sampling)
    assert torch.equal(first["responses"], again["responses"])
    rows = first["responses"]
    # Two prompts under one seed, and two samples of one prompt, still draw different noise.
    assert not torch.equal(rows[0], rows[2]) and not torch.equal(rows[0], rows[1])


def test_load_weights_in_place_matches_hf_with_new_weights(rollout, hf_model, prompts, tokenizer, restore_weights):
    sampling = SamplingConfig(max_new_tokens=16, greedy=True)
    before = rollout.generate(prompts, sampling)
    llm = rollout.llm
    model_id = llm.collective_rpc(lambda worker: id(worker.model_runner.model))

    new_model = copy.deepcopy(hf_model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=gen))
    rollout.load_weights(new_model.state_dict().items())
    print(f"load_weights: {rollout.last_load_seconds * 1e3:.1f} ms")
    after = rollout.generate(prompts, sampling)

    # Same engine, same model object: the weights changed in place.
    assert rollout.llm is llm
    assert llm.collective_rpc(lambda worker: id(worker.model_runner.model)) == model_id
    assert not torch.equal(before["responses"], after["responses"])
    assert torch.equal(after["responses"], hf_greedy(new_model, prompts, 16, tokenizer))
    diff = (after["rollout_log_probs"] - hf_log_probs(new_model, after, 1.0)).abs().max().item()
    print(f"after load_weights, max |rollout - HF| log-prob: {diff:.2e}")
    assert diff <= TOL


def test_shapes_masks_and_padding_for_n2(rollout, prompts):
    n, R = 2, 12
    rollout.release()  # what the actor does after every generate: the next one still works
    batch = rollout.generate(prompts, SamplingConfig(max_new_tokens=R, temperature=1.0, n=n, seed=0))
    B, P = prompts["input_ids"].shape
    assert len(batch) == B * n
    for key in ("responses", "response_mask", "rollout_log_probs"):
        assert batch[key].shape == (B * n, R)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert batch[key].shape == (B * n, P + R)
    assert batch["rollout_log_probs"].dtype == torch.float32
    # Each prompt's n samples are adjacent and carry the prompt's fields.
    assert torch.equal(batch["input_ids"][:, :P], prompts["input_ids"].repeat_interleave(n, dim=0))
    assert list(batch["uid"]) == [uid for uid in prompts["uid"] for _ in range(n)]
    assert torch.equal(batch["input_ids"][:, P:], batch["responses"])
    mask = batch["response_mask"]
    prompt_mask = prompts["attention_mask"].repeat_interleave(n, dim=0)
    assert torch.equal(batch["attention_mask"], torch.cat([prompt_mask, mask], dim=1))
    assert torch.equal(batch["position_ids"], (batch["attention_mask"].cumsum(1) - 1).clamp(min=0))
    assert (batch["rollout_log_probs"][mask.bool()] <= 0).all()


def test_eos_ends_the_response_and_padding_follows(rollout, hf_model, prompts, tokenizer, restore_weights):
    R, eos, pad = 16, tokenizer.eos_token_id, tokenizer.pad_token_id
    greedy = rollout.generate(prompts, SamplingConfig(max_new_tokens=R, greedy=True))["responses"]
    # Make EOS outscore the token greedy decoding picks at step 3 of the first prompt.
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        head = model.lm_head.weight
        head[eos] = 1.5 * head[greedy[0, 3]]
    rollout.load_weights(model.state_dict().items())
    batch = rollout.generate(prompts, SamplingConfig(max_new_tokens=R, greedy=True))

    responses, mask, log_probs = batch["responses"], batch["response_mask"], batch["rollout_log_probs"]
    ends = [(row == eos).nonzero().flatten() for row in responses]
    assert any(len(e) and e[0] < R - 1 for e in ends), f"no response ended early: {responses.tolist()}"
    for row, end in enumerate(ends):
        length = int(end[0]) + 1 if len(end) else R
        assert mask[row, :length].all() and not mask[row, length:].any()
        assert (responses[row, length:] == pad).all() and (log_probs[row, length:] == 0).all()
    assert torch.equal(responses, hf_greedy(model, prompts, R, tokenizer))
    assert (log_probs - hf_log_probs(model, batch, 1.0)).abs().max().item() <= TOL


def test_stop_strings_and_ids_end_responses_as_in_the_hf_rollout(rollout, hf_model, prompts, tokenizer):
    R = 16
    greedy = rollout.generate(prompts, SamplingConfig(max_new_tokens=R, greedy=True))["responses"]
    pairs = [tokenizer.decode(row[k : k + 2]) for row in greedy[2:] for k in range(2, R - 1)]
    stop = next(p for p in pairs if len(p) == 2 and p.isascii() and p.isprintable() and p.strip() == p)
    sampling = SamplingConfig(max_new_tokens=R, greedy=True, stop=(stop,), stop_token_ids=(int(greedy[0, 5]),))
    got = rollout.generate(prompts, sampling)
    hf = HFRollout(hf_model, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer=tokenizer)
    expected = hf.generate(prompts, sampling)
    assert got["response_mask"].sum(1).tolist() == expected["response_mask"].sum(1).tolist()
    assert expected["response_mask"][0].sum() <= 6 and (expected["response_mask"].sum(1) < R).sum() >= 2
    assert torch.equal(got["responses"], expected["responses"])


def test_clear_errors(rollout, prompts, hf_model):
    with pytest.raises(ValueError, match="max_model_len"):
        rollout.generate(prompts, SamplingConfig(max_new_tokens=90))
    partial = [(k, v) for k, v in hf_model.state_dict().items() if ".k_proj." not in k]
    with pytest.raises(ValueError, match="k_proj"):
        rollout.load_weights(partial)
