"""One short real run for the widget tests: a tiny GRPO on real worker groups (shared Ray), two
iterations through `fit(callbacks=...)` watched by a dashboard, a timeline and a run recorder.
Package-scoped: the view tests and the browser test share it."""

import sys
import time

import pytest
import ray

from algorithms import GRPO, Groups, GRPOConfig
from widgets import LiveTimeline, MetricsDashboard, RunRecorder
from workbench import (
    ActorConfig,
    ActorRolloutRefWorker,
    OptimConfig,
    RuleReward,
    SamplingConfig,
    arithmetic,
    tokenize_prompts,
)
from workbench.models import load, make_tiny

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def length_reward(text: str, truth: str) -> float:
    """Varied scores from an untrained model, so advantages are not all zero."""
    return float(len(text) % 3)


@pytest.fixture(scope="package")
def run(shared_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    model_dir = make_tiny("1m", root / "policy", seed=3)
    tokenizer = load(model_dir).tokenizer
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 4, seed=1)
    prompts = tokenize_prompts([p.__dict__ for p in problems], tokenizer, max_prompt_length=32)
    s = shared_session
    since = time.time()  # the shared session's trace also holds earlier tests' spans
    actor = s.group(
        "actor",
        ActorRolloutRefWorker,
        s.pool("actor_pool", 2),
        ActorConfig(
            model_path=str(model_dir), reference=True, optim=OptimConfig(lr=1e-4), mini_batch_size=4, micro_batch_size=2
        ),
    )
    grpo = GRPO(
        Groups(actor=actor, reference=actor, reward=RuleReward(length_reward)),
        GRPOConfig(sampling=SamplingConfig(max_new_tokens=4, n=2, seed=0)),
    )
    dashboard, timeline = MetricsDashboard(), LiveTimeline(s, last_iterations=None, since=since)
    recorder = RunRecorder(root / "run", s, since=since)
    batches = []
    history = grpo.fit(
        [prompts],
        iterations=2,
        log=None,
        callbacks=[dashboard, timeline, recorder, lambda algo, batch, m: batches.append(batch)],
    )
    assert timeline.wait_drawn(60)  # its refreshes run on the view's thread
    yield {
        "session": s,
        "since": since,
        "grpo": grpo,
        "history": history,
        "dashboard": dashboard,
        "timeline": timeline,
        "recorder": recorder,
        "batch": batches[-1],
        "tokenizer": tokenizer,
        "prompts": prompts,
    }
    s.clear()
