"""The chat variant of the arithmetic task: problems as system + user messages, the assistant's
text graded by its final number, and a harder held-out split disjoint by construction."""

import pytest

from tests.chat_kit import add_chatml
from workbench.data import arithmetic, arithmetic_chat
from workbench.data.prompts import render_prompt
from workbench.data.tasks import get_task
from workbench.models import train_tokenizer
from workbench.run import build
from workbench.run.config import load_config


@pytest.mark.parametrize(
    "response, expected",
    [
        ("85", 1.0),
        (" 85.\n", 1.0),
        ("The answer is 85.", 1.0),
        ("37 + 48 = 85", 1.0),
        ("**85**", 1.0),
        ("85.0", 0.0),
        ("085", 0.0),
        ("84", 0.0),
        ("85 + 1 = 86", 0.0),
        ("To add 37 and 48, we", 0.0),
        ("", 0.0),
    ],
)
def test_the_final_number_is_the_answer(response, expected):
    assert arithmetic_chat.score(response, "85") == expected


def test_negative_answers_and_a_registered_task():
    assert arithmetic_chat.score("3 - 15 = -12", "-12") == 1.0 and arithmetic_chat.score("- 12", "-12") == 0.0
    task = get_task("arithmetic_chat")
    assert task.score is arithmetic_chat.score and task.cost is None
    assert get_task("arithmetic").prompt(arithmetic.Problem("Q: 1+2=? A:", "3", "1+2")) == "Q: 1+2=? A:"


def test_problems_become_a_system_line_and_a_question():
    problem = arithmetic.generate(arithmetic.ArithmeticConfig(digits=2, operations=("+", "-", "*"), num_operands=3), 1)[
        0
    ]
    (user,) = arithmetic_chat.messages(problem)  # no system line: the template's own
    system, _ = arithmetic_chat.messages(problem, system="Be brief.")
    assert system == {"role": "system", "content": "Be brief."}
    assert user["role"] == "user" and user["content"].endswith("? Answer with the number only.")
    assert user["content"].replace(" ", "").removeprefix("Whatis").startswith(problem.expression)
    assert arithmetic_chat.spaced("-3+4*-2") == "-3 + 4 * -2"  # a sign stays with its number
    tokenizer = add_chatml(train_tokenizer())
    rendered = render_prompt(arithmetic_chat.messages(problem, system="Be brief."), tokenizer)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")


def test_the_harder_split_never_shares_an_expression_with_training():
    for cfg in (
        arithmetic.ArithmeticConfig(digits=1),
        arithmetic.ArithmeticConfig(digits=2, min_digits=1, operations=("+", "-"), num_operands=3),
    ):
        hard = arithmetic.harder(cfg)
        assert hard.min_digits == hard.digits == cfg.digits + 1 and hard.operations == cfg.operations
        train = {p.expression for p in arithmetic.generate(cfg, 2000, seed=0)}
        held_out = arithmetic.generate(hard, 500, seed=0)  # the same seed on purpose
        assert not train & {p.expression for p in held_out}
        assert held_out == arithmetic.generate(hard, 500, seed=0)  # seeded


def test_a_run_config_draws_chat_rows_and_a_disjoint_harder_held_out_set():
    config = load_config(
        None,
        [
            "data.task=arithmetic_chat",
            "data.held_out=harder",
            "data.arithmetic.digits=1",
            "data.train_size=300",
            "data.eval_size=50",
        ],
    )
    train, held_out = build.prompt_rows(config)
    assert len(held_out) == 50 and all(isinstance(r["prompt"], list) for r in train + held_out)
    questions = lambda rows: {r["prompt"][-1]["content"] for r in rows}  # noqa: E731
    assert not questions(train) & questions(held_out)
    assert all(len(r["ground_truth"]) <= 2 for r in train)  # sums of one-digit operands
    assert min(int(r["ground_truth"]) for r in held_out) >= 20  # two-digit operands
    same = build.prompt_rows(load_config(None, ["data.task=arithmetic_chat", "data.eval_size=50"]))
    assert not questions(same[0]) & questions(same[1])  # "same": overlapping draws are dropped from training
    with pytest.raises(Exception, match=r"data\.held_out=.*'same', 'harder'"):
        load_config(None, ["data.held_out=hard"])
