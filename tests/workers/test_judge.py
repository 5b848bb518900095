"""An LLM judge as a reward worker group: its scores are the judge model's own, run alone."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workbench import Batch, DispatchError, WorkerCallError
from workbench.data.prompts import tokenize_prompts
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError
from workbench.models import ModelLoadError, make_tiny
from workbench.workers.judge import VERDICTS, JudgeConfig, JudgeWorker, judge_chat, score_on, yes_no

MICRO = 4
LONGEST = 96  # the fifth row's judge prompt is longer: it is cut
TEMPLATE = "Question: {prompt}\nReference: {ground_truth}\nAnswer: {response}"
"""The response last: the random tiny judge's reply varies most with its prompt's last words."""


def text_score(text: str) -> float:
    """Any text to a number, the same in every process (unlike hash()): the tiny judge is
    random, so what it says is no verdict, but equal texts still give equal scores."""
    return float(sum(map(ord, text)) % 5) / 4


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return str(make_tiny("1m", tmp_path_factory.mktemp("judge") / "chat", seed=6, chat=True))


@pytest.fixture(scope="module")
def rows():
    """Five answered rows (odd: two ranks get a padding row), text and chat prompts."""
    prompts = ["Q: 2+3=? A:", [{"role": "user", "content": "What is 7*6?"}], "Q: 9-4=? A:"]
    prompts += [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}], "Q: 1+1=?"]
    responses = [" 5", "42", " 6", "7", " 2" + " and so on" * 40]
    return Batch(
        {"row": torch.arange(5)},
        {
            "prompt": prompts,
            "response_text": responses,
            "ground_truth": ["5", "42", "5", "any prime", "2"],
            "uid": [f"u{i}" for i in range(5)],
        },
    )


def config(judge_dir, **changes) -> JudgeConfig:
    settings = dict(
        model_path=judge_dir,
        template=TEMPLATE,
        verdict=text_score,
        max_prompt_length=LONGEST,
        micro_batch_size=MICRO,
        system="Grade.",
    )
    return JudgeConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def alone(judge_dir, rows):
    """The judge model on its own in this process: plain transformers, its prompts tokenized by
    tokenize_prompts (left-truncated), greedy `generate` over the same micro-batches."""
    cfg = config(judge_dir)
    tokenizer = AutoTokenizer.from_pretrained(judge_dir)
    model = AutoModelForCausalLM.from_pretrained(judge_dir, dtype=torch.float32).eval()
    end = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    chats = [
        judge_chat(cfg, rows["prompt"][i], rows["response_text"][i], rows["ground_truth"][i]) for i in range(len(rows))
    ]
    texts, truncated = [], 0
    for first in range(0, len(chats), MICRO):
        prompts = tokenize_prompts(
            [{"prompt": chat, "ground_truth": None} for chat in chats[first : first + MICRO]],
            tokenizer,
            LONGEST,
            overlong="truncate",
        )
        truncated += prompts.info["num_truncated"]
        width = prompts["input_ids"].shape[1]
        with torch.no_grad():
            out = model.generate(
                input_ids=prompts["input_ids"],
                attention_mask=prompts["attention_mask"],
                do_sample=False,
                max_new_tokens=16,
                eos_token_id=end,
                pad_token_id=tokenizer.pad_token_id,
            )
        texts += [t.strip() for t in tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)]
    return texts, truncated


@pytest.fixture(scope="module")
def dp1(shared_session, judge_dir, rows):
    """What a one-rank judge group gives for the rows."""
    judge = shared_session.group("judge", JudgeWorker, shared_session.pool("judge_pool", 1), config(judge_dir))
    return judge.compute_reward(rows).get()


def test_the_judge_group_scores_what_the_judge_model_alone_says(dp1, alone, rows):
    texts, truncated = alone
    assert list(dp1["judge_verdict"]) == texts
    assert dp1["scores"].tolist() == [text_score(t) for t in texts]
    assert dp1["scores"].dtype == torch.float32
    assert dp1["reward/fallbacks"].tolist() == [0.0] * len(rows)
    assert dp1["judge_truncated"].tolist() == [0.0] * 4 + [1.0] and truncated == 1
    assert len(set(texts)) > 2 and len(set(dp1["scores"].tolist())) > 1, texts  # not one verdict repeated


def test_two_ranks_judge_as_one(session, judge_dir, rows, dp1):
    """dp=2: each rank judges its shard (3 rows, one of them padding on the second rank); the
    padding is not in the result, and the verdicts are the one-rank group's."""
    judge = session.group("judge2", JudgeWorker, session.pool("judge_pool2", 2), config(judge_dir))
    got = judge.compute_reward(rows).get()
    assert len(got) == len(rows) and "is_padding" not in got.keys()
    assert list(got["judge_verdict"]) == list(dp1["judge_verdict"])
    assert torch.equal(got["scores"], dp1["scores"])


def test_unreadable_verdicts_fall_back_or_fail_naming_the_row(session, judge_dir, rows, dp1):
    verdicts = list(dp1["judge_verdict"])
    row = next(i for i, v in enumerate(verdicts) if verdicts.count(v) == 1)
    unreadable = verdicts[row]

    def reads_all_but_one(text: str) -> float | None:
        return None if text == unreadable else 1.0

    # Both judges in one process per device (fused roles), each with its own config.
    groups = session.fused(
        session.pool("fallback_pool", 1),
        lenient=(JudgeWorker, config(judge_dir, verdict=reads_all_but_one, fallback=-0.5)),
        strict=(JudgeWorker, config(judge_dir, verdict=reads_all_but_one)),
    )
    got = groups["lenient"].compute_reward(rows).get()
    fell_back = [float(v == unreadable) for v in verdicts]
    assert got["reward/fallbacks"].tolist() == fell_back
    assert got["scores"].tolist() == [-0.5 if f else 1.0 for f in fell_back]

    with pytest.raises(WorkerCallError, match=rf"verdict on row uid=u{row} cannot be read as a score: ") as error:
        groups["strict"].compute_reward(rows).get()
    assert repr(unreadable[:200]) in str(error.value)
    assert "JudgeConfig.verdict" in str(error.value) and "JudgeConfig.fallback" in str(error.value)

    # On the driver, before any remote work: a batch without the responses the template reads.
    with pytest.raises(
        DispatchError, match=r"lenient.compute_reward: the batch has no column\(s\) \['response_text'\]"
    ):
        groups["lenient"].compute_reward(rows.select("row", "prompt", "ground_truth", "uid"))


def test_bad_configs_are_refused_on_the_driver(judge_dir, tmp_path):
    for template, words in [
        ("Rate this: {prompt}", r"JudgeConfig.template=.*add \{response\}"),
        ("{response} vs {answer}", r"JudgeConfig.template=\['\{answer\}'\]: unknown placeholder"),
        ("{response} {", r"JudgeConfig.template=.*literal brace"),
    ]:
        with pytest.raises(ConfigError, match=words):
            JudgeConfig(model_path=judge_dir, template=template)
    with pytest.raises(ConfigError, match=r"JudgeConfig.verdict='stars': use one of \['score', 'yes_no'\]"):
        JudgeConfig(model_path=judge_dir, verdict="stars")
    with pytest.raises(ConfigError, match=r"JudgeConfig.fallback"):
        JudgeConfig(model_path=judge_dir, fallback=float("nan"))
    with pytest.raises(ConfigError, match=r"JudgeConfig.sampling.*n=1"):
        JudgeConfig(model_path=judge_dir, sampling=SamplingConfig(n=2))
    JudgeConfig(model_path=judge_dir, template="{{literal}} {response}")  # escaped braces are text
    # The layout check reads the directory: the default 512-token prompts and 16-token verdicts
    # do not fit the tiny kit's 512 positions.
    with pytest.raises(ModelLoadError, match=r"exceed the 512 positions of JudgeConfig.model_path"):
        JudgeConfig(model_path=judge_dir).check_layout(None, "judge")
    config(judge_dir).check_layout(None, "judge")
    plain = make_tiny("1m", tmp_path / "plain", seed=0)  # no chat template
    with pytest.raises(ModelLoadError, match=r"has no chat template"):
        config(str(plain)).check_layout(None, "judge")


def test_built_in_verdicts():
    assert [yes_no(t) for t in ("Yes.", "no, it is wrong", "I think YES", "maybe", "nobody knows")] == [
        1.0,
        0.0,
        1.0,
        None,
        None,
    ]
    score = VERDICTS["score"]
    assert [score(t) for t in ("8/10", "Score: 10", "0", "-1", "42", "none")] == [0.8, 1.0, 0.0, None, None, None]
    assert score_on(1, 5)("4 of 5") == 0.75
    with pytest.raises(ConfigError, match=r"score_on"):
        score_on(5, 5)
