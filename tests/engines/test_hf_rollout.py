"""HF rollout backend against the shared training forward (no Ray needed)."""

import pytest
import torch

from tests.kit import make_one_block
from workbench.data.prompts import tokenize_prompts
from workbench.engines.forward import response_log_probs
from workbench.engines.hf_rollout import HFRollout, HFRolloutConfig, weightless_copy
from workbench.engines.rollout import SamplingConfig, mask_after_eos
from workbench.models import load, make_tiny


def make_engine(directory):
    loaded = load(directory)
    rows = [{"prompt": p, "ground_truth": "0"} for p in ("Q: 1+2=? A:", "Q: 10+20=? A:", "Q: 7*8=? A:")]
    prompts = tokenize_prompts(rows, loaded.tokenizer, max_prompt_length=32)
    tok = loaded.tokenizer
    return HFRollout(loaded.model, tok.pad_token_id, tok.eos_token_id), prompts


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_engine(make_tiny("1m", tmp_path_factory.mktemp("tiny") / "m", seed=5))


@pytest.fixture(scope="module")
def one_block_engine(tmp_path_factory):
    """For compiled decoding: one decoder block, the least that compiles alike."""
    return make_engine(make_one_block(tmp_path_factory.mktemp("tiny1") / "m", seed=5))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_log_probs_match_a_full_forward(engine, temperature):
    rollout, prompts = engine
    out = rollout.generate(prompts, SamplingConfig(max_new_tokens=12, temperature=temperature, n=2, seed=3))
    assert out["responses"].shape == (6, 12) and out["input_ids"].shape[1] == prompts["input_ids"].shape[1] + 12
    assert list(out["prompt"]) == [p for p in prompts["prompt"] for _ in range(2)]  # n samples adjacent
    with torch.no_grad():
        forward, _ = response_log_probs(rollout.model, out, temperature)
    assert (forward - out["rollout_log_probs"]).abs().max() <= 1e-3


def test_greedy_is_deterministic(engine):
    rollout, prompts = engine
    a = rollout.generate(prompts, SamplingConfig(max_new_tokens=8, greedy=True))
    b = rollout.generate(prompts, SamplingConfig(max_new_tokens=8, greedy=True))
    assert torch.equal(a["responses"], b["responses"])


@pytest.mark.parametrize(
    "config", [HFRolloutConfig(cache="static"), HFRolloutConfig(compile=True)], ids=["static", "compiled"]
)
def test_static_and_compiled_decoding_give_the_same_rollout(engine, one_block_engine, config):
    """A static cache (prompts left-padded to the bucket) and a compiled decoding step change
    how fast, not what: the same greedy tokens and output layout, and sampled log-probs that a
    training forward reproduces, as with the default dynamic cache."""
    rollout, prompts = one_block_engine if config.compile else engine
    other = HFRollout(rollout.model, rollout.pad_token_id, rollout.eos_token_id, config)
    greedy = SamplingConfig(max_new_tokens=8, greedy=True)
    expected, got = rollout.generate(prompts, greedy), other.generate(prompts, greedy)
    assert prompts["input_ids"].shape[1] % config.prompt_bucket != 0  # the bucket padding is exercised
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(expected[key], got[key]), key
    out = other.generate(prompts, SamplingConfig(max_new_tokens=8, n=2, seed=3))
    with torch.no_grad():
        forward, _ = response_log_probs(other.model, out, 1.0)
    assert (forward - out["rollout_log_probs"]).abs().max() <= 1e-3


@pytest.mark.parametrize("sampling", [SamplingConfig(greedy=True), SamplingConfig(seed=4, temperature=0.8)], ids=str)
def test_n_samples_of_a_prompt_share_its_prefill_and_sample_as_generate_does(engine, sampling):
    """generate computes each prompt once for its n samples: the same tokens (greedy, and sampled
    from the same seed) and log-probs as generate's own n-fold copy of the prompts, rows in its
    order; left-padded prompts of different lengths."""
    rollout, prompts = engine
    sampling = SamplingConfig(**{**sampling.__dict__, "n": 3, "max_new_tokens": 10})
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    assert len(set(mask.sum(1).tolist())) > 1  # left padding is exercised
    if sampling.greedy:  # generate refuses num_return_sequences without sampling: n copies by hand
        copies = SamplingConfig(**{**sampling.__dict__, "n": 1})
        expected = rollout.decode(ids.repeat_interleave(3, dim=0), mask.repeat_interleave(3, dim=0), copies)
    else:
        expected = rollout.decode(ids, mask, sampling)  # num_return_sequences: n copies prefilled
    shared = rollout._decode_shared_prompts(ids, mask, sampling)
    assert torch.equal(expected.responses, shared.responses)
    assert torch.equal(expected.response_mask, shared.response_mask)
    assert (expected.log_probs - shared.log_probs).abs().max() <= 1e-5
    out = rollout.generate(prompts, sampling)  # the path generate takes
    assert torch.equal(out["responses"], shared.responses)


def test_hf_rollout_config_names_a_bad_field():
    with pytest.raises(ValueError, match="HFRolloutConfig.cache"):
        HFRolloutConfig(cache="paged")
    with pytest.raises(ValueError, match="HFRolloutConfig.prompt_bucket"):
        HFRolloutConfig(prompt_bucket=0)
    with pytest.raises(ValueError, match="HFRolloutConfig.compile"):
        HFRolloutConfig(compile="yes")


def test_mask_covers_tokens_through_the_first_eos():
    mask = mask_after_eos(torch.tensor([[5, 2, 7, 2], [1, 1, 1, 1], [2, 3, 3, 3]]), eos_token_id=2)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_sampling_config_rejects_nonsense():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SamplingConfig(temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=1.5)


def test_weightless_copy_holds_no_weights_until_shared_or_materialized(tmp_path):
    """The trained actor's rollout skeleton: no weight memory at first (a full copy there set the
    process's peak), then the same generations once shared with or filled from the weights."""
    loaded = load(make_tiny("1m", tmp_path / "m", seed=5))
    model, tok = loaded.model, loaded.tokenizer
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    rows = [{"prompt": p, "ground_truth": "0"} for p in ("Q: 1+2=? A:", "Q: 7*8=? A:")]
    prompts = tokenize_prompts(rows, tok, max_prompt_length=32)
    greedy = SamplingConfig(max_new_tokens=8, greedy=True)
    expected = HFRollout(model, tok.pad_token_id, tok.eos_token_id).generate(prompts, greedy)

    skeleton = weightless_copy(model)
    storage = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in skeleton.parameters()}
    assert sum(storage.values()) <= 4 * len(storage)  # one element per parameter
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight  # ties survive the copy

    shared = HFRollout(skeleton, tok.pad_token_id, tok.eos_token_id)
    shared.share_weights({n: p.detach() for n, p in model.named_parameters()})
    assert torch.equal(shared.generate(prompts, greedy)["responses"], expected["responses"])

    filled = HFRollout(weightless_copy(model), tok.pad_token_id, tok.eos_token_id)
    filled.materialize(model.state_dict().items())
    assert all(p.data_ptr() not in {q.data_ptr() for q in model.parameters()} for p in filled.model.parameters())
    assert torch.equal(filled.generate(prompts, greedy)["responses"], expected["responses"])
    with pytest.raises(KeyError, match="not given"):
        HFRollout(weightless_copy(model), tok.pad_token_id, tok.eos_token_id).materialize([])
