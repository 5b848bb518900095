"""Built-in tools: plain functions of text arguments that return text, run in a Sandbox.

    calculator("123 * 45")             -> "5535"
    python("print(sum(range(10)))")    -> "45"

They are sent to the sandbox by value (the sandbox never imports the workbench: no torch there),
so they use the standard library only. A tool of your own is any such function, e.g. one
defined in a notebook cell, given to a ToolBox under a name.
"""

from __future__ import annotations

import sys

import cloudpickle

MAX_DIGITS = 4000
"""Results longer than this many digits are refused (2**10**10 would hold the sandbox for hours)."""
MAX_OUTPUT = 2000
"""Characters of printed output the python tool returns (the rest is cut, and says so)."""


def calculator(expression: str) -> str:
    """Arithmetic on numbers: + - * / // % ** and parentheses. Nothing is evaluated as code:
    the expression is parsed and only those operations are computed."""
    import ast
    import operator

    binary = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod,
        ast.Pow: operator.pow,
    }
    unary = {ast.USub: operator.neg, ast.UAdd: operator.pos}

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in unary:
            return unary[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in binary:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) * max(len(str(abs(int(left)))), 1) > MAX_DIGITS:
                raise ValueError(f"the power is too large (more than {MAX_DIGITS} digits)")
            return binary[type(node.op)](left, right)
        raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")

    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("give an arithmetic expression as text, e.g. '123 * 45'")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    result = value(tree)
    if isinstance(result, float) and result.is_integer() and abs(result) < 2**53:
        result = int(result)
    return str(result)


def python(code: str) -> str:
    """Run Python source; what it prints is the answer (the sandbox's limits apply: no network,
    no processes, writes only in its scratch directory). Given the policy's code in RL, use
    SandboxLimits(calls_per_process=1): calls sharing a process are not independent."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<tool>", "exec"), {"__name__": "__tool__"})
    text = out.getvalue()
    return text if len(text) <= MAX_OUTPUT else text[:MAX_OUTPUT] + f"\n... ({len(text) - MAX_OUTPUT} more characters)"


def score_rows(fn_bytes: bytes, texts: list[str], truths: list[str], rows: list[dict]) -> dict:
    """Reward functions run as a tool (RuleReward(sandbox=...)): fn_bytes is a pickled
    workbench.data.rewards.RewardSet. {"values": [[...] per row], "failed": [[...] per row]},
    or the first row that failed: {"row": i, "raised": text}."""
    import pickle
    import traceback

    rewards = pickle.loads(fn_bytes)
    values, failed = [], []
    for row, (text, truth, columns) in enumerate(zip(texts, truths, rows)):
        try:
            scored, fell_back = rewards(text, truth, columns)
        except Exception as err:
            return {"row": row, "raised": f"{err}\n{traceback.format_exc(limit=-3)}"[-2000:]}
        values.append(scored)
        failed.append(fell_back)
    return {"values": values, "failed": failed}


# Sent by value: the sandbox imports only the standard library and cloudpickle.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
