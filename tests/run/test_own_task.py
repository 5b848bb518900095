"""A researcher's own task, headless: verl's Parquet as it is, reward functions from a file by
path (verl's compute_score and the simple signature, weighted, each its own metric), a reward
that fails scored by its fallback while the run goes on (or stopped with its row named), and a
cost of one's own under Safe-RLHF."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from workbench.data import arithmetic
from workbench.data.tasks import TASKS, Task, register_task
from workbench.models import make_tiny
from workbench.run.config import load_config
from workbench.run.faults import RewardFunctionError
from workbench.run.runner import Runner

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {
    "iterations": 1,
    "data": {"loader": {"batch_size": 4, "max_prompt_length": 160}, "reward_timeout": 5},
    "sampling": {"n": 2, "max_new_tokens": 4, "seed": 0},
    "actor": {"mini_batch_size": 8, "micro_batch_size": 8, "optim": {"lr": 1e-3}},
    "critic": {"mini_batch_size": 8, "micro_batch_size": 8},
    "logging": {"progress": False, "tensorboard": False, "rollouts_every": 1, "rollout_rows": 0},
    "evaluation": {"every": 1, "at_start": False},
    "checkpoint": {"every": 0},
    "faults": {"max_recoveries": 0},
}


def verl_rows(count: int, split: str) -> list[dict]:
    """Rows as verl's data preprocessing writes them: a chat prompt, the answer nested in
    reward_model, and extra_info."""
    rows = []
    for index, problem in enumerate(arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), count, seed=7)):
        question = problem.prompt.removeprefix("Q: ").removesuffix(" A:")
        rows.append(
            {
                "data_source": "test/verl-arithmetic",
                "prompt": [{"role": "user", "content": f"What is {question}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": problem.ground_truth},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A chat model, verl-format train and test Parquet files, and a file of reward functions
    that note every row they are called with."""
    root = tmp_path_factory.mktemp("own-task")
    for split, count in (("train", 16), ("test", 4)):
        pq.write_table(pa.Table.from_pylist(verl_rows(count, split)), root / f"{split}.parquet")
    (root / "seen").mkdir()
    (root / "rewards.py").write_text(
        textwrap.dedent(
            f"""
            import json, os, re, time

            SEEN = {str(root / "seen")!r}

            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                with open(os.path.join(SEEN, f"{{os.getpid()}}.jsonl"), "a") as f:
                    f.write(json.dumps({{"data_source": data_source, "extra_info": extra_info}}) + "\\n")
                return float(solution_str.strip() == ground_truth)

            def form(response, ground_truth):
                return float(len(response) % 3) / 2

            def flaky(response, ground_truth, extra_info):
                index = extra_info["index"]
                if extra_info["split"] == "test" and not os.path.exists(os.path.join(SEEN, "hung")):
                    open(os.path.join(SEEN, "hung"), "w").close()
                    time.sleep(60)
                if index % 4 == 0:
                    raise ValueError(f"cannot judge row {{index}}")
                if index % 4 == 1:
                    return "many"
                return 1.0

            def words(response, ground_truth):
                return "many"

            def unsafe(response, ground_truth):
                return float(len(response)) - 2.0
            """
        )
    )
    return root, make_tiny("1m", root / "tiny-chat", seed=0, chat=True)


def config_file(root: Path, model: Path, out: Path, **sections) -> Path:
    values = json.loads(json.dumps(SETTINGS))  # a deep copy
    values |= {"model": {"path": str(model)}, "logging": {**values["logging"], "output_dir": str(out)}}
    for key, value in sections.items():
        values[key] = {**values.get(key, {}), **value} if isinstance(value, dict) else value
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(values))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_verl_parquet_and_a_reward_file_run_headless(task, tmp_path):
    """`python -m workbench run` on verl's files with no column mapping, two weighted rewards
    from a file given by path: data_source and extra_info reach compute_score, each reward is
    its own metric, the score is their weighted sum, and the rollout log keeps the columns."""
    root, model = task
    data = {
        **SETTINGS["data"],
        "train_file": str(root / "train.parquet"),
        "eval_file": str(root / "test.parquet"),
        "rewards": [
            {"function": f"{root / 'rewards.py'}:compute_score", "name": "correct"},
            {"function": f"{root / 'rewards.py'}:form", "weight": 0.5},
        ],
    }
    out = tmp_path / "run"
    path = config_file(root, model, out, data=data, algorithm={"name": "grpo"})
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, as a user's shell
    done = subprocess.run(
        [sys.executable, "-m", "workbench", "run", str(path)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]

    seen = [row for f in (root / "seen").glob("*.jsonl") for row in read_jsonl(f)]
    assert len(seen) == 4 * 2 + 4  # one iteration of 4 prompts x 2 samples, then 4 held out
    assert {row["data_source"] for row in seen} == {"test/verl-arithmetic"}
    assert {row["extra_info"]["split"] for row in seen} == {"train", "test"}
    assert all(isinstance(row["extra_info"]["index"], int) for row in seen)

    metrics = read_jsonl(out / "metrics.jsonl")
    trained = next(m for m in metrics if "critic/score/mean" in m)
    correct, form = trained["reward/correct/mean"], trained["reward/form/mean"]
    assert trained["critic/score/mean"] == pytest.approx(correct + 0.5 * form, abs=1e-6)
    assert any("eval/reward/correct" in m for m in metrics)
    rollouts = read_jsonl(out / "rollouts.jsonl")
    assert len(rollouts) == 8
    for row in rollouts:
        assert row["data_source"] == "test/verl-arithmetic" and row["extra_info"]["split"] == "train"
        assert row["reward/correct"] == float(row["response"].strip() == row["ground_truth"])
        assert row["score"] == pytest.approx(
            float(row["response"].strip() == row["ground_truth"]) + 0.5 * (len(row["response"]) % 3) / 2, abs=1e-6
        )


def in_process(task, out: Path, shared_session, **sections):
    root, model = task
    return Runner(load_config(config_file(root, model, out, **sections)), session=shared_session)


def test_a_failing_reward_falls_back_and_the_run_goes_on(task, tmp_path, shared_session):
    """A function that raises or returns a word scores its fallback on those rows, counted in
    reward/fallbacks; one that hangs past the time limit (on the first held-out row) has that
    row score the fallbacks, and the rest of its chunk is scored. The run goes on."""
    root, _ = task
    data = {
        **SETTINGS["data"],
        "train_file": str(root / "train.parquet"),
        "eval_file": str(root / "test.parquet"),
        "reward_timeout": 3,
        "rewards": [
            {"function": f"{root / 'rewards.py'}:compute_score", "name": "correct", "fallback": 0.0},
            {"function": f"{root / 'rewards.py'}:flaky", "fallback": -1.0},
        ],
    }
    out = tmp_path / "run"
    result = in_process(task, out, shared_session, data=data, algorithm={"name": "grpo"}).run()
    assert result.iterations == 1
    rows = read_jsonl(out / "rollouts.jsonl")
    failing = [row["extra_info"]["index"] % 4 < 2 for row in rows]  # flaky raises or returns a word
    for row, fails in zip(rows, failing):
        correct = float(row["response"].strip() == row["ground_truth"])
        assert row["score"] == pytest.approx(correct + (-1.0 if fails else 1.0))
    trained = next(m for m in result.history if "critic/score/mean" in m)
    assert trained["reward/fallbacks"] == sum(failing)
    # The first held-out row hangs: both functions fall back on it, and the rows after it are scored
    # in a fresh process (test.parquet's rows 0..3: flaky fails on index 1 too).
    assert result.evaluations[-1]["eval/reward/fallbacks"] == 3.0


def test_a_reward_that_returns_no_number_stops_naming_the_row(task, tmp_path, shared_session):
    root, _ = task
    data = {
        **SETTINGS["data"],
        "train_file": str(root / "train.parquet"),
        "eval_fraction": 0.25,
        "rewards": [f"{root / 'rewards.py'}:words"],
    }
    with pytest.raises(RewardFunctionError) as error:
        in_process(task, tmp_path / "run", shared_session, data=data, algorithm={"name": "grpo"}).run()
    assert "words returned 'many', not a finite number" in str(error.value) and "on row uid=" in str(error.value)


def own_cost(response: str) -> float:
    return float(len(response)) - 2.0


@pytest.fixture
def cost_task():
    register_task(Task("own_cost_task", arithmetic.score, cost=own_cost))
    yield "own_cost_task"
    TASKS.pop("own_cost_task")


@pytest.mark.parametrize("given", ["file", "task"])
def test_a_cost_of_ones_own_under_safe_rlhf(task, tmp_path, shared_session, cost_task, given):
    """Safe-RLHF's cost from a file (data.cost_function), or from a task registered in this
    process (its function travels to the scoring process; it is not looked up there by name)."""
    root, _ = task
    data = {**SETTINGS["data"], "train_file": str(root / "train.parquet"), "eval_fraction": 0.25}
    data |= {"cost_function": f"{root / 'rewards.py'}:unsafe"} if given == "file" else {"task": cost_task}
    result = in_process(task, tmp_path / "run", shared_session, data=data, algorithm={"name": "safe_rlhf"}).run()
    assert result.iterations == 1
    for row in read_jsonl(tmp_path / "run" / "rollouts.jsonl"):
        assert row["cost"] == pytest.approx(len(row["response"]) - 2.0)


def test_reasoning_gym_prompts_come_with_their_scorer():
    """data.source=reasoning_gym: the dataset's questions as chat prompts, none held out and
    trained on both, scored by the dataset's own scorer."""
    from workbench.run import build

    config = load_config(
        None,
        [
            "data.source=reasoning_gym",
            "data.name=basic_arithmetic",
            "data.options={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
            "data.train_size=40",
            "data.eval_size=10",
            "data.system_prompt=Answer inside <answer></answer>.",
        ],
    )
    train, held_out = build.prompt_rows(config)
    assert len(held_out) == 10 and 0 < len(train) <= 40
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    assert train[0]["prompt"][0] == {"role": "system", "content": "Answer inside <answer></answer>."}
    rewards = build.rewards(config)
    assert rewards.names == ["reasoning_gym"]
    row = held_out[0]
    assert rewards(f"<answer>{row['ground_truth']}</answer>", row["ground_truth"], row)[0] == [1.0]


@pytest.mark.parametrize(
    ("overrides", "where", "words"),
    [
        (["data.train_file=t.jsonl"], "data.eval_file", "data.eval_file, or hold out .* data.eval_fraction=0.1"),
        (["data.columns={question: q}"], "data.columns.question", "map prompt and ground_truth"),
        (["data.source=reasoning_gym"], "data.name", "name the reasoning-gym dataset"),
        (["data.rewards=[nowhere.py:f]"], "data.rewards", "no such file 'nowhere.py'"),
        (["data.rewards=[{function: arithmetic, weight: .nan}]"], "data.rewards", "not a finite number"),
        (["data.environment=skyrl:gsm8k", "data.rewards=[arithmetic]"], "data.environment", "scores its own"),
        (["data.source=reasoning_gym", "data.name=chain_sum", "data.eval_fraction=0.1"], "data.source", "drop"),
        (["data.cost_function=arithmetic", "algorithm.name=grpo"], "data.cost_function", "grpo has no cost"),
        (["data.judge.template=no placeholder"], "data.judge.template", "never see the response"),
    ],
)
def test_a_task_that_cannot_run_is_refused_before_any_work(overrides, where, words):
    from workbench.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        Runner(load_config(None, overrides))
    assert error.value.where == where and re.search(words, str(error.value))


def test_an_llm_judge_scores_beside_a_rule(task, tmp_path, shared_session):
    """data.judge: a chat model in the actor's processes reads each response through a rubric;
    its verdict is the score, the rule beside it (weight 0) is measured but not rewarded."""
    root, _ = task
    data = {
        **SETTINGS["data"],
        "train_file": str(root / "train.parquet"),
        "eval_file": str(root / "test.parquet"),
        "judge": {
            "template": "Q: {prompt}\nA: {response}\nCorrect? yes or no.",
            "fallback": 0.5,
            "max_prompt_length": 256,
            "max_new_tokens": 4,
        },
        "rewards": [{"function": f"{root / 'rewards.py'}:form", "weight": 0.0}],
    }
    out = tmp_path / "run"
    result = in_process(task, out, shared_session, data=data, algorithm={"name": "grpo"}).run()
    trained = next(m for m in result.history if "critic/score/mean" in m)
    assert trained["critic/score/mean"] == pytest.approx(trained["reward/judge/mean"])
    assert "eval/reward/judge" in result.evaluations[-1] and "eval/reward/form" in result.evaluations[-1]
    rows = read_jsonl(out / "rollouts.jsonl")
    for row in rows:  # the rule beside the judge is measured, unweighted
        assert row["reward/form"] == (len(row["response"]) % 3) / 2
    assert trained["reward/form/mean"] == pytest.approx(sum(row["reward/form"] for row in rows) / len(rows))
    for row in rows:  # every verdict is yes, no or the fallback, and the log says which
        verdict = row["judge_verdict"].lower()
        expected = 1.0 if re.search(r"\byes\b", verdict) else 0.0 if re.search(r"\bno\b", verdict) else 0.5
        if re.search(r"\byes\b", verdict) and re.search(r"\bno\b", verdict):
            continue  # the first of the two decides
        assert row["score"] == pytest.approx(expected)
    assert trained["reward/fallbacks"] == sum(1.0 for row in rows if row["score"] == 0.5)


def test_an_ecosystem_environment_runs_episodes_headless(task, tmp_path, shared_session):
    """data.environment: skyrl-gym's gsm8k_multi_turn, unchanged, turn by turn in the tool jail,
    on verl's Parquet rows; the episodes train and are evaluated as episodes."""
    root, _ = task
    data = {
        **SETTINGS["data"],
        "train_file": str(root / "train.parquet"),
        "eval_file": str(root / "test.parquet"),
        "environment": "skyrl:gsm8k_multi_turn",
        "environment_options": {"max_turns": 2},
    }
    algorithm = {"name": "grpo", "episode": {"max_turns": 2, "turn_tokens": 4}}
    out = tmp_path / "run"
    result = in_process(task, out, shared_session, data=data, algorithm=algorithm).run()
    trained = next(m for m in result.history if "critic/score/mean" in m)
    assert 1 <= trained["episode/turns/min"] <= trained["episode/turns/max"] <= 2
    assert trained["episode/tool_calls"] >= 1  # each environment step counts as one
    assert "eval/score" in result.evaluations[-1]
