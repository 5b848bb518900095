"""HFTurns: a multi-turn rollout's next turn on the HF engine continues from the last turn's
KV cache (only the new tokens are computed), and gives what a fresh generation over the whole
contexts gives: the same tokens and log-probs, whatever the holes in its layout."""

import pytest
import torch

from tests.chat_kit import make_tiny_chat
from workbench.data.batch import Batch
from workbench.data.prompts import left_padded, tokenize_prompts
from workbench.engines.hf_rollout import HFRollout, HFRolloutConfig
from workbench.engines.multi_turn import observation_ids
from workbench.engines.rollout import SamplingConfig, end_token_ids
from workbench.models import load

pytestmark = pytest.mark.numerics  # what a model computes or learns: `make test-numerics` reruns it


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    torch.set_num_threads(1)
    loaded = load(make_tiny_chat(tmp_path_factory.mktemp("chat") / "tiny-chat", seed=2))
    tok, model = loaded.tokenizer, loaded.model.eval()
    rows = [{"prompt": [{"role": "user", "content": q}], "ground_truth": ""} for q in ("a", "What is 12 * 3?", "b c")]
    prompts = tokenize_prompts(rows, tok, max_prompt_length=32)
    contexts = [ids[m.bool()].tolist() for ids, m in zip(prompts["input_ids"], prompts["attention_mask"])]
    return tok, HFRollout(model, tok.pad_token_id, end_token_ids(model, tok), tokenizer=tok), contexts


def fresh(rollout, contexts, sampling):
    ids, mask = left_padded(contexts, rollout.pad_token_id)
    return rollout.generate(Batch({"input_ids": ids, "attention_mask": mask}), sampling)


def kept(out, row):
    return out["responses"][row][out["response_mask"][row].bool()].tolist()


def test_a_next_turn_continues_from_the_cache_and_equals_a_fresh_generation(kit):
    tok, rollout, contexts = kit
    turns = rollout.turns()
    # Row 0 stops at its second token (the stop id is what it says there), the others run on:
    # the first turn leaves holes in the layout after row 0's end.
    stop = int(fresh(rollout, contexts, SamplingConfig(max_new_tokens=5, greedy=True))["responses"][0, 1])
    sampling = SamplingConfig(max_new_tokens=5, greedy=True, stop_token_ids=(stop,))
    first = turns.generate([0, 1, 2], contexts, sampling)
    assert torch.equal(first["responses"], fresh(rollout, contexts, sampling)["responses"])
    assert first["response_mask"][0].sum() <= 2 < first["response_mask"].sum(1).max()
    # Episodes 0 and 2 go on, with observations of different lengths; episode 1 ended.
    seen = [observation_ids(tok, "7", True), observation_ids(tok, "result: 12345 ok", True)]
    following = [contexts[0] + kept(first, 0) + seen[0], contexts[2] + kept(first, 2) + seen[1]]
    sampling = SamplingConfig(max_new_tokens=6, greedy=True)
    second = turns.generate([0, 2], following, sampling)
    assert turns.continued == 1
    again = fresh(rollout, following, sampling)
    assert torch.equal(second["responses"], again["responses"])
    assert torch.equal(second["response_mask"], again["response_mask"])
    assert (second["rollout_log_probs"] - again["rollout_log_probs"]).abs().max() < 1e-5
    # A third turn continues from the second's cache too.
    third = turns.generate([2], [following[1] + kept(second, 1) + seen[0]], sampling)
    assert turns.continued == 2
    assert torch.equal(
        third["responses"], fresh(rollout, [following[1] + kept(second, 1) + seen[0]], sampling)["responses"]
    )


def test_contexts_that_do_not_extend_the_cache_start_afresh(kit):
    tok, rollout, contexts = kit
    turns = rollout.turns()
    sampling = SamplingConfig(max_new_tokens=4, greedy=True)
    turns.generate([0, 1], contexts[:2], sampling)
    turns.generate([0, 1], [contexts[1], contexts[0]], sampling)  # swapped: neither extends its own row
    turns.generate([5], contexts[:1], sampling)  # an episode it never saw
    assert turns.continued == 0
    with pytest.raises(ValueError, match="one response per episode"):
        turns.generate([0], contexts[:1], SamplingConfig(n=2))
    assert (
        HFRollout(rollout.model, rollout.pad_token_id, rollout.eos_token_id, HFRolloutConfig(cache="static")).turns()
        is None
    )
