"""SFT on whole multi-turn episodes (the tool task's demonstrations): the loss covers the
assistant's tokens only, and what it trains is what the multi-turn rollout samples: after
fitting two demonstrations, the model's greedy episodes in the real tool environment are those
demonstrations, token for token, masks included."""

import time

import pytest
import torch

from workbench.agents import ToolEnvironment, calculator
from workbench.data import tool_multiply
from workbench.data.prompts import tokenize_prompts
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.multi_turn import EpisodeConfig, conversation_ids, run_episodes
from workbench.engines.rollout import SamplingConfig, end_token_ids
from workbench.models import load, make_tiny
from workbench.stages import StageConfig, encode_demonstrations, train_sft
from workbench.stages.tool_policy import ToolPolicyConfig, tool_policy

pytestmark = pytest.mark.numerics  # what a model computes or learns: `make test-numerics` reruns it


@pytest.fixture(scope="module")
def problems():
    return tool_multiply.generate(tool_multiply.MultiplyConfig(), 2, seed=7)


@pytest.fixture(scope="module")
def fitted(problems, tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("episode-sft")
    rows = [{"messages": tool_multiply.demonstration(p)} for p in problems]
    result = train_sft(
        make_tiny("1m", d / "chat", chat=True),
        rows,
        d / "sft",
        StageConfig(steps=120, lr=3e-3, max_length=160, log_every=0),
    )
    return load(result["path"]), rows, result


def test_the_loss_covers_the_assistants_tokens_only(fitted):
    loaded, rows, result = fitted
    tok = loaded.tokenizer
    ids, attention, loss_mask = encode_demonstrations(tok, rows, max_length=160)
    for row, demo in enumerate(rows):
        expected_ids, policy = conversation_ids(tok, demo["messages"])
        n = len(expected_ids)
        assert ids[row, :n].tolist() == expected_ids and loss_mask[row, :n].tolist() == policy
        assert attention[row, :n].all() and not attention[row, n:].any() and not loss_mask[row, n:].any()
        trained = tok.decode(ids[row][loss_mask[row].bool()])
        assert "<tool_call>" in trained and "system" not in trained and "<|im_start|>tool" not in trained
    assert result["last_loss"] < 0.05 * result["first_loss"]
    with pytest.raises(ValueError, match="longer than max_length=40"):
        encode_demonstrations(tok, rows, max_length=40)
    with pytest.raises(ValueError, match="all {'prompt': text, 'response': text} or all {'messages'"):
        encode_demonstrations(tok, [*rows, {"prompt": "Q", "response": "A"}], max_length=160)


def test_greedy_episodes_of_the_fitted_model_are_its_demonstrations(fitted, problems):
    loaded, rows, _ = fitted
    tok, model = loaded.tokenizer, loaded.model.eval()
    rollout = HFRollout(model, tok.pad_token_id, end_token_ids(model, tok), tokenizer=tok)
    prompts = tokenize_prompts(
        [{"prompt": tool_multiply.messages(p), "ground_truth": p.ground_truth} for p in problems], tok, 96
    )
    env = ToolEnvironment({"calculator": calculator}, tool_multiply.score)
    batch = run_episodes(rollout, tok, prompts, env, SamplingConfig(greedy=True), EpisodeConfig(max_turns=3))
    width = prompts["input_ids"].shape[1]
    for row, demo in enumerate(rows):
        expected_ids, policy = conversation_ids(tok, demo["messages"])
        attended = batch["attention_mask"][row].bool()
        assert batch["input_ids"][row][attended].tolist() == expected_ids
        real = attended[width:]
        assert batch["response_mask"][row][real].tolist() == policy[-int(real.sum()) :]
    assert batch["episode_reward"].tolist() == [1.0, 1.0] and batch["tool_calls"].tolist() == [1.0, 1.0]


def test_the_tool_policy_stage_is_cached(tmp_path):
    config = ToolPolicyConfig(demonstrations=16, steps=2, batch_size=4)
    directory = tool_policy(config, workdir=tmp_path, verbose=False)
    stamp = (directory / "model.safetensors").stat().st_mtime
    started = time.monotonic()
    assert tool_policy(config, workdir=tmp_path, verbose=False) == directory
    assert time.monotonic() - started < 1 and (directory / "model.safetensors").stat().st_mtime == stamp
    assert load(directory).tokenizer.chat_template is not None
