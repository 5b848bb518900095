"""Responses end at an end-of-turn token and at stop strings (HF rollout, no Ray). The tiny
chat model is random, so the tests pick their stops from its own output and check where
generation ends, not what it says. A seeded sample draws the same noise for every row at every
step whether or not rows have ended, so a stopped row is its unstopped run cut short."""

import copy

import pytest
import torch

from tests.chat_kit import END_OF_TURN, make_tiny_chat
from workbench.data.prompts import tokenize_prompts
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.rollout import SamplingConfig, end_token_ids, first_stop
from workbench.errors import ConfigError
from workbench.models import load

pytestmark = pytest.mark.numerics  # what a model computes or learns: `make test-numerics` reruns it

R = 16


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    torch.set_num_threads(1)
    # A seed whose greedy answers differ between rows (a random tiny model often repeats one
    # token whatever it is asked): the end-of-turn test needs rows that end at different places.
    loaded = load(make_tiny_chat(tmp_path_factory.mktemp("chat") / "tiny-chat", seed=2))
    questions = ("What is 1+2?", "What is 10+20?", "What is 7*8?", "Say hi.")
    rows = [{"prompt": [{"role": "user", "content": q}], "ground_truth": "0"} for q in questions]
    prompts = tokenize_prompts(rows, loaded.tokenizer, max_prompt_length=64)
    tok = loaded.tokenizer
    rollout = HFRollout(loaded.model, tok.pad_token_id, tok.eos_token_id)
    greedy = rollout.generate(prompts, SamplingConfig(max_new_tokens=R, greedy=True))
    sampled = rollout.generate(prompts, SamplingConfig(max_new_tokens=R, seed=SEED))
    for out in (greedy, sampled):
        assert out["response_mask"].all(), "the baselines run to max_new_tokens (no eos drawn)"
    return loaded, prompts, greedy["responses"], sampled["responses"]


SEED = 1


def check_ends(out, baseline: torch.Tensor, ends: list[int], pad: int) -> None:
    """Row i kept baseline tokens before ends[i], then the ending token, then only padding."""
    for i, end in enumerate(ends):
        assert out["response_mask"][i].tolist() == [1] * (end + 1) + [0] * (R - end - 1), i
        assert torch.equal(out["responses"][i, :end], baseline[i, :end]), i
        assert out["responses"][i, end + 1 :].eq(pad).all(), i


def test_generation_stops_at_the_chat_templates_end_of_turn(chat):
    """The model's generation config names <|im_end|> (an imported chat model's does): the
    rollout ends there. To make the random model say it, its output logits of <|im_end|> and of
    a token X from its greedy output are swapped: it then says <|im_end|> where it said X."""
    loaded, prompts, baseline, _ = chat
    tok, end_of_turn = loaded.tokenizer, loaded.tokenizer.convert_tokens_to_ids(END_OF_TURN)
    x = int(baseline[0, 5])
    model = copy.deepcopy(loaded.model)
    with torch.no_grad():
        model.lm_head.weight[[x, end_of_turn]] = model.lm_head.weight[[end_of_turn, x]]
    ids = end_token_ids(model, tok)
    assert ids == [tok.eos_token_id, end_of_turn]  # the tokenizer's eos, then the template's end of turn
    out = HFRollout(model, tok.pad_token_id, ids).generate(prompts, SamplingConfig(max_new_tokens=R, greedy=True))
    ends = [row.tolist().index(x) if x in row else R - 1 for row in baseline]
    assert ends[0] <= 5 and len(set(ends)) > 2  # rows end at different places
    check_ends(out, baseline, ends, tok.pad_token_id)
    for i, end in enumerate(ends):
        if x in baseline[i]:
            assert out["responses"][i, end] == end_of_turn


def test_stop_token_ids_end_responses_too(chat):
    loaded, prompts, _, baseline = chat
    tok, x = loaded.tokenizer, int(baseline[1, 6])
    rollout = HFRollout(loaded.model, tok.pad_token_id, tok.eos_token_id)
    out = rollout.generate(prompts, SamplingConfig(max_new_tokens=R, seed=SEED, stop_token_ids=(x,)))
    ends = [row.tolist().index(x) if x in row else R - 1 for row in baseline]
    assert ends[1] <= 6 and ends.count(R - 1) < len(ends)
    check_ends(out, baseline, ends, tok.pad_token_id)
    assert out["responses"][1, ends[1]] == x


def two_printable_tokens(tok, ids: list[int]) -> str:
    """Text of the first two adjacent tokens (after the first two) that decode to plain ASCII
    (a few characters: the chat kit's tokenizer merges some)."""
    for k in range(2, len(ids) - 1):
        text = tok.decode(ids[k : k + 2])
        if 2 <= len(text) <= 8 and text.isascii() and text.isprintable() and text.strip() == text:
            return text
    raise AssertionError("no printable pair: pick another seed")


def test_generation_stops_at_a_stop_string(chat):
    loaded, prompts, _, baseline = chat
    tok = loaded.tokenizer
    stop = two_printable_tokens(tok, baseline[3].tolist())
    rollout = HFRollout(loaded.model, tok.pad_token_id, tok.eos_token_id, tokenizer=tok)
    out = rollout.generate(prompts, SamplingConfig(max_new_tokens=R, seed=SEED, stop=(stop, "never said")))
    kept = out["response_mask"].sum(1).tolist()
    assert kept[3] < R
    for i, n in enumerate(kept):
        response = out["responses"][i, :n].tolist()
        assert response == baseline[i, :n].tolist(), i
        assert out["responses"][i, n:].eq(tok.pad_token_id).all(), i
        if stop in tok.decode(baseline[i]):
            # it ends with the token that completes the stop string: with it the text holds the
            # string, without it not
            assert stop in tok.decode(response) and stop not in tok.decode(response[:-1]), i
        else:
            assert n == R, i


def test_stop_strings_need_the_tokenizer_and_sane_settings(chat):
    loaded, prompts, *_ = chat
    rollout = HFRollout(loaded.model, loaded.tokenizer.pad_token_id, loaded.tokenizer.eos_token_id)
    with pytest.raises(
        ValueError, match=r"stop=\['\\n'\] needs the tokenizer.*HFRollout\(\.\.\., tokenizer=tokenizer\)"
    ):
        rollout.generate(prompts, SamplingConfig(max_new_tokens=2, stop=("\n",)))
    with pytest.raises(ConfigError, match="SamplingConfig.stop='Q:'.*list of non-empty strings"):
        SamplingConfig(stop="Q:")
    with pytest.raises(ConfigError, match="SamplingConfig.stop_token_ids"):
        SamplingConfig(stop_token_ids=(-1,))
    assert SamplingConfig(stop=["\n\n"]).stop == ("\n\n",)  # lists (from YAML) become tuples


def test_min_new_tokens_holds_the_end_back(chat):
    """A response ends no earlier than min_new_tokens (a baseline of an exact token count)."""
    loaded, prompts, _, baseline = chat
    tok, x = loaded.tokenizer, int(baseline[1, 1])
    rollout = HFRollout(loaded.model, tok.pad_token_id, tok.eos_token_id)
    early = rollout.generate(prompts, SamplingConfig(max_new_tokens=R, seed=SEED, stop_token_ids=(x,)))
    held = rollout.generate(prompts, SamplingConfig(max_new_tokens=R, seed=SEED, stop_token_ids=(x,), min_new_tokens=6))
    assert early["response_mask"][1].sum() == 2 and held["response_mask"].sum(1).min() >= 6
    with pytest.raises(ConfigError, match="SamplingConfig.min_new_tokens=9: use at most max_new_tokens=8"):
        SamplingConfig(max_new_tokens=8, min_new_tokens=9)


def test_first_stop_is_the_first_token_that_completes_a_stop_string(chat):
    """first_stop (bisection, with a shortcut where the stop string ends at the last id) agrees
    with a scan of every prefix, on the model's own outputs cut at every length."""
    loaded, _, greedy, sampled = chat
    tok = loaded.tokenizer
    for row in [*greedy.tolist(), *sampled.tolist()]:
        text = tok.decode(row, skip_special_tokens=False)
        stops = (text[len(text) // 3 : len(text) // 3 + 3], text[-2:])
        for length in range(1, len(row) + 1):
            ids = row[:length]
            scan = next(
                (
                    k
                    for k in range(length)
                    if any(s in tok.decode(ids[: k + 1], skip_special_tokens=False) for s in stops)
                ),
                None,
            )
            assert first_stop(ids, stops, tok) == scan, (row, length)
