"""An LLM judge as a reward: a generative reward model, run as a worker group.

A local chat model reads each row through a rubric (`JudgeConfig.template`, filled with the
policy's prompt, its response and the ground truth), answers in a few greedy tokens, and that
answer (the verdict) becomes the row's score through `JudgeConfig.verdict`:

    judge = session.group("reward", JudgeWorker, session.pool("judge", 1), JudgeConfig(model_path=...))
    scores = judge.compute_reward(generated)     # another group's future, or a Batch
    scores.get()["judge_verdict"]                # what the judge said, row by row

Every data-parallel rank keeps the whole judge and judges its own shard of the rows (DP_PROTO,
whatever the mesh: a judge fused into a tensor-parallel actor's processes still works, as
independent replicas). Padding rows are not judged: they score 0 and are dropped on collect.

The output: `scores` (float32), `reward/fallbacks` (1.0 where the verdict could not be read and
`JudgeConfig.fallback` scored the row instead: the workbench's one name for rows that fell
back), `judge_truncated` (1.0 where the judge's prompt was longer than
`JudgeConfig.max_prompt_length` and lost its beginning) and the column `judge_verdict`.
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench import checks
from workbench.controller import DP_PROTO, Worker, register
from workbench.data.batch import PAD_KEY, Batch
from workbench.data.prompts import left_padded, prompt_ids, show_conversation
from workbench.engines.frozen import keep_frozen
from workbench.engines.hf_rollout import HFRollout, HFRolloutConfig
from workbench.engines.rollout import SamplingConfig, end_token_ids, response_texts
from workbench.errors import ConfigError, DispatchError, WorkbenchError
from workbench.models.load import LoadConfig, ModelLoadError, check_model_dir, check_positions, for_worker, load

Verdict = Callable[[str], "float | None"]
"""Reads a judge's reply: a score, or None when the reply says nothing readable."""

PLACEHOLDERS = ("prompt", "response", "ground_truth")
"""What a template may name; each is a column of the batch (`prompt` shown as text)."""
COLUMNS = {"prompt": "prompt", "response": "response_text", "ground_truth": "ground_truth"}

DEFAULT_TEMPLATE = """You are grading an answer to a question against the reference answer.

Question:
{prompt}

Reference answer:
{ground_truth}

Answer to grade:
{response}

Does the answer agree with the reference answer? Reply with one word: yes or no."""

SHOWN_CHARS = 200
"""How much of a verdict an error quotes."""


class JudgeError(WorkbenchError):
    """A verdict could not be made into a score; the message names the row and the fix."""


# ---- built-in verdicts --------------------------------------------------------------------------
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def score_on(low: float, high: float) -> Verdict:
    """A verdict read as the first number in the reply, on the scale [low, high] the rubric
    asks for, mapped to [0, 1]. A number off the scale is unreadable (None), not clipped: a
    judge that answers 42 on a 0-10 scale did not follow the rubric, and clipping would hide it."""
    if not (checks.is_real(low) and checks.is_real(high) and low < high):
        raise ConfigError("score_on(low, high)", (low, high), "give a scale with low < high, e.g. score_on(0, 10)")

    def score(text: str) -> float | None:
        found = _NUMBER.search(text)
        if found is None:
            return None
        value = float(found.group())
        return (value - low) / (high - low) if low <= value <= high else None

    score.__qualname__ = f"score_on({low}, {high})"
    return score


def yes_no(text: str) -> float | None:
    """1.0 when the reply's first "yes" or "no" (a whole word, any case) is yes, 0.0 when it is
    no, None when it has neither."""
    found = _YES_NO.search(text)
    return None if found is None else float(found.group(1).lower() == "yes")


VERDICTS: dict[str, Verdict] = {"score": score_on(0, 10), "yes_no": yes_no}
"""Verdicts by name: "score" reads a 0-10 score as score / 10; "yes_no" reads yes as 1, no as 0."""


# ---- configuration ------------------------------------------------------------------------------
@dataclass
class JudgeConfig:
    """An LLM judge: which model, what it is asked, and how its answer becomes a score."""

    model_path: str
    """Any local chat causal-LM directory (its tokenizer needs a chat template)."""
    template: str = DEFAULT_TEMPLATE
    """The judge's question, with {prompt} (the policy's prompt; a chat shown as `role: content`
    lines), {response} (required) and {ground_truth}. Write a literal brace as {{ or }}."""
    verdict: str | Verdict = "yes_no"
    """How the judge's reply becomes a score: a function text -> float | None (None: unreadable),
    or a name in VERDICTS ("yes_no", "score")."""
    fallback: float | None = None
    """The score of a row whose verdict is unreadable (counted in reward/fallbacks); None: such
    a row fails the call with an error naming it."""
    system: str = ""
    """A system message before the question ("" = none)."""
    max_prompt_length: int = 512
    """Most tokens of a judge's prompt; a longer one keeps its last tokens (where the response
    and the question to answer are) and is marked in judge_truncated."""
    micro_batch_size: int = 8
    """Rows generated together."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=16, greedy=True))
    """How the judge answers: greedy, at most 16 tokens, by default (one answer per row: n=1)."""
    hf: HFRolloutConfig = field(default_factory=HFRolloutConfig)
    """HF generate settings (KV cache, compiled decoding), as ActorConfig.hf."""
    load: LoadConfig = field(default_factory=LoadConfig)

    def __post_init__(self):
        if not isinstance(self.model_path, (str, os.PathLike)) or not str(self.model_path):
            raise ConfigError("JudgeConfig.model_path", self.model_path, "give a local chat model directory")
        check_template(self.template)
        if not (callable(self.verdict) or (isinstance(self.verdict, str) and self.verdict in VERDICTS)):
            raise ConfigError(
                "JudgeConfig.verdict",
                self.verdict,
                f"use one of {sorted(VERDICTS)}, or a function text -> float | None",
            )
        checks.real("JudgeConfig", "fallback", self.fallback, fix="give a finite score, or None", none_ok=True)
        checks.of_type("JudgeConfig", "system", self.system, str, "give the system message as text ('' = none)")
        checks.whole(
            "JudgeConfig", "max_prompt_length", self.max_prompt_length, fix="use a whole number of tokens >= 1"
        )
        checks.whole("JudgeConfig", "micro_batch_size", self.micro_batch_size, fix="use a whole number of rows >= 1")
        checks.of_type("JudgeConfig", "sampling", self.sampling, SamplingConfig, "pass a SamplingConfig")
        if self.sampling.n != 1:
            raise ConfigError("JudgeConfig.sampling", self.sampling, "a judge gives one verdict per row: use n=1")
        checks.of_type("JudgeConfig", "hf", self.hf, HFRolloutConfig, "pass an HFRolloutConfig")
        checks.of_type("JudgeConfig", "load", self.load, LoadConfig, "pass a workbench.models.load.LoadConfig")
        if self.load.compile:
            raise ConfigError(
                "JudgeConfig.load.compile",
                True,
                "a judge only generates: compile its decoding with hf=HFRolloutConfig(compile=True)",
            )

    def parser(self) -> Verdict:
        return VERDICTS[self.verdict] if isinstance(self.verdict, str) else self.verdict

    def columns(self) -> list[str]:
        """The batch columns the template reads."""
        return [COLUMNS[name] for name in PLACEHOLDERS if name in placeholders(self.template)]

    def check_layout(self, mesh, role: str) -> None:
        """Driver-side, before workers start: a causal LM with a chat template, and room in its
        positions for the longest judge prompt and its answer."""
        limit = check_model_dir(self.model_path, "JudgeConfig.model_path", "causal", self.load.trust_remote_code)
        if not has_chat_template(Path(self.model_path)):
            raise ModelLoadError(
                f"JudgeConfig.model_path={str(self.model_path)!r} has no chat template; the judge is asked in its "
                "own chat format. Use a chat model's directory (e.g. one imported with workbench.models.import_gguf)"
            )
        check_positions(
            limit, self.max_prompt_length, self.sampling.max_new_tokens, "JudgeConfig.model_path", str(self.model_path)
        )

    def check_call(self, role: str, method: str, arguments: dict) -> None:
        """Driver-side: a Batch given to compute_reward has the columns the template reads."""
        batch = arguments.get("batch")
        if isinstance(batch, Batch):
            check_columns(self, batch, f"{role}.{method}")


def placeholders(template: str) -> set[str]:
    """The names a template's {fields} use."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def check_template(template: Any) -> None:
    if not isinstance(template, str):
        raise ConfigError("JudgeConfig.template", template, "give the judge's question as text with {response} in it")
    try:
        names = placeholders(template)
    except ValueError as error:  # a lone brace
        raise ConfigError(
            "JudgeConfig.template", _short(template), f"{error}; write a literal brace as {{{{ or }}}}"
        ) from None
    unknown = sorted(names - set(PLACEHOLDERS))
    if unknown:
        raise ConfigError(
            "JudgeConfig.template",
            [f"{{{name}}}" for name in unknown],
            "unknown placeholder(s); use {prompt}, {response} and {ground_truth} (a literal brace is {{ or }})",
        )
    if "response" not in names:
        raise ConfigError(
            "JudgeConfig.template", _short(template), "the judge would never see the response: add {response}"
        )


def has_chat_template(path: Path) -> bool:
    """The tokenizer files carry a chat template (as transformers saves one, in any of its forms)."""
    if (path / "chat_template.jinja").exists() or (path / "chat_template.json").exists():
        return True
    config = path / "tokenizer_config.json"
    return config.exists() and '"chat_template"' in config.read_text(encoding="utf-8")


def check_columns(config: JudgeConfig, batch: Batch, where: str) -> None:
    missing = [c for c in config.columns() if c not in batch]
    if missing:
        raise DispatchError(
            f"{where}: the batch has no column(s) {missing}, which JudgeConfig.template reads; columns: "
            f"{batch.keys()} (generate_sequences decodes responses into 'response_text'; prompts and ground "
            f"truths come from tokenize_prompts)"
        )


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


# ---- the worker ---------------------------------------------------------------------------------
def shown_prompt(prompt: str | list[dict[str, str]]) -> str:
    """The policy's prompt as the judge reads it: text as it is, a chat as `role: content` lines."""
    return prompt if isinstance(prompt, str) else show_conversation(prompt)


def judge_chat(config: JudgeConfig, prompt: Any, response: str, ground_truth: Any) -> list[dict[str, str]]:
    """The judge's messages for one row."""
    question = config.template.format(
        prompt=shown_prompt(prompt) if prompt is not None else "",
        response=response,
        ground_truth="" if ground_truth is None else str(ground_truth),
    )
    system = [{"role": "system", "content": config.system}] if config.system else []
    return [*system, {"role": "user", "content": question}]


def row_fields(batch: Batch, i: int) -> tuple[Any, Any, Any]:
    """Row i's prompt, response text and ground truth (None for a column the batch lacks)."""
    prompt, response, ground_truth = (batch[COLUMNS[n]][i] if COLUMNS[n] in batch else None for n in PLACEHOLDERS)
    return prompt, response, ground_truth


class JudgeWorker(Worker):
    def __init__(self, config: JudgeConfig):
        super().__init__(config)
        loaded = load(config.model_path, for_worker(config.load, self.device, trained=False))
        self.tokenizer = loaded.tokenizer
        model = keep_frozen(loaded.model, "whole", None, self.device)
        end = end_token_ids(model, self.tokenizer)  # a chat model's end of turn ends its verdict
        self.rollout = HFRollout(model, self.tokenizer.pad_token_id, end, config.hf, tokenizer=self.tokenizer)
        self.verdict = config.parser()

    @register(DP_PROTO)
    def compute_reward(self, batch: Batch) -> Batch:
        """scores from the judge's verdicts on this rank's rows (see the module docstring)."""
        config = self.config
        check_columns(config, batch, f"{self.context.role}.compute_reward")  # rows that came from another group
        padding = batch[PAD_KEY].tolist() if PAD_KEY in batch.tensors.keys() else [False] * len(batch)
        rows = [i for i, pad in enumerate(padding) if not pad]  # padding is dropped on collect: not judged
        texts, truncated = self._generate([judge_chat(config, *row_fields(batch, i)) for i in rows])
        uids = list(batch["uid"]) if "uid" in batch else list(range(len(batch)))
        values = [read_verdict(self.verdict, text, uids[i]) for i, text in zip(rows, texts)]
        unreadable = [(i, text) for i, text, value in zip(rows, texts, values) if value is None]
        if unreadable and config.fallback is None:
            (first, text), more = unreadable[0], len(unreadable) - 1
            raise JudgeError(
                f"the judge's verdict on row uid={uids[first]}{f' (and {more} more row(s))' if more else ''} cannot "
                f"be read as a score: {text[:SHOWN_CHARS]!r}. Give JudgeConfig.verdict a function that reads it "
                f"(text -> float | None), ask for that form in JudgeConfig.template, or set JudgeConfig.fallback "
                f"to score such rows"
            )

        scores, fell_back, cut = (torch.zeros(len(batch), dtype=torch.float32) for _ in range(3))
        verdicts = [""] * len(batch)
        for i, text, value, was_cut in zip(rows, texts, values, truncated):
            scores[i] = value if value is not None else config.fallback
            fell_back[i], cut[i], verdicts[i] = float(value is None), float(was_cut), text
        # The host puts the input's padding marks on this row-for-row output.
        return Batch(
            {"scores": scores, "reward/fallbacks": fell_back, "judge_truncated": cut}, {"judge_verdict": verdicts}
        )

    @torch.no_grad()
    def _generate(self, chats: list[list[dict[str, str]]]) -> tuple[list[str], list[bool]]:
        """The judge's reply to each chat, and whether its prompt was cut to fit."""
        config, tokenizer = self.config, self.tokenizer
        texts, truncated = [], []
        for first in range(0, len(chats), config.micro_batch_size):
            ids = [prompt_ids(chat, tokenizer) for chat in chats[first : first + config.micro_batch_size]]
            truncated += [len(row) > config.max_prompt_length for row in ids]
            input_ids, mask = left_padded(
                [row[-config.max_prompt_length :] for row in ids], tokenizer.pad_token_id, self.device
            )
            prompts = Batch(
                {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
            )
            out = self.rollout.generate(prompts, config.sampling)
            texts += [text.strip() for text in response_texts(out, tokenizer)]
        return texts, truncated


def read_verdict(verdict: Verdict, text: str, uid: Any) -> float | None:
    """verdict(text), checked: a finite number, or None for an unreadable verdict."""
    where = f"on row uid={uid} (verdict {text[:SHOWN_CHARS]!r})"
    try:
        value = verdict(text)
    except Exception as error:
        raise JudgeError(f"JudgeConfig.verdict raised {where}: {type(error).__name__}: {error}") from error
    if value is None:
        return None
    if not checks.is_real(value):
        raise JudgeError(
            f"JudgeConfig.verdict returned {value!r} {where}, not a finite number; return None for a verdict it "
            f"cannot read (JudgeConfig.fallback then scores the row)"
        )
    return float(value)
