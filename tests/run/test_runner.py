"""The headless runner end to end on real worker groups (the shared Ray session): every output
written and readable, two runs from scratch bit-identical, a worker killed mid-run recovered
from the last checkpoint with the failed iteration redone, and a reward function that raises
or hangs reported with its row (and retried when asked)."""

import json
import os
import shutil
import signal
import time

import psutil
import pytest
import ray

import tests.run.rewards
from tests.run.rewards import FailFirst
from widgets.compare import RunComparison
from workbench.data.tasks import TASKS, Task, register_task
from workbench.models import make_tiny
from workbench.run.config import load_config
from workbench.run.faults import RewardFunctionError
from workbench.run.runner import Runner
from workbench.tracing import load_records

ray.cloudpickle.register_pickle_by_value(tests.run.rewards)

ITERATIONS = 3
VOLATILE = ("timing_s/", "perf/", "run/")  # wall-clock figures, and the run's own fault counters


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("1m", tmp_path_factory.mktemp("run-kit") / "tiny-1m", seed=0)


def tiny_config(tiny, out, *overrides, algorithm="ppo"):
    """4 prompts x 2 samples x 4 tokens, one optimizer step per iteration, everything logged."""
    return load_config(
        None,
        [
            f"model.path={tiny}",
            f"logging.output_dir={out}",
            f"iterations={ITERATIONS}",
            f"algorithm.name={algorithm}",
            "data.train_size=32",
            "data.eval_size=8",
            "data.loader.batch_size=4",
            "sampling.n=2",
            "sampling.max_new_tokens=4",
            "sampling.seed=0",
            "actor.mini_batch_size=8",
            "actor.micro_batch_size=8",
            "critic.mini_batch_size=8",
            "critic.micro_batch_size=8",
            "actor.optim.lr=1e-3",
            "critic.optim.lr=1e-3",
            "logging.progress=false",
            "logging.rollouts_every=1",
            "logging.rollout_rows=0",
            "evaluation.every=2",
            "checkpoint.every=1",
            "faults.max_recoveries=1",
            *overrides,
        ],
    )


def steady(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(tiny, tmp_path_factory, shared_session):
    out = tmp_path_factory.mktemp("first")
    result = Runner(tiny_config(tiny, out, "checkpoint.export_hf=true"), session=shared_session).run()
    return out, result


def test_run_writes_every_output(first_run, tiny):
    out, result = first_run
    assert result.iterations == ITERATIONS and result.recoveries == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]  # held-out evaluation at the start, then each iteration
    assert set(rows[0]) == {"iteration", "eval/score", "timing_s/eval", "run/elapsed_s"}
    for row in rows[1:]:
        assert {"critic/score/mean", "actor/pg_loss", "critic/vf_loss", "run/recoveries", "run/redone"} <= set(row)
    assert "eval/score" in rows[2] and "eval/score" in rows[3] and "eval/score" not in rows[1]  # every 2, and the last

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert "actor/pg_loss" in events.Tags()["scalars"]
    scalars = events.Scalars("actor/pg_loss")
    assert [s.step for s in scalars] == [1, 2, 3]
    assert [s.value for s in scalars] == pytest.approx([r["actor/pg_loss"] for r in rows[1:]], rel=1e-6)

    rollouts = read_jsonl(out / "rollouts.jsonl")
    assert [r["iteration"] for r in rollouts] == [1] * 8 + [2] * 8 + [3] * 8  # 4 prompts x 2 samples each
    for row in rollouts:
        assert row["prompt"].startswith("Q: ") and row["prompt"].endswith("A:")
        assert isinstance(row["response"], str) and row["score"] in (0.0, 1.0)
        assert len(row["tokens"]) == len(row["advantages"]) == len(row["returns"]) >= 1
        assert row["ground_truth"] == str(eval(row["prompt"][3:-5]))  # "Q: 3+4=? A:"
    assert any(a != 0 for row in rollouts for a in row["advantages"])

    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert {"generate_sequences", "update_actor", "update_critic"} <= {n.split(".")[-1] for n in names}
    from workbench.tracing import load_records

    assert {r.role for r in load_records(out / "trace.jsonl")} == {"actor", "critic", "rule_reward"}
    assert (out / "checkpoints" / "latest").exists() and (out / "config.yaml").exists()
    assert load_config(out / "config.yaml") == tiny_config(tiny, out, "checkpoint.export_hf=true")  # reproducible
    from transformers import AutoModelForCausalLM

    assert result.files["hf_actor"] == out / "hf" / "actor" and "hf_critic" in result.files
    AutoModelForCausalLM.from_pretrained(result.files["hf_actor"])  # plain transformers loads the trained actor


def test_two_runs_from_scratch_are_bit_identical(first_run, tiny, tmp_path, shared_session):
    """The second run keeps its reference's weights in host memory (FSDP2 shards, offloaded):
    the same forwards on the same weights, so the same run."""
    out, first = first_run
    Runner(tiny_config(tiny, tmp_path, "actor.reference_keep=host"), session=shared_session).run()
    a, b = read_jsonl(out / "metrics.jsonl"), read_jsonl(tmp_path / "metrics.jsonl")
    assert [steady(r) for r in a] == [steady(r) for r in b]
    assert read_jsonl(out / "rollouts.jsonl") == read_jsonl(tmp_path / "rollouts.jsonl")


def kill_last_process_of(role: str, session) -> int:
    """SIGKILL the process of `role` that recorded the latest span; its pid once it is gone."""
    pid = next(r.pid for r in reversed(session.trace()) if r.role == role)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pid


def test_killed_worker_is_recovered_and_the_iteration_redone(first_run, tiny, tmp_path, shared_session):
    killed = []

    def kill_critic_after(iteration):
        def callback(algorithm, batch, metrics):
            if metrics["iteration"] == iteration and not killed:
                killed.append(kill_last_process_of("critic", shared_session))

        return callback

    runner = Runner(tiny_config(tiny, tmp_path), session=shared_session, callbacks=[kill_critic_after(2)])
    result = runner.run()
    assert killed and result.iterations == ITERATIONS and result.recoveries == 1
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "actor/pg_loss" in r]
    assert [(r["iteration"], r["run/redone"], r["run/recoveries"]) for r in rows] == [(1, 0, 0), (2, 0, 0), (3, 1, 1)]
    # Restored from the checkpoint after iteration 2, the redone iteration is the uninterrupted one.
    uninterrupted = [r for r in read_jsonl(first_run[0] / "metrics.jsonl") if "actor/pg_loss" in r]
    assert [steady(r) for r in rows] == [steady(r) for r in uninterrupted]


def test_resume_continues_from_the_latest_checkpoint(first_run, tiny, tmp_path, shared_session):
    """A run cut short after iteration 2 (its step-3 checkpoint never written) and resumed with
    checkpoint.resume=true redoes iteration 3 exactly as the uninterrupted run did."""
    out = tmp_path / "resumed"
    shutil.copytree(first_run[0], out)
    shutil.rmtree(out / "checkpoints" / "step-000003")
    (out / "checkpoints" / "latest").write_text("step-000002\n")
    result = Runner(tiny_config(tiny, out, "checkpoint.resume=true"), session=shared_session).run()
    assert result.iterations == ITERATIONS
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "actor/pg_loss" in r]
    assert [(r["iteration"], r["run/redone"]) for r in rows] == [(1, 0), (2, 0), (3, 0), (3, 1)]  # appended
    assert steady(rows[-1]) == steady(rows[2])

    # The two runs overlaid: each iteration once (the resumed run's 3: its redo), by iteration
    # or by seconds since the start; their configs differ in where they wrote and in resuming.
    compare = RunComparison({"uninterrupted": first_run[0], "resumed": out})
    points = compare.aligned()
    assert [x for x, _ in points["uninterrupted"]] == [x for x, _ in points["resumed"]] == [0, 1, 2, 3]
    assert points["resumed"][3][1]["run/redone"] == 1
    assert [steady(m) for _, m in points["resumed"]] == [steady(m) for _, m in points["uninterrupted"]]
    losses = compare.data()["losses"]["actor/pg_loss"]
    assert losses["resumed"] == losses["uninterrupted"] == ([1, 2, 3], [r["actor/pg_loss"] for r in rows[:3]])
    assert set(compare.config_diff()) == {"checkpoint.resume", "logging.output_dir", "checkpoint.export_hf"}
    assert compare.config_diff()["checkpoint.resume"] == {"uninterrupted": False, "resumed": True}
    compare.set(align="time")
    seconds = {name: [x for x, _ in points] for name, points in compare.aligned().items()}
    assert all(s == sorted(s) for s in seconds.values()), seconds
    assert seconds["uninterrupted"][-1] == read_jsonl(first_run[0] / "metrics.jsonl")[-1]["run/elapsed_s"] > 0
    # The resumed run's clock started again at 0: its redo comes after the first process's time.
    assert seconds["resumed"][-1] == pytest.approx(seconds["uninterrupted"][-1] + rows[-1]["run/elapsed_s"])


def test_dead_worker_beyond_the_recovery_budget_stops_the_run(tiny, tmp_path, shared_session):
    def kill_actor(algorithm, batch, metrics):
        pid = next(r.pid for r in reversed(shared_session.trace()) if r.role == "actor")
        os.kill(pid, signal.SIGKILL)

    config = tiny_config(tiny, tmp_path, "faults.max_recoveries=0", "iterations=2", algorithm="grpo")
    with pytest.raises(Exception, match=r"iteration 2: the worker group 'actor' died .*faults\.max_recoveries"):
        Runner(config, session=shared_session, callbacks=[kill_actor]).run()


@pytest.fixture
def failing_task(tmp_path):
    """Registers a task whose reward fails its first calls as told; removed afterwards."""
    names = []

    def register(*failures):
        names.append(f"fail_first_{len(names)}")
        register_task(Task(names[-1], FailFirst(str(tmp_path), failures)))
        return names[-1]

    yield register
    for name in names:
        TASKS.pop(name, None)


def test_reward_that_raises_names_the_row_and_stops(tiny, tmp_path, shared_session, failing_task):
    config = tiny_config(
        tiny,
        tmp_path / "out",
        f"data.task={failing_task('raise')}",
        "faults.reward_retries=0",
        "evaluation.every=0",
        "iterations=1",
        algorithm="grpo",
    )
    with pytest.raises(RewardFunctionError) as error:
        Runner(config, session=shared_session).run()
    message = str(error.value)
    assert message.startswith("iteration 1: the reward function fail_first[raise] failed: ")
    assert "raised on row uid=" in message and "(response " in message and "cannot judge" in message
    assert "faults.reward_retries" in message


def test_reward_that_raises_then_hangs_is_retried_and_the_run_goes_on(tiny, tmp_path, shared_session, failing_task):
    config = tiny_config(
        tiny,
        tmp_path / "out",
        f"data.task={failing_task('raise', 'hang')}",
        "faults.reward_retries=2",
        "data.reward_timeout=3",
        "iterations=2",
        "evaluation.every=0",
        algorithm="grpo",
    )
    result = Runner(config, session=shared_session).run()  # the hang is cut at 3 s (else pytest's timeout)
    assert result.iterations == 2 and result.reward_retries == 2
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [(r["iteration"], r["run/reward_retries"]) for r in rows] == [(1, 2.0), (2, 2.0)]


ASYNC = (
    "asynchronous.enabled=true",
    "asynchronous.max_staleness=1",
    "placement.rollout_devices=1",
    "evaluation.every=0",
)


def trained_rows(out):
    return [r for r in read_jsonl(out / "metrics.jsonl") if "actor/pg_loss" in r]


@pytest.fixture(scope="module")
def async_run(tiny, tmp_path_factory, shared_session):
    """An uninterrupted asynchronous PPO run (the critic on a pool of its own): its directory."""
    out = tmp_path_factory.mktemp("async") / "straight"
    Runner(tiny_config(tiny, out, *ASYNC), session=shared_session).run()
    return out


def test_an_asynchronous_run_resumes_mid_pipeline_as_it_ran(tiny, tmp_path, shared_session, async_run):
    """asynchronous.enabled: a rollout group of its own generates one batch ahead; the
    checkpoint after iteration 2 holds the batch launched ahead, and a resume from it redoes
    iteration 3 exactly."""
    out = tmp_path / "async"
    shutil.copytree(async_run, out)
    rows = trained_rows(out)
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]  # the first batch has nothing before it
    assert {r.role for r in load_records(out / "trace.jsonl")} >= {"actor", "rollout", "critic"}
    shutil.rmtree(out / "checkpoints" / "step-000003")
    (out / "checkpoints" / "latest").write_text("step-000002\n")
    resumed = tiny_config(tiny, out, *ASYNC, "checkpoint.resume=true")
    Runner(resumed, session=shared_session).run()
    again = trained_rows(out)
    assert steady(again[-1]) == steady(rows[2]) and again[-1]["async/staleness_max"] == 1.0


def test_a_critic_beside_the_rollout_scores_before_the_next_generation(tiny, tmp_path, shared_session, async_run):
    """placement.critic_beside=rollout: the critic lives in the rollout group's processes (two
    devices for PPO's four models). Where the critic runs does not change a number: the run
    equals the one with a critic pool of its own. The batches ahead are launched after the
    step's scoring calls, so the critic's values of batch k come before the generation of batch
    k+1 in their shared process, and the critic trains while the actor does."""
    out = tmp_path / "beside"
    beside = ("placement.critic_devices=0", "placement.critic_beside=rollout")
    Runner(tiny_config(tiny, out, *ASYNC, *beside), session=shared_session).run()
    assert [steady(r) for r in trained_rows(out)] == [steady(r) for r in trained_rows(async_run)]
    spans = load_records(out / "trace.jsonl")

    def on(role, method):
        return sorted((r for r in spans if r.role == role and r.method.endswith(method)), key=lambda r: r.start)

    values, gens = on("critic", "compute_values"), on("rollout", "generate_sequences")
    assert len(values) == ITERATIONS and len(gens) == ITERATIONS + 1  # one batch launched past the end
    assert {r.pid for r in values} == {r.pid for r in gens}  # one process
    assert all(v.end <= g.start for v, g in zip(values, gens[1:]))
    critic, actor = on("critic", "update_critic"), on("actor", "update_actor")
    assert sum(max(0.0, min(c.end, a.end) - max(c.start, a.start)) for c, a in zip(critic, actor)) > 0


def test_an_asynchronous_run_recovers_a_killed_rollout_worker(tiny, tmp_path, shared_session, async_run):
    """The rollout group's process killed mid-run (a batch launched ahead in flight): the run
    recovers from the last checkpoint, regenerates what was queued, and its redone iteration
    equals the uninterrupted asynchronous run's."""
    killed = []

    def kill_rollout(algorithm, batch, metrics):
        if metrics["iteration"] == 2 and not killed:
            killed.append(kill_last_process_of("rollout", shared_session))

    out = tmp_path / "recovered"
    result = Runner(tiny_config(tiny, out, *ASYNC), session=shared_session, callbacks=[kill_rollout]).run()
    assert killed and result.iterations == ITERATIONS and result.recoveries == 1
    rows = trained_rows(out)
    # Iteration 3 may finish on the batch generated before the kill and fail only at its
    # checkpoint (then it is logged twice), or fail in its step: either way it is redone.
    assert (rows[-1]["iteration"], rows[-1]["run/redone"]) == (3, 1)
    last = {r["iteration"]: r for r in rows}
    uninterrupted = trained_rows(async_run)
    assert [steady(last[i]) for i in (1, 2, 3)] == [steady(r) for r in uninterrupted]
