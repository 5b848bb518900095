"""Reward functions by reference (workbench.data.rewards): found in files and modules, called the
way their signatures ask (verl's compute_score, or response/ground_truth plus row columns),
weighted, with fallbacks; and the ecosystem's scorers (math-verify, reasoning-gym) as built-ins."""

import pickle
import textwrap

import cloudpickle
import pytest
import reasoning_gym

from workbench.data import arithmetic
from workbench.data.rewards import RewardDefinitionError, RewardFunction, RewardSet, load_function

ROW = {"data_source": "gsm8k", "extra_info": {"index": 7}, "prompt": "Q", "uid": "3"}


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        textwrap.dedent(
            """
            import re

            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                return {"score": float(solution_str.strip() == ground_truth), "source": data_source,
                        "index": extra_info["index"]}

            def seen(response, ground_truth, data_source, extra_info):
                return len(data_source) + extra_info["index"]

            def every(response, ground_truth, **row):
                return float(len(row))

            def form(response, ground_truth):
                return 1.0 if re.fullmatch(r"-?\\d+", response.strip()) else 0.0

            def words(response, ground_truth):
                return "many"

            def _private():
                pass
            """
        )
    )
    return path


def test_a_file_reference_loads_and_pickles_by_value(reward_file):
    fn = load_function(f"{reward_file}:form")
    again = pickle.loads(cloudpickle.dumps(fn))  # what a scoring process (or a jail) receives
    assert fn("12", "") == again(" 12 ", "") == 1.0 and again("x", "") == 0.0
    assert load_function("workbench.data.arithmetic:score") is arithmetic.score
    assert load_function("arithmetic") is arithmetic.score  # a registered task's name


def test_each_signature_is_called_its_own_way(reward_file):
    rewards = RewardSet.of([f"{reward_file}:compute_score", f"{reward_file}:seen", f"{reward_file}:every"])
    assert [f.style for f in rewards.functions] == ["verl", "simple", "simple"]
    values, failed = rewards("42", "42", ROW)
    assert values == [1.0, len("gsm8k") + 7, float(len(ROW))] and failed == []
    assert RewardFunction(lambda response, truth: 2).columns == ()


def test_weights_add_up_and_fallbacks_count(reward_file):
    rewards = RewardSet.of(
        [
            {"function": f"{reward_file}:compute_score", "weight": 1.0, "name": "correct"},
            {"function": f"{reward_file}:words", "weight": 0.5, "fallback": -1.0},
        ]
    )
    assert rewards.names == ["correct", "words"]
    values, failed = rewards("7", "7", ROW)
    assert values == [1.0, -1.0] and failed == [1] and rewards.total(values) == 0.5
    strict = RewardSet.of(f"{reward_file}:words")
    with pytest.raises(RuntimeError, match=r"words returned 'many', not a finite number"):
        strict("7", "7", ROW)


@pytest.mark.parametrize(
    ("reference", "words"),
    [
        ("nowhere.py:f", r"no such file 'nowhere.py'"),
        ("{file}:missing", r"has no function 'missing'; its functions: \['compute_score', 'every', 'form'"),
        ("no_such_package.rewards:f", r"cannot import 'no_such_package.rewards'.*give the file instead"),
        ("just_a_name", r"names no function.*built-in: \['arithmetic'"),
    ],
)
def test_a_bad_reference_is_named(reward_file, reference, words):
    with pytest.raises(RewardDefinitionError, match=words):
        load_function(reference.format(file=reward_file))


def test_a_function_that_cannot_be_a_reward_is_refused():
    with pytest.raises(RewardDefinitionError, match=r"takes \(response, ground_truth, \*\*row\)"):
        RewardFunction(lambda response: 1.0)
    with pytest.raises(RewardDefinitionError, match=r"each with its own name"):
        RewardSet.of([arithmetic.score, arithmetic.score])


def test_math_verify_compares_answers_as_mathematics():
    math_verify = load_function("math_verify")
    assert math_verify("The answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert math_verify("so \\boxed{3}", "3") == 1.0 and math_verify("\\boxed{4}", "3") == 0.0


def test_reasoning_gym_rows_are_scored_by_their_own_dataset():
    score = RewardSet.of("reasoning_gym")
    for entry in reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=0):
        row = {"question": entry["question"], "metadata": entry["metadata"]}
        right = f"<answer>{entry['answer']}</answer>"
        assert score(right, str(entry["answer"]), row)[0] == [1.0]
        assert score("<answer>banana</answer>", str(entry["answer"]), row)[0] == [0.0]


def test_verl_scorers_get_only_the_arguments_they_take_and_any_number_counts():
    import numpy as np

    def gsm8k_like(solution_str, ground_truth, method="strict"):  # verl's gsm8k.compute_score
        return np.float32(solution_str == ground_truth)

    def with_kwargs(response, ground_truth, **row):  # never given response/ground_truth again
        return torch_like_zero_d(len(row))

    def torch_like_zero_d(n):
        import torch

        return torch.tensor(float(n))

    rewards = RewardSet.of([gsm8k_like, with_kwargs])
    assert rewards("7", "7", {**ROW, "response": "x", "ground_truth": "y"})[0] == [1.0, float(len(ROW))]
    with pytest.raises(RuntimeError, match="returned '1', not a finite number"):
        RewardSet.of(lambda response, truth: "1")("7", "7", ROW)
    with pytest.raises(RewardDefinitionError, match=r"\['fallbacks'\] name the workbench's own columns"):
        RewardSet.of({"function": arithmetic.score, "name": "fallbacks"})
