"""Multi-turn rollouts: episodes of policy turns and environment observations, as token ids.

    batch = run_episodes(rollout, tokenizer, prompts, env, SamplingConfig(n=4, seed=0), EpisodeConfig(max_turns=3))

Each episode starts from its prompt row (`env.start`); the policy generates a turn (until a stop
string such as `</tool_call>`, its end of turn or EOS, or the turn's token budget), the
environment answers it (`env.step` on the turn's text), and the answer is appended in the chat
template's tool role, closing the policy's turn first when the stop string left it open. Turns
are batched over the episodes still running; an episode that ends leaves the batch.

Trajectories stay token ids from end to end: a turn's sampled ids are appended as sampled and an
observation's ids as its template renders them; nothing is decoded and re-encoded (text is
decoded only to show the environment), so training scores exactly the tokens that were
sampled. The batch that comes back has the layout of a single-turn rollout (left-padded prompt,
right-padded response) with `response_mask` 1 on the policy's tokens only (0 on observations
and template tokens), `attention_mask` 1 on every real token, the rollout's log-probs on the
policy's tokens, `turn_ends` (each policy turn's last position in the response, -1 padded), and
per-episode `episode_reward`, `turns`, `tool_calls`, `tool_errors`, `observation_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from workbench import checks
from workbench.agents.env import TOOL_CALL_END, Environment
from workbench.data.batch import Batch
from workbench.engines.rollout import SamplingConfig


@dataclass(frozen=True)
class EpisodeConfig:
    """How long an episode may run."""

    max_turns: int = 4
    """Policy turns per episode; the last one ends the episode whatever it says."""
    max_tokens: int = 256
    """Response tokens per episode (policy and observation tokens together)."""
    turn_tokens: int = 64
    """New tokens per policy turn."""
    stop: tuple[str, ...] = (TOOL_CALL_END,)
    """Stop strings that end a turn (beside end of turn and EOS): the end of a tool call."""
    tool_role: str = "tool"
    """The template role observations are rendered in ("user" for templates without a tool role)."""

    def __post_init__(self):
        for name in ("max_turns", "max_tokens", "turn_tokens"):
            checks.whole("EpisodeConfig", name, getattr(self, name), fix="use a whole number >= 1")


def observation_ids(tokenizer, text: str, close_turn: bool, role: str = "tool") -> list[int]:
    """The ids that follow a policy turn to show it `text`: the end of the assistant's turn (when
    the turn stopped without it), the observation as a `role` message, and the template's
    generation prompt for the next assistant turn. Found by rendering a probe conversation with
    and without the observation and tokenizing only the difference."""
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\x00"}]
    before = tokenizer.apply_chat_template(probe, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*probe, {"role": role, "content": text}], tokenize=False, add_generation_prompt=True
    )
    if not after.startswith(before):
        raise ValueError(
            f"the chat template renders a {role!r} message by changing earlier turns; set EpisodeConfig.tool_role"
        )
    closing = before[before.index("\x00") + 1 :]  # what closes an assistant turn, e.g. "<|im_end|>\n"
    return tokenizer.encode((closing if close_turn else "") + after[len(before) :], add_special_tokens=False)


@dataclass
class _Episode:
    prompt: list[int]
    state: object
    response: list[int]
    policy: list[bool]
    log_probs: list[float]
    turn_ends: list[int]
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0


def run_episodes(
    rollout, tokenizer, prompts: Batch, env: Environment, sampling: SamplingConfig, config: EpisodeConfig
) -> Batch:
    """`sampling.n` episodes per prompt row, run turn by turn (see the module docstring)."""
    rows = prompts.repeat(sampling.n, interleave=True) if sampling.n > 1 else prompts
    columns = [{k: rows.columns[k][i] for k in rows.columns} for i in range(len(rows))]
    episodes = [
        _Episode(ids[mask.bool()].tolist(), env.start(row), [], [], [], [])
        for ids, mask, row in zip(rows["input_ids"], rows["attention_mask"], columns)
    ]
    end_ids = set(sampling.end_ids(rollout.eos_token_id))
    device = rows["input_ids"].device  # the worker's (a GPU's): every tensor built here goes there
    for turn in range(config.max_turns):
        active = [e for e in episodes if not e.done and len(e.response) < config.max_tokens]
        if not active:
            break
        budget = min(config.turn_tokens, max(config.max_tokens - len(e.response) for e in active))
        turn_sampling = replace(
            sampling,
            n=1,
            max_new_tokens=budget,
            stop=tuple(dict.fromkeys([*sampling.stop, *config.stop])),
            seed=None if sampling.seed is None else sampling.seed + turn,
        )
        out = rollout.generate(_left_padded(active, rollout.pad_token_id, device), turn_sampling)
        for e, ids, mask, log_probs in zip(active, out["responses"], out["response_mask"], out["rollout_log_probs"]):
            kept = int(mask.sum())
            room = config.max_tokens - len(e.response)
            ids, log_probs = ids[: min(kept, room)].tolist(), log_probs[: min(kept, room)].tolist()
            e.response += ids
            e.policy += [True] * len(ids)
            e.log_probs += log_probs
            e.turn_ends.append(len(e.response) - 1)
            observation = env.step(e.state, tokenizer.decode(ids, skip_special_tokens=True))
            e.reward += float(observation.reward)
            e.tool_calls += "tool" in observation.info
            e.tool_errors += "tool_error" in observation.info
            last = turn == config.max_turns - 1 or len(e.response) >= config.max_tokens
            if observation.done or last or observation.text is None:
                e.done = True
                continue
            shown = observation_ids(tokenizer, observation.text, not (ids and ids[-1] in end_ids), config.tool_role)
            shown = shown[: config.max_tokens - len(e.response)]
            e.response += shown
            e.policy += [False] * len(shown)
            e.log_probs += [0.0] * len(shown)
            e.observation_tokens += len(shown)
            e.done = len(e.response) >= config.max_tokens
    return _batch(rows, episodes, rollout.pad_token_id)


def _left_padded(episodes: list[_Episode], pad: int, device: torch.device) -> Batch:
    """Each episode's context so far (prompt + response), left-padded into one batch."""
    contexts = [e.prompt + e.response for e in episodes]
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, context in enumerate(contexts):
        ids[row, width - len(context) :] = torch.tensor(context)
        mask[row, width - len(context) :] = 1
    return Batch({"input_ids": ids.to(device), "attention_mask": mask.to(device)})


def _batch(rows: Batch, episodes: list[_Episode], pad: int) -> Batch:
    width = max(1, max(len(e.response) for e in episodes))
    n = len(episodes)
    responses = torch.full((n, width), pad, dtype=torch.long)
    attended = torch.zeros((n, width), dtype=torch.long)
    policy = torch.zeros((n, width), dtype=torch.long)
    log_probs = torch.zeros((n, width))
    turns = max(len(e.turn_ends) for e in episodes)
    turn_ends = torch.full((n, max(1, turns)), -1, dtype=torch.long)
    for row, e in enumerate(episodes):
        length = len(e.response)
        responses[row, :length] = torch.tensor(e.response, dtype=torch.long)
        attended[row, :length] = 1
        policy[row, :length] = torch.tensor(e.policy, dtype=torch.long)
        log_probs[row, :length] = torch.tensor(e.log_probs)
        turn_ends[row, : len(e.turn_ends)] = torch.tensor(e.turn_ends)
    prompt_ids, prompt_mask = rows["input_ids"].cpu(), rows["attention_mask"].cpu()
    attention_mask = torch.cat([prompt_mask, attended], dim=1)
    figures = {
        "episode_reward": [e.reward for e in episodes],
        "turns": [len(e.turn_ends) for e in episodes],
        "tool_calls": [e.tool_calls for e in episodes],
        "tool_errors": [e.tool_errors for e in episodes],
        "observation_tokens": [e.observation_tokens for e in episodes],
    }
    return Batch(
        {
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": policy,
            "rollout_log_probs": log_probs * policy,
            "turn_ends": turn_ends,
            **{k: torch.tensor(v, dtype=torch.float32) for k, v in figures.items()},
        },
        rows.columns,
        rows.info,
    ).to(rows["input_ids"].device)
