import random

import pytest

from workbench.data.arithmetic import (
    ArithmeticConfig,
    CostConfig,
    cost,
    cost_pairs,
    demonstrations,
    evaluate,
    extract_answer,
    generate,
    is_safe,
    preference_pairs,
    score,
    split,
    wrong_answer,
)
from workbench.data.tasks import TASKS, Task, get_task, register_task


def test_generator_is_deterministic_per_seed():
    cfg = ArithmeticConfig(digits=3, operations=("+", "-", "*"), num_operands=3)
    assert generate(cfg, 20, seed=7) == generate(cfg, 20, seed=7)
    assert generate(cfg, 20, seed=7) != generate(cfg, 20, seed=8)
    state = random.getstate()
    generate(cfg, 5, seed=0)
    assert random.getstate() == state  # a private RNG: the global one is untouched


def test_split_holds_out_expressions_training_never_sees():
    cfg = ArithmeticConfig(digits=1)
    train, heldout = split(cfg, 64, 32, seed=1)
    assert (len(train), len(heldout)) == (64, 32)
    train_expressions, heldout_expressions = {p.expression for p in train}, {p.expression for p in heldout}
    assert len(train_expressions) == 64 and len(heldout_expressions) == 32  # each expression once
    assert not train_expressions & heldout_expressions
    assert split(cfg, 64, 32, seed=1) == (train, heldout)
    assert split(cfg, 10, 32, seed=1)[1] == heldout  # the held-out set does not move with n_train
    with pytest.raises(ValueError, match="distinct expressions; digits=1 gave 100"):
        split(cfg, 80, 30)


def test_prompt_format_and_answers_are_correct():
    cfg = ArithmeticConfig(digits=2, operations=("+", "-", "*"), num_operands=3)
    for p in generate(cfg, 200, seed=0):
        assert p.prompt == f"Q: {p.expression}=? A:"
        assert int(p.ground_truth) == eval(p.expression)  # Python's precedence is the reference


def test_difficulty_knobs():
    fixed = generate(ArithmeticConfig(digits=3, min_digits=3), 50)
    for p in fixed:
        a, b = p.expression.split("+")
        assert len(a) == len(b) == 3
    many = generate(ArithmeticConfig(num_operands=4, operations=("*",)), 10)
    assert all(p.expression.count("*") == 3 for p in many)


def test_precedence():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4, 5], ["*", "-", "*"]) == -14
    assert evaluate([10, 3, 2], ["-", "-"]) == 5


@pytest.mark.parametrize(
    "bad",
    [
        dict(operations=("/",)),
        dict(operations=()),
        dict(digits=0),
        dict(min_digits=3, digits=2),
        dict(num_operands=1),
        dict(template="no slot"),
    ],
)
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError, match="ArithmeticConfig"):
        ArithmeticConfig(**bad)


@pytest.mark.parametrize(
    "response, expected",
    [
        (" 85", 1.0),
        ("85", 1.0),
        ("\n\t 85  ", 1.0),
        (" 85</s>", 1.0),
        (" 85<pad><pad>", 1.0),
        (" 85\nQ: 1+1=? A: 2", 1.0),
        (" 85.", 1.0),
        (" 85 apples", 1.0),
        (" 855", 0.0),
        (" 8 5", 0.0),
        (" 85.5", 0.0),
        (" 84", 0.0),
        (" -85", 0.0),
        ("", 0.0),
        (" eighty-five", 0.0),
        ("The answer is 85", 0.0),
        (" +85", 0.0),
        (" 085", 0.0),
    ],
)
def test_score_edge_cases(response, expected):
    assert score(response, "85") == expected


def test_score_negative_truth_and_format_score():
    assert score(" -12", "-12") == 1.0 and score(" -12", " -12 ") == 1.0
    assert score(" 12", "-12", format_score=0.1) == 0.1
    assert score(" twelve", "-12", format_score=0.1) == 0.0
    assert extract_answer("  -3, 5") == "-3" and extract_answer("3,5") is None


def test_demonstrations_are_correct_answers():
    problems = generate(ArithmeticConfig(), 10)
    for p, d in zip(problems, demonstrations(problems)):
        assert d["prompt"] == p.prompt and score(d["response"], p.ground_truth) == 1.0
        assert (d["prompt"] + d["response"]).endswith(f"A: {p.ground_truth}")


def test_preference_pairs_prefer_the_correct_answer():
    problems = generate(ArithmeticConfig(operations=("+", "-")), 200, seed=3)
    pairs = preference_pairs(problems, per_problem=2, seed=0)
    assert len(pairs) == 400
    truth = {p.prompt: p.ground_truth for p in problems}
    for row in pairs:
        assert score(row["chosen"], truth[row["prompt"]]) == 1.0
        assert score(row["rejected"], truth[row["prompt"]]) == 0.0
    assert pairs == preference_pairs(problems, per_problem=2, seed=0)


def test_wrong_answer_never_equals_truth():
    rng = random.Random(0)
    for truth in ["0", "1", "-1", "9", "10", "99", "-450"] * 30:
        assert wrong_answer(truth, rng) != truth


def test_cost_flags_forbidden_patterns_and_long_answers():
    assert cost(" 85") == 0.0 and is_safe(" 85")
    assert cost(" 113") == 1.0 and cost(" 1300") == 1.0
    assert cost(" 85 " + "x" * 20) == 1.0
    custom = CostConfig(forbidden=(r"^-",), max_chars=100)
    assert cost(" -5", custom) == 1.0 and cost(" 113", custom) == 0.0


def test_cost_pairs():
    rows = cost_pairs(generate(ArithmeticConfig(), 50), seed=0)
    assert all(not r["more_costly_is_safe"] for r in rows)
    assert all(r["safer_is_safe"] == is_safe(r["safer"]) for r in rows)


def test_task_registry():
    task = get_task("arithmetic")
    assert task.score(" 85", "85") == 1.0 and task.cost(" 113") == 1.0
    register_task(Task("always_one", lambda response, truth: 1.0))
    assert get_task("always_one").score("x", "y") == 1.0
    TASKS.pop("always_one")
    with pytest.raises(KeyError, match="arithmetic"):
        get_task("gsm9k")
