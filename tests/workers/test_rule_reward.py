"""Rule rewards run in long-lived scoring processes, fed by Batches or by another group's future."""

import math
import os
import signal
import time
from pathlib import Path

import pytest
import ray
import torch

from tests.controller.workers import EchoWorker
from workbench import Batch, DispatchError, WorkerCallError, WorkerDiedError
from workbench.data import arithmetic
from workbench.workers.rule_reward import RuleReward, restart_dead_scorers, scorer_name

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "tests"


def answers(texts, truths):
    return Batch(
        {"x": torch.arange(len(texts), dtype=torch.float32)},
        {"response_text": texts, "ground_truth": truths, "uid": [f"u{i}" for i in range(len(texts))]},
    )


def test_scores_batches_in_chunks(shared_session):
    batch = answers([" 12", " 7</s>", "13", " 85 and more"], ["12", "8", "13", "85"])
    scores = RuleReward(arithmetic.score, chunk_size=3).compute_reward(batch).get()
    assert scores["scores"].tolist() == [1.0, 0.0, 1.0, 1.0]
    # Named per driver: another driver attached to the cluster has scorers of its own.
    named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert scorer_name(0) in named and ray.get_runtime_context().get_job_id() in scorer_name(0)


def test_takes_another_groups_future_and_drops_its_padding(session):
    group = session.group("g", EchoWorker, session.pool("two", 2))
    batch = answers([" 1", " 2", " 3"], ["1", "0", "3"])
    future = group.double(batch)  # 3 rows on 2 ranks: padded to 4 inside the group
    with_text = RuleReward(lambda text, truth: float(text.strip() == truth), text_key="uid", truth_key="uid")
    assert with_text.compute_reward(future).get()["scores"].tolist() == [1.0, 1.0, 1.0]


def test_errors_name_the_function_and_row(shared_session):
    def explodes(text, truth):
        if text == "bad":
            raise ValueError("cannot parse")
        return 1.0

    with pytest.raises(WorkerCallError, match=r"explodes raised on row uid=u1 .*cannot parse"):
        RuleReward(explodes).compute_reward(answers(["ok", "bad"], ["1", "1"])).get()
    with pytest.raises(WorkerCallError, match=r"on row uid=u0 .*returned nan, not a finite number"):
        RuleReward(lambda t, g: math.nan).compute_reward(answers(["x"], ["1"])).get()
    with pytest.raises(DispatchError, match=r"no column\(s\) \['response_text'\]"):
        RuleReward(arithmetic.score).compute_reward(Batch({"x": torch.zeros(2)}, {"ground_truth": ["1", "2"]}))


def test_a_hanging_function_times_out(shared_session):
    def hangs(text, truth):
        time.sleep(60)
        return 0.0

    start = time.monotonic()
    with pytest.raises(WorkerCallError, match=r"took more than 1.0 s"):
        RuleReward(hangs, timeout=1.0).compute_reward(answers(["x"], ["1"])).get()
    assert time.monotonic() - start < 20


def test_a_function_that_swallows_exceptions_and_ignores_signals_is_still_stopped(shared_session):
    def stubborn(text, truth):
        signal.signal(signal.SIGALRM, signal.SIG_IGN)  # no alarm can reach it
        if text == "slow":
            while True:
                try:
                    time.sleep(60)
                except Exception:  # swallows anything raised to interrupt it
                    pass
        return 1.0

    reward = RuleReward(stubborn, timeout=2.0)
    before = dict(reward.process_ids())
    start = time.monotonic()
    with pytest.raises(WorkerCallError, match=r"took more than 2.0 s .* killed on row uid=u1 \(response 'slow'\)"):
        reward.compute_reward(answers(["ok", "slow", "ok"], ["1", "1", "1"])).get()
    assert time.monotonic() - start < 30
    # The next call runs: the scorer (same process) replaced only the killed child.
    assert reward.compute_reward(answers(["ok"], ["1"])).get()["scores"].tolist() == [1.0]
    after = dict(reward.process_ids())
    assert set(after) == set(before)
    assert any(after[pid] != before[pid] for pid in before)


def test_a_function_that_kills_its_process_is_reported_and_replaced(shared_session):
    def exits(text, truth):
        if text == "boom":
            import os

            os._exit(3)
        return 0.5

    reward = RuleReward(exits, processes=1)
    with pytest.raises(WorkerCallError, match=r"ended its process \(exit code 3\) on row uid=u0"):
        reward.compute_reward(answers(["boom"], ["1"])).get()
    assert reward.compute_reward(answers(["fine"], ["1"])).get()["scores"].tolist() == [0.5]


def test_a_scorer_whose_process_died_is_named_then_replaced(shared_session):
    """The scorer actor itself killed (as on a host that was lost): the call names it dead;
    restart_dead_scorers (the runner's recovery) starts another under its name."""
    reward = RuleReward(lambda text, truth: 0.25, processes=1)
    assert reward.compute_reward(answers(["a"], ["1"])).get()["scores"].tolist() == [0.25]
    [(scorer, _)] = reward.process_ids()
    os.kill(scorer, signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match=r"role 'rule_reward' died .*restart_dead_scorers\(\) starts another"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until Ray has seen it go
            reward.compute_reward(answers(["a"], ["1"])).get()
            time.sleep(0.2)
    assert restart_dead_scorers() == 1
    assert reward.compute_reward(answers(["a"], ["1"])).get()["scores"].tolist() == [0.25]
    assert [pid for pid, _ in reward.process_ids()] != [scorer]


def test_a_jailed_reward_scores_and_is_stopped_like_a_tool(shared_session):
    """RuleReward(sandbox=...): the function runs in the tool jail (workbench.agents), its
    scores come back as data, and what it must not do is stopped and named."""
    from workbench.agents import SandboxLimits

    readme = str(CACHE.parents[1] / "README.md")
    driver = os.getpid()

    def hostile(text, truth):
        import ctypes

        if text == "read":
            return float(len(open(readme).read()))
        if text == "kill":
            if ctypes.CDLL(None).kill(driver, 9) != 0:
                raise ProcessLookupError(f"pid {driver}")
        if text == "hang":
            time.sleep(60)
        return float(len(text) + (truth == "1"))

    reward = RuleReward(hostile, sandbox=SandboxLimits(seconds=2), processes=1)
    assert reward.compute_reward(answers(["ab", "abc"], ["1", "0"])).get()["scores"].tolist() == [3.0, 3.0]
    for text, words in [
        ("read", "raised on row uid=u1 .*FileNotFoundError"),
        ("kill", "raised on row uid=u1 .*ProcessLookupError"),
        ("hang", "took more than 2 s.* on a chunk of 2 rows .*jail"),
    ]:
        with pytest.raises(WorkerCallError, match=words):
            reward.compute_reward(answers(["ok", text], ["1", "1"])).get()
        assert reward.compute_reward(answers(["ok"], ["0"])).get()["scores"].tolist() == [2.0]
    with pytest.raises(WorkerCallError, match=r"on row uid=u0 .*returned nan, not a finite number"):
        RuleReward(lambda t, g: math.nan, sandbox=SandboxLimits()).compute_reward(answers(["x"], ["1"])).get()
    # With a fallback, a chunk out of time scores it (a function the jail cannot run would not)
    patient = RuleReward({"function": hostile, "fallback": -1.0}, sandbox=SandboxLimits(seconds=2), processes=1)
    scored = patient.compute_reward(answers(["ok", "hang"], ["1", "1"])).get()
    assert scored["scores"].tolist() == [-1.0, -1.0] and scored["reward/fallbacks"].tolist() == [1.0, 1.0]


def scorer_pid(text, truth):
    import os

    return float(os.getpid())


def test_iterations_are_scored_by_the_same_processes(session):
    """No process churn: the second iteration is scored by the very processes of the first
    (the reward returns the pid of the process that ran it)."""
    from algorithms import GRPO, Groups, GRPOConfig
    from workbench.data.prompts import tokenize_prompts
    from workbench.engines.rollout import SamplingConfig
    from workbench.models import load, make_tiny
    from workbench.workers import ActorConfig, ActorRolloutRefWorker

    model_dir = make_tiny("1m", CACHE / "tiny-1m")
    tokenizer = load(model_dir).tokenizer
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 4, seed=0)
    prompts = tokenize_prompts([p.__dict__ for p in problems], tokenizer, max_prompt_length=16)
    actor = session.group(
        "actor",
        ActorRolloutRefWorker,
        session.pool("actor_pool", 1),
        ActorConfig(model_path=str(model_dir), mini_batch_size=8, micro_batch_size=8),
    )
    reward = RuleReward(scorer_pid, chunk_size=2)
    since = time.time()  # the session is shared: earlier tests' spans are in its trace too
    grpo = GRPO(
        Groups(actor=actor, reward=reward), GRPOConfig(sampling=SamplingConfig(max_new_tokens=4, n=2), kl_loss_coef=0.0)
    )
    scored_by = [set(grpo.step(prompts)[0]["scores"].long().tolist()) for _ in range(2)]
    assert scored_by[0] == scored_by[1]
    assert scored_by[0] <= {child for _, child in reward.process_ids()}

    # The scoring shows in the trace, under the iteration and step that launched it.
    trace = [r for r in session.trace() if r.start >= since]
    spans = [r for r in trace if r.pool == "rule_reward" and r.extra.get("step") == "reward"]
    generations = [r for r in trace if r.method == "generate_sequences" and r.extra.get("step") == "gen"]
    assert sorted(r.extra["iteration"] for r in spans) == sorted(r.extra["iteration"] for r in generations)
    assert len(spans) == 2
    assert {r.pid for r in spans} <= {scorer for scorer, _ in reward.process_ids()}
    assert all(r.ok and r.extra["rows"] == 4 * 2 and r.start <= r.fetched <= r.end for r in spans)


def test_scoring_spans_carry_their_call_tags_and_failures(session):
    from workbench.tracing import tags

    since = time.time()
    with tags(step="probe"):
        RuleReward(arithmetic.score, processes=2).compute_reward(answers([" 1", " 2", " 3"], ["1", "2", "4"])).get()
    with tags(step="broken"), pytest.raises(WorkerCallError):
        RuleReward(lambda t, g: math.nan).compute_reward(answers(["x"], ["1"])).get()
    spans = [r for r in session.trace() if r.pool == "rule_reward" and r.start >= since]
    assert [(r.extra["step"], r.ok, r.extra["rows"]) for r in spans] == [("probe", True, 3), ("broken", False, 1)]
    assert spans[0].bytes_in > 0 and spans[0].bytes_out == 3 * 4  # three float32 scores
