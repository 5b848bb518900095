"""Multi-turn episodes on the tiny ChatML kit (no Ray): observation tokens are appended as the
template renders them and masked out, episodes of different lengths share a batch, the same
seed gives the same trajectories, a training forward re-scores the sampled tokens exactly, and
observation and prompt tokens get no gradient."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from algorithms.core import ppo_clip
from tests.chat_kit import END_OF_TURN, make_tiny_chat
from tests.engines.envs import Floods, Replies
from workbench.data.prompts import tokenize_prompts
from workbench.engines.forward import pad_responses, response_log_probs, response_logits, token_log_probs, trim_padding
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.multi_turn import EpisodeConfig, Episodes, conversation_ids, observation_ids, run_episodes
from workbench.engines.rollout import SamplingConfig, end_token_ids

pytestmark = pytest.mark.numerics  # what a model computes or learns: `make test-numerics` reruns it


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    directory = make_tiny_chat(tmp_path_factory.mktemp("chat") / "tiny-chat")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    rollout = HFRollout(model, tokenizer.pad_token_id, end_token_ids(model, tokenizer), tokenizer=tokenizer)
    rows = [
        {"prompt": [{"role": "user", "content": f"question {i}"}], "ground_truth": str(turns)}
        for i, turns in enumerate([1, 3, 2])
    ]
    prompts = tokenize_prompts(rows, tokenizer, max_prompt_length=48)
    return tokenizer, model, rollout, prompts


def episodes(kit, seed=0, n=2):
    tokenizer, _, rollout, prompts = kit
    sampling = SamplingConfig(max_new_tokens=8, n=n, seed=seed)
    return run_episodes(rollout, tokenizer, prompts, Replies(), sampling, EpisodeConfig(max_turns=4, turn_tokens=6))


def test_observations_are_rendered_by_the_template_and_masked_out(kit):
    tokenizer = kit[0]
    shown = tokenizer.decode(observation_ids(tokenizer, "result 1: ok", close_turn=True))
    assert shown == f"{END_OF_TURN}\n<|im_start|>tool\nresult 1: ok{END_OF_TURN}\n<|im_start|>assistant\n"
    batch = episodes(kit)
    assert batch["turns"].tolist() == [1, 1, 3, 3, 2, 2] and batch["episode_reward"].tolist() == [1, 1, 3, 3, 2, 2]
    mask, attended = batch["response_mask"], batch["attention_mask"][:, -batch["responses"].shape[1] :]
    # Fixed widths, whatever the episodes' lengths: the batches of several ranks join.
    assert batch["responses"].shape[1] == EpisodeConfig().max_tokens and batch["turn_ends"].shape[1] == 4
    for row in range(len(batch)):
        observed = int(batch["observation_tokens"][row])
        assert int(attended[row].sum()) == int(mask[row].sum()) + observed  # every real token is attended
        assert (observed > 0) == (batch["turns"][row] > 1)
        ends = [e for e in batch["turn_ends"][row].tolist() if e >= 0]
        assert len(ends) == batch["turns"][row] and all(mask[row, e] == 1 for e in ends)
        text = tokenizer.decode(batch["responses"][row][attended[row].bool()])
        assert text.count("<|im_start|>tool") == batch["turns"][row] - 1


def test_the_same_seed_gives_the_same_trajectories(kit):
    first, again, other = episodes(kit, seed=3), episodes(kit, seed=3), episodes(kit, seed=4)
    assert first.equals(again)
    assert not torch.equal(first["responses"], other["responses"])


def test_a_training_forward_rescores_the_sampled_tokens_and_masks_the_rest(kit):
    _, model, _, _ = kit
    batch = episodes(kit, seed=1)
    mask = batch["response_mask"].bool()
    log_probs, _ = response_log_probs(model, batch)
    assert torch.allclose(log_probs[mask], batch["rollout_log_probs"][mask], atol=1e-4)
    # Among them, turns whose text re-encodes to other ids: scored as sampled all the same.
    tokenizer = kit[0]
    turns = [ids[m].tolist() for ids, m in zip(batch["responses"], mask)]
    assert any(tokenizer.encode(tokenizer.decode(t), add_special_tokens=False) != t for t in turns)


def test_observation_and_prompt_tokens_get_no_gradient(kit):
    """On the parameters: the PPO loss's gradients are the same whatever the advantages (and
    targets) at observation, template and padding positions, and change with a policy token's."""
    _, model, _, _ = kit
    batch = episodes(kit, seed=2)
    mask = batch["response_mask"].bool()
    assert (~mask & batch["attention_mask"][:, -mask.shape[1] :].bool()).any()  # there are observations

    def gradients(advantages):
        model.zero_grad()
        inputs, _ = trim_padding(batch)
        new, _ = token_log_probs(response_logits(model, inputs), inputs["responses"], 1.0)  # unmasked
        new = pad_responses(new, mask.shape[1])
        loss, _ = ppo_clip(new, batch["rollout_log_probs"].detach(), advantages, batch["response_mask"])
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    advantages = torch.randn(mask.shape)
    base = gradients(advantages)
    loud = gradients(torch.where(mask, advantages, torch.full_like(advantages, 1e6)))
    assert all(torch.equal(a, b) for a, b in zip(base, loud))
    flipped = gradients(torch.where(mask, -advantages, advantages))
    assert not all(torch.equal(a, b) for a, b in zip(base, flipped))


def test_a_budget_ends_an_episode(kit):
    tokenizer, _, rollout, prompts = kit
    config = EpisodeConfig(max_turns=4, turn_tokens=6, max_tokens=10)
    batch = run_episodes(rollout, tokenizer, prompts, Replies(), SamplingConfig(max_new_tokens=6, seed=0), config)
    assert batch["responses"].shape[1] <= 10 and int(batch["attention_mask"][:, -10:].sum(1).max()) <= 10
    with pytest.raises(Exception, match="EpisodeConfig.max_turns"):
        EpisodeConfig(max_turns=0)
    with pytest.raises(Exception, match="EpisodeConfig.continuous"):
        EpisodeConfig(continuous="yes")


def test_a_huge_observation_is_cut_before_it_is_tokenized_to_the_same_tokens(kit):
    """A million words (5 MB) shown to the policy: cut to what the response has room for before
    the tokenizer sees it, into the very tokens a just-long-enough observation gives."""
    tokenizer, _, rollout, prompts = kit
    config = EpisodeConfig(max_turns=2, turn_tokens=6, max_tokens=64)
    sampling = SamplingConfig(max_new_tokens=6, seed=0)
    huge = run_episodes(rollout, tokenizer, prompts, Floods(1_000_000), sampling, config)
    enough = run_episodes(rollout, tokenizer, prompts, Floods(200), sampling, config)
    assert torch.equal(huge["responses"], enough["responses"]) and int(huge["observation_tokens"].min()) > 40
    assert huge["tool_output_cuts"].tolist() == [1, 1, 1]


def test_stepping_turn_by_turn_is_the_same_loop(kit):
    """Episodes yields every turn (run_episodes is it run to the end): an episode that ended
    is in no later turn, and the batch equals run_episodes' for the same seed."""
    tokenizer, _, rollout, prompts = kit
    sampling, config = SamplingConfig(max_new_tokens=8, n=2, seed=5), EpisodeConfig(max_turns=4, turn_tokens=6)
    stepper = Episodes(rollout, tokenizer, prompts, Replies(), sampling, config)
    first = next(stepper)
    with pytest.raises(RuntimeError, match="still running after 1 turn"):
        stepper.batch()
    turns = [first, *stepper]
    assert [len(t.steps) for t in turns] == [6, 4, 2]  # episodes of 1, 3 and 2 turns, two of each
    ended: set[int] = set()
    for turn in turns:
        assert not ended & {s.episode for s in turn.steps}
        ended |= {s.episode for s in turn.steps if s.ended}
        assert turn.generation[0] <= turn.generation[1] <= turn.tools[0] <= turn.tools[1]
        for s in turn.steps:
            assert s.text == tokenizer.decode(s.ids, skip_special_tokens=True)
            assert (s.shown == []) == s.ended and (s.observation.text is None) == s.ended
    assert ended == set(range(6)) and stepper.done and stepper.history == turns  # what the actor traces
    assert stepper.batch().equals(run_episodes(rollout, tokenizer, prompts, Replies(), sampling, config))
    assert "[2] model:" in str(turns[1]) and "tool: result 1: ok" in str(turns[0])
    assert stepper.prompt(0) == [{"role": "user", "content": "question 0"}]
    assert stepper.transcript(2).count("<|im_start|>tool") == 2


def test_a_demonstrated_episode_is_rendered_as_the_rollout_holds_it(kit):
    """conversation_ids (what SFT trains on): the prompt as prompts are tokenized, each
    assistant turn's own ids, the tool's reply as observation_ids renders it after a turn that
    stopped at its tool call, the end of turn after the last; the mask on the assistant's ids."""
    tokenizer = kit[0]
    chat = [{"role": "user", "content": "What is 12 * 34?"}]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'
    episode = [*chat, {"role": "assistant", "content": call}, {"role": "tool", "content": "408"}]
    ids, policy = conversation_ids(tokenizer, [*episode, {"role": "assistant", "content": "408"}])
    prompt = tokenize_prompts([{"prompt": chat, "ground_truth": ""}], tokenizer, 48)["input_ids"][0].tolist()
    turn, shown = tokenizer.encode(call, add_special_tokens=False), observation_ids(tokenizer, "408", True)
    answer = tokenizer.encode("408", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(END_OF_TURN)]
    assert ids == prompt + turn + shown + answer
    assert policy == [0] * len(prompt) + [1] * len(turn) + [0] * len(shown) + [1] * len(answer)
    for bad, words in [
        (chat, "no assistant turn"),
        ([*episode, *chat], "followed by the assistant's next turn, not by 'user'"),
        (episode, "not by the end"),
    ]:
        with pytest.raises(ValueError, match=words):
            conversation_ids(tokenizer, bad)
