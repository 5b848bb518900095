"""The tool task: 3-digit x 2-digit products as a chat that offers a calculator, the final turn
graded by its last number (0 while it is still a tool call), and a held-out split that shares
no problem with training."""

import json

import pytest

from workbench.agents import parse_tool_call
from workbench.data import tool_multiply
from workbench.data.tasks import get_task
from workbench.data.tool_multiply import MultiplyConfig


def test_problems_are_three_by_two_digit_products_deterministic_for_a_seed():
    problems = tool_multiply.generate(MultiplyConfig(), 50, seed=3)
    assert problems == tool_multiply.generate(MultiplyConfig(), 50, seed=3)
    for p in problems:
        a, b = p.expression.split("*")
        assert len(a) == 3 and len(b) == 2 and int(p.ground_truth) == int(a) * int(b)
    assert tool_multiply.generate(MultiplyConfig(), 50, seed=4) != problems


def test_the_held_out_split_shares_no_problem_with_training():
    train, heldout = tool_multiply.split(MultiplyConfig(), 300, 64, seed=0)
    assert len(train) == 300 and len(heldout) == 64
    assert len({p.expression for p in train}) == 300 and len({p.expression for p in heldout}) == 64
    assert not {p.expression for p in train} & {p.expression for p in heldout}
    more_train, fewer_heldout = tool_multiply.split(MultiplyConfig(), 500, 16, seed=0)
    assert fewer_heldout == heldout[:16] and more_train[:300] == train  # nested: one reserve, one stream
    assert not {p.expression for p in more_train} & {p.expression for p in heldout}
    with pytest.raises(ValueError, match="distinct problems"):
        tool_multiply.split(MultiplyConfig(digits=(1, 1)), 100, 10)  # 81 products in all
    with pytest.raises(ValueError, match="MultiplyConfig.digits"):
        MultiplyConfig(digits=(3,))


def test_the_chat_offers_the_calculator_and_a_demonstration_uses_it():
    problem = tool_multiply.generate(MultiplyConfig(), 1, seed=0)[0]
    system, user = tool_multiply.messages(problem)
    assert "<tool_call>" in system["content"] and "calculator" in system["content"]
    assert user == {"role": "user", "content": f"What is {problem.expression.replace('*', ' * ')}?"}
    assert "calculator" not in tool_multiply.messages(problem, tools=False)[0]["content"]
    *prompt, call, reply, answer = tool_multiply.demonstration(problem)
    parsed = parse_tool_call(call["content"])  # the environment reads the demonstrated call
    assert parsed.name == "calculator" and eval(parsed.arguments["expression"]) == int(problem.ground_truth)
    assert reply == {"role": "tool", "content": problem.ground_truth}
    assert answer == {"role": "assistant", "content": problem.ground_truth}
    assert json.loads(call["content"][len("<tool_call>") : -len("</tool_call>")])["name"] == "calculator"
    rows = tool_multiply.demonstrations(tool_multiply.generate(MultiplyConfig(), 200, seed=1), tool_share=0.5)
    with_tools = sum(any(m["role"] == "tool" for m in r["messages"]) for r in rows)
    assert 60 < with_tools < 140  # about half call the calculator, the rest answer directly


@pytest.mark.parametrize(
    "response, expected",
    [
        ("5535", 1.0),
        ("The answer is 5535.", 1.0),
        ("5534", 0.0),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "5535"}}</tool_call>', 0.0),
        ("", 0.0),
    ],
)
def test_the_final_turn_is_scored_and_a_tool_call_is_not_an_answer(response, expected):
    assert tool_multiply.score(response, "5535") == expected
    assert get_task("tool_multiply").score(response, "5535") == expected
