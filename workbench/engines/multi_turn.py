"""Multi-turn rollouts: episodes of policy turns and environment observations, as token ids.

    batch = run_episodes(rollout, tokenizer, prompts, env, SamplingConfig(n=4, seed=0), EpisodeConfig(max_turns=3))
    for turn in Episodes(rollout, tokenizer, prompts, env, sampling, config): print(turn)   # step by step

Each episode starts from its prompt row (`env.start`); the policy generates a turn (until a stop
string such as `</tool_call>`, its end of turn or EOS, or the turn's token budget), the
environment answers it (`env.step` on the turn's text), and the answer is appended in the chat
template's tool role (or the observation's own, `Observation.role`), closing the policy's turn
first when the stop string left it open. `Episodes` is the loop itself, one turn per `next()`,
batched over the episodes still running (a notebook steps an episode with it); an episode that
ends leaves the batch. `run()` (and `run_episodes`, the actor's call) schedules continuously where
the engine takes one request at a time (vLLM): an episode's next turn goes to the engine as soon
as its environment step answered, not when the whole turn has ended; elsewhere it runs the turns
as `next()` does. Either way the actor records each turn's generation and tool calls as trace
spans.

Trajectories stay token ids from end to end: a turn's sampled ids are appended as sampled and an
observation's ids as its template renders them; nothing is decoded and re-encoded (text is
decoded only to show the environment), so training scores exactly the tokens that were
sampled. The batch that comes back has the layout of a single-turn rollout (left-padded prompt,
right-padded response of R = EpisodeConfig.max_tokens columns) with `response_mask` 1 on the
policy's tokens only (0 on observations and template tokens), `attention_mask` 1 on every real
token, the rollout's log-probs on the policy's tokens, `turn_ends` (each policy turn's last
position in the response, -1 padded to max_turns), and per-episode `episode_reward`, `turns`,
`tool_calls`, `tool_errors`, `tool_output_cuts` (tool answers cut to SandboxLimits.output_chars),
`observation_tokens`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch

from workbench import checks
from workbench.agents.env import TOOL_CALL_END, Environment, Observation, Pending
from workbench.data.batch import Batch
from workbench.data.prompts import left_padded, prompt_ids
from workbench.engines.rollout import SamplingConfig, stream_seed

MAX_TOKEN_CHARS = 64
"""Characters of an observation kept per token the response has room for (a bound on any token's
length): a 50 MB tool answer is cut before the tokenizer sees it, not after."""


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
    continuous: bool = True
    """`Episodes.run` adds each episode's next turn to the engine as soon as its environment step
    answered, where the engine takes one request at a time (vLLM); False: turn by turn, every
    running episode's turn together, as `next()` steps (same samples, within float rounding)."""

    def __post_init__(self):
        for name in ("max_turns", "max_tokens", "turn_tokens"):
            checks.whole("EpisodeConfig", name, getattr(self, name), fix="use a whole number >= 1")
        checks.of_type("EpisodeConfig", "continuous", self.continuous, bool, "use True or False")


def observation_ids(tokenizer, text: str, close_turn: bool, role: str = "tool") -> list[int]:
    """The ids that follow a policy turn to show it `text`: the end of the assistant's turn (when
    the turn stopped without it), the observation as a `role` message, and the template's
    generation prompt for the next assistant turn. Found by rendering a probe conversation with
    and without the observation and tokenizing only the difference."""
    before, closing = _probe(tokenizer)
    after = tokenizer.apply_chat_template(
        [*_PROBE, {"role": role, "content": text}], tokenize=False, add_generation_prompt=True
    )
    if not after.startswith(before):
        raise ValueError(
            f"the chat template renders a {role!r} message by changing earlier turns; set EpisodeConfig.tool_role"
        )
    return tokenizer.encode((closing if close_turn else "") + after[len(before) :], add_special_tokens=False)


def end_of_turn_id(tokenizer) -> int:
    """The id that ends an assistant turn in the template (`<|im_end|>`): where a final answer's
    generation stops."""
    return tokenizer.encode(_probe(tokenizer)[1], add_special_tokens=False)[0]


_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\x00"}]


def _probe(tokenizer) -> tuple[str, str]:
    """The probe conversation rendered, and what closes its assistant turn (e.g. "<|im_end|>\n"):
    the same for every observation, so rendered once per template (and the special tokens it
    may write)."""
    key = (tokenizer.chat_template, str(tokenizer.special_tokens_map))
    if key not in _probes:
        before = tokenizer.apply_chat_template(_PROBE, tokenize=False)
        _probes[key] = (before, before[before.index("\x00") + 1 :])
    return _probes[key]


_probes: dict[tuple, tuple[str, str]] = {}


def conversation_ids(tokenizer, messages: list[dict[str, str]], tool_role: str = "tool") -> tuple[list[int], list[int]]:
    """A whole episode written as messages (the prompt's, then assistant turns with `tool_role`
    messages between them) as the ids an episode holds when the policy samples those turns: the
    prompt through the template with the assistant's opening (as prompts are tokenized), each
    assistant turn's text encoded on its own (a turn followed by a tool message stops at the end
    of its tool call, the last one at the end of turn), each tool message as `observation_ids`
    renders it. Returns (ids, policy mask: 1 on the assistant's ids). Supervised demonstrations
    of episodes (workbench.stages.sft) are rendered this way, so SFT and RL see the same ids."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise ValueError(
            "an episode's messages are a prompt (system/user) and then assistant turns; found no prompt "
            "or no assistant turn"
        )
    ids = prompt_ids(messages[:first], tokenizer)
    policy = [0] * len(ids)
    rest = messages[first:]
    for k, message in enumerate(rest):
        following = rest[k + 1]["role"] if k + 1 < len(rest) else None
        if message["role"] == "assistant":
            if following not in (None, tool_role):
                raise ValueError(
                    f"an assistant turn of an episode is followed by a {tool_role!r} message or ends it, "
                    f"not by a {following!r} message"
                )
            turn = tokenizer.encode(message["content"], add_special_tokens=False)
            turn += [end_of_turn_id(tokenizer)] if following is None else []
            ids += turn
            policy += [1] * len(turn)
        elif message["role"] == tool_role:
            if following != "assistant":
                raise ValueError(
                    f"a {tool_role!r} message is followed by the assistant's next turn, not by "
                    f"{'the end of the episode' if following is None else repr(following) + ' message'}"
                )
            shown = observation_ids(tokenizer, message["content"], close_turn=True, role=tool_role)
            ids += shown
            policy += [0] * len(shown)
        else:
            raise ValueError(
                f"after the prompt an episode alternates assistant and {tool_role!r} messages; found "
                f"{message['role']!r} at message {first + k}"
            )
    return ids, policy


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
    tool_output_cuts: int = 0
    observation_tokens: int = 0


@dataclass
class TurnStep:
    """What one episode did in one turn."""

    episode: int
    """Its row in the episodes' batch."""
    ids: list[int]
    """The policy's sampled ids, as sampled."""
    text: str
    """Those ids as the environment read them (decoded without special tokens)."""
    observation: Observation
    """The environment's answer."""
    shown: list[int]
    """The ids appended after the turn to show the observation (none when the episode ended)."""
    ended: bool
    """The episode ended with this turn."""


@dataclass
class Turn:
    """One turn of every episode still running: the batched generation, then the environment's
    steps (the tool calls). Times are `time.time()` seconds; in a continuous `Episodes.run()`
    they span the turn's first episode's start to its last one's end (turns overlap)."""

    index: int
    steps: list[TurnStep]
    generation: tuple[float, float]
    tools: tuple[float, float]

    @property
    def policy_tokens(self) -> int:
        return sum(len(s.ids) for s in self.steps)

    @property
    def tool_calls(self) -> int:
        return sum("tool" in s.observation.info for s in self.steps)

    @property
    def tool_errors(self) -> int:
        return sum("tool_error" in s.observation.info for s in self.steps)

    def __str__(self) -> str:
        """Each episode's turn: what the model said, what the environment answered."""
        lines = [f"turn {self.index + 1}: {len(self.steps)} episode(s)"]
        for s in self.steps:
            lines.append(f"  [{s.episode}] model: {s.text}")
            if s.observation.text is not None and not s.ended:
                lines.append(
                    f"      {'tool error' if 'tool_error' in s.observation.info else s.observation.role or 'tool'}: "
                    f"{s.observation.text}"
                )
            if s.ended:
                lines.append(f"      episode ends, reward {s.observation.reward:g}")
        return "\n".join(lines)


@dataclass
class _TurnTimes:
    """One turn of a continuous run, gathered as its episodes' requests start and end."""

    index: int
    steps: list[TurnStep] = field(default_factory=list)
    generation: list[float] = field(default_factory=lambda: [math.inf, -math.inf])
    tools: list[float] = field(default_factory=lambda: [math.inf, -math.inf])

    def started(self, at: float) -> None:
        self.generation[0] = min(self.generation[0], at)

    def generated(self, at: float) -> None:
        self.generation[1] = max(self.generation[1], at)

    def add(self, step: TurnStep, started: float, stepped: float) -> None:
        self.steps.append(step)
        self.tools[:] = [min(self.tools[0], started), max(self.tools[1], stepped)]

    def turn(self) -> Turn:
        steps = sorted(self.steps, key=lambda s: s.episode)
        return Turn(self.index, steps, (self.generation[0], self.generation[1]), (self.tools[0], self.tools[1]))


class Episodes:
    """Episodes run turn by turn: each `next()` runs one turn of every episode still going and
    returns it as a `Turn` (what the policy said, what the environment answered); `batch()` gives
    the trajectories once every episode has ended. `run_episodes` is this, run to the end.

        episodes = Episodes(rollout, tokenizer, prompts, env, SamplingConfig(seed=0), EpisodeConfig())
        for turn in episodes:          # or next(episodes), one cell at a time
            print(turn)
        batch = episodes.batch()

    `run()` schedules continuously where the engine takes one request at a time (vLLM,
    `rollout.requests()`): each episode's next turn is added to the engine as soon as its
    environment step answered (between two engine steps), while the other episodes' turns
    decode. On such an engine every turn of an episode samples from its own
    stream, (seed, episode row, turn), in `next()` and `run()` alike, so an episode's samples do
    not depend on the schedule; only float rounding does (a step's batch changes the kernels'
    reduction order), so a sampled id can differ where two tokens are within rounding of each
    other. Other engines batch `run()` turn by turn as `next()` does, one stream per turn.

    `sampling.n` episodes per prompt row (rows of one prompt adjacent). The rollout is any
    engine of the rollout contract (HF or vLLM) with `pad_token_id` and `eos_token_id`.
    """

    def __init__(
        self, rollout, tokenizer, prompts: Batch, env: Environment, sampling: SamplingConfig, config: EpisodeConfig
    ):
        self.rollout, self.tokenizer, self.env, self.sampling, self.config = rollout, tokenizer, env, sampling, config
        self.rows = prompts.repeat(sampling.n, interleave=True) if sampling.n > 1 else prompts
        columns = [{k: self.rows.columns[k][i] for k in self.rows.columns} for i in range(len(self.rows))]
        self._episodes = [
            _Episode(ids[mask.bool()].tolist(), env.start(row), [], [], [], [])
            for ids, mask, row in zip(self.rows["input_ids"], self.rows["attention_mask"], columns)
        ]
        self._end_ids = set(sampling.end_ids(rollout.eos_token_id))
        self._stop = tuple(dict.fromkeys([*sampling.stop, *config.stop]))
        # How the engine takes a turn: one request per episode (vLLM), a batch continuing from
        # the last turn's KV cache (HF), or a batch of left-padded contexts (any other).
        requests, continued = getattr(rollout, "requests", None), getattr(rollout, "turns", None)
        self._requests = requests() if requests is not None else None
        self._continued = continued() if continued is not None and requests is None else None
        self.turns = 0
        """Turns run so far (the most any episode took)."""
        self.history: list[Turn] = []
        """Every turn run so far. In a continuous `run()` the turns overlap: a turn's generation
        and tool times span from its first episode's start to its last one's end."""

    @property
    def done(self) -> bool:
        return self.turns >= self.config.max_turns or all(e.done for e in self._episodes)

    def __iter__(self) -> Episodes:
        return self

    def __next__(self) -> Turn:
        config = self.config
        active = self._active()
        if self.turns >= config.max_turns or not active:
            raise StopIteration
        turn = self.turns
        started = time.time()
        if self._requests is not None:
            sampled = self._generate_requests(active)
        else:
            sampled = self._generate_batch(active, turn)
        generated = time.time()
        texts = self.tokenizer.batch_decode([ids for ids, _ in sampled], skip_special_tokens=True)
        # Every episode's step is sent before any is read: a tool sandbox runs them back to back.
        pending = [
            self._sampled(row, ids, log_probs, text) for (row, _), (ids, log_probs), text in zip(active, sampled, texts)
        ]
        steps = [
            self._observed(row, ids, text, p.result())
            for (row, _), (ids, _), text, p in zip(active, sampled, texts, pending)
        ]
        self.turns += 1
        self.history.append(Turn(turn, steps, (started, generated), (generated, time.time())))
        return self.history[-1]

    def run(self) -> Batch:
        """Every remaining turn, then the batch: continuously scheduled where the engine allows
        it (see the class docstring), else turn by turn."""
        if self._requests is not None and self.config.continuous and not self.done:
            self._run_continuously()
        for _ in self:
            pass
        return self.batch()

    # ---- one turn of an episode -----------------------------------------------------------
    def _active(self) -> list[tuple[int, _Episode]]:
        room = self.config.max_tokens
        return [(i, e) for i, e in enumerate(self._episodes) if not e.done and len(e.response) < room]

    def _turn_sampling(self, max_new_tokens: int, seed: int | None) -> SamplingConfig:
        return replace(self.sampling, n=1, max_new_tokens=max_new_tokens, stop=self._stop, seed=seed)

    def _request_sampling(self, row: int) -> SamplingConfig:
        """Episode `row`'s next turn as one request: its own stream, (seed, row, turn), and no
        more tokens than its response has room for."""
        e, config = self._episodes[row], self.config
        seed = self.sampling.seed
        return self._turn_sampling(
            min(config.turn_tokens, config.max_tokens - len(e.response)),
            None if seed is None else stream_seed(seed, row, len(e.turn_ends)),
        )

    def _generate_batch(self, active: list[tuple[int, _Episode]], turn: int) -> list[tuple[list[int], list[float]]]:
        """One turn of the `active` episodes as one engine call; each turn its own stream,
        reproducible from the episodes' seed."""
        config, seed = self.config, self.sampling.seed
        budget = min(config.turn_tokens, max(config.max_tokens - len(e.response) for _, e in active))
        turn_sampling = self._turn_sampling(budget, None if seed is None else stream_seed(seed, turn))
        contexts = [e.prompt + e.response for _, e in active]
        if self._continued is not None:  # each episode continues from its last turn (HF: its KV cache)
            out = self._continued.generate([row for row, _ in active], contexts, turn_sampling)
        else:
            ids, mask = left_padded(contexts, self.rollout.pad_token_id, self.rows["input_ids"].device)
            out = self.rollout.generate(Batch({"input_ids": ids, "attention_mask": mask}), turn_sampling)
        kept = [
            min(int(n), config.max_tokens - len(e.response)) for n, (_, e) in zip(out["response_mask"].sum(1), active)
        ]
        return [
            (ids[:n].tolist(), log_probs[:n].tolist())
            for ids, log_probs, n in zip(out["responses"], out["rollout_log_probs"], kept)
        ]

    def _generate_requests(self, active: list[tuple[int, _Episode]]) -> list[tuple[list[int], list[float]]]:
        """One turn of the `active` episodes as one request each, all added at once (`next()`
        on an engine of requests: the same streams as a continuous `run()`)."""
        requests = self._requests
        for row, e in active:
            requests.add(row, e.prompt + e.response, self._request_sampling(row))
        out = {}
        try:
            while requests.running:
                out.update((row, (ids, log_probs)) for row, ids, log_probs in requests.step())
        finally:
            requests.abort()
        return [out[row] for row, _ in active]

    def _sampled(self, row: int, ids: list[int], log_probs: list[float], text: str) -> Pending:
        """Episode `row` after its turn sampled `ids` (`text`: them decoded without special
        tokens, what the environment reads): the environment's step on the text, started."""
        e = self._episodes[row]
        e.response += ids
        e.policy += [True] * len(ids)
        e.log_probs += log_probs
        e.turn_ends.append(len(e.response) - 1)
        return self.env.submit(e.state, text)

    def _observed(self, row: int, ids: list[int], text: str, observation: Observation) -> TurnStep:
        """Episode `row` after the environment answered its turn: the observation appended (or
        the episode ended)."""
        e, config = self._episodes[row], self.config
        e.reward += float(observation.reward)
        e.tool_calls += "tool" in observation.info
        e.tool_errors += "tool_error" in observation.info
        e.tool_output_cuts += "tool_output_cut" in observation.info
        last = len(e.turn_ends) >= config.max_turns or len(e.response) >= config.max_tokens
        shown: list[int] = []
        if observation.done or last or observation.text is None:
            e.done = True
        else:
            closed = bool(ids) and ids[-1] in self._end_ids
            # Cut before it is tokenized: no token is longer than MAX_TOKEN_CHARS characters, so
            # the cut text still fills what the response has room for.
            cut = observation.text[: (config.max_tokens - len(e.response)) * MAX_TOKEN_CHARS]
            role = observation.role or config.tool_role
            shown = observation_ids(self.tokenizer, cut, not closed, role)
            shown = shown[: config.max_tokens - len(e.response)]
            e.response += shown
            e.policy += [False] * len(shown)
            e.log_probs += [0.0] * len(shown)
            e.observation_tokens += len(shown)
            e.done = len(e.response) >= config.max_tokens
        return TurnStep(row, ids, text, observation, shown, e.done)

    # ---- continuous scheduling ----------------------------------------------------------------
    def _run_continuously(self) -> None:
        """Every episode to its end, each turn added to the engine as soon as the episode's last
        environment step answered: no episode waits for another's turn. An environment step is
        sent when its turn ends and read between engine steps once it answered (a tool's
        sandbox works while the engine decodes), or at once when nothing else is decoding. The
        steps run in this thread: beside the engine on a thread of their own they made the tool
        task's rollout 2x slower on CPU (the engine loop and the steps' Python passing the GIL
        back and forth), and an environment need not be thread-safe."""
        requests = self._requests
        turns: dict[int, _TurnTimes] = {}
        waiting: dict[int, tuple[Pending, list[int], str, float]] = {}  # row -> its step under way

        def add(row: int) -> None:
            e = self._episodes[row]
            turn = len(e.turn_ends)
            turns.setdefault(turn, _TurnTimes(turn)).started(time.time())
            requests.add(row, e.prompt + e.response, self._request_sampling(row))

        def observe(row: int) -> None:
            pending, ids, text, sent = waiting.pop(row)
            step = self._observed(row, ids, text, pending.result())
            turns[len(self._episodes[row].turn_ends) - 1].add(step, sent, time.time())
            if not step.ended:
                add(row)

        try:
            for row, _ in self._active():
                add(row)
            while requests.running or waiting:
                if requests.running:
                    for row, ids, log_probs in requests.step():
                        turns[len(self._episodes[row].turn_ends)].generated(time.time())
                        text = self.tokenizer.decode(ids, skip_special_tokens=True)
                        waiting[row] = (self._sampled(row, ids, log_probs, text), ids, text, time.time())
                        if waiting[row][0].ready():  # answered at once: on before the next row's step
                            observe(row)
                for row in [row for row, (pending, *_) in waiting.items() if not requests.running or pending.ready()]:
                    observe(row)
        finally:
            requests.abort()
        self.history += [turns[t].turn() for t in sorted(turns)]
        self.turns = max((len(e.turn_ends) for e in self._episodes), default=self.turns)

    # ---- results --------------------------------------------------------------------------
    def batch(self) -> Batch:
        """The trajectories (see the module docstring), once every episode has ended."""
        if not self.done:
            raise RuntimeError(
                f"Episodes.batch(): {sum(not e.done for e in self._episodes)} episode(s) are still running after "
                f"{self.turns} turn(s); step on (next(episodes), or episodes.run()) until episodes.done"
            )
        return _batch(self.rows, self._episodes, self.rollout.pad_token_id, self.config)

    def prompt(self, row: int):
        """Episode `row`'s prompt: its chat (the prompt column) where the rows carry one, else its text."""
        prompts = self.rows.columns.get("prompt")
        if prompts is not None:
            return prompts[row]
        return self.tokenizer.decode(self._episodes[row].prompt, skip_special_tokens=True)

    def transcript(self, row: int) -> str:
        """Episode `row` so far, every token as the model sees it (special tokens written out)."""
        e = self._episodes[row]
        return self.tokenizer.decode(e.prompt + e.response, skip_special_tokens=False)

    def __len__(self) -> int:
        return len(self._episodes)


def run_episodes(
    rollout, tokenizer, prompts: Batch, env: Environment, sampling: SamplingConfig, config: EpisodeConfig
) -> Batch:
    """`sampling.n` episodes per prompt row, run turn by turn to the end (see `Episodes`)."""
    return Episodes(rollout, tokenizer, prompts, env, sampling, config).run()


def _batch(rows: Batch, episodes: list[_Episode], pad: int, config: EpisodeConfig) -> Batch:
    # Fixed widths (the episode's budgets), as a single-turn rollout pads to max_new_tokens: the
    # batches of several ranks (or calls) join whatever their episodes' lengths. Forwards skip
    # columns that are padding in every row, so the padding costs nothing there.
    width, turns = config.max_tokens, config.max_turns
    n = len(episodes)
    responses = torch.full((n, width), pad, dtype=torch.long)
    attended = torch.zeros((n, width), dtype=torch.long)
    policy = torch.zeros((n, width), dtype=torch.long)
    log_probs = torch.zeros((n, width))
    turn_ends = torch.full((n, turns), -1, dtype=torch.long)
    for row, e in enumerate(episodes):
        length = len(e.response)
        responses[row, :length] = torch.tensor(e.response, dtype=torch.long)
        attended[row, :length] = 1
        policy[row, :length] = torch.tensor(e.policy, dtype=torch.long)
        log_probs[row, :length] = torch.tensor(e.log_probs)
        turn_ends[row, : len(e.turn_ends)] = torch.tensor(e.turn_ends)
    # Built on the CPU, then moved where the prompts were (a GPU actor's device).
    prompt_tokens, prompt_mask = rows["input_ids"].cpu(), rows["attention_mask"].cpu()
    attention_mask = torch.cat([prompt_mask, attended], dim=1)
    figures = {
        "episode_reward": [e.reward for e in episodes],
        "turns": [len(e.turn_ends) for e in episodes],
        "tool_calls": [e.tool_calls for e in episodes],
        "tool_errors": [e.tool_errors for e in episodes],
        "tool_output_cuts": [e.tool_output_cuts for e in episodes],
        "observation_tokens": [e.observation_tokens for e in episodes],
    }
    return Batch(
        {
            "input_ids": torch.cat([prompt_tokens, responses], dim=1),
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
