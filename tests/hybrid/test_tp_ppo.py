"""A PPO iteration end to end with a tensor-parallel actor (and reference) generating through the
3D-HybridEngine's switch, beside a data-parallel critic and a rule reward."""

import math
import time

from algorithms import PPO, Groups
from tests.hybrid.test_hybrid_engine import transitions
from workbench import Mesh
from workbench.data import arithmetic
from workbench.data.prompts import tokenize_prompts
from workbench.engines.contract import OptimConfig
from workbench.engines.rollout import SamplingConfig
from workbench.models import load, make_tiny
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.rule_reward import RuleReward


def test_a_tensor_parallel_ppo_iteration_end_to_end(session, tmp_path):
    model_dir = str(make_tiny("1m", tmp_path / "actor", seed=5))
    tokenizer = load(model_dir).tokenizer
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 4, seed=1)
    batch = tokenize_prompts([p.__dict__ for p in problems], tokenizer, max_prompt_length=32)
    actor = session.group(
        "actor",
        ActorRolloutRefWorker,
        session.pool("actor_pool", 4),
        ActorConfig(
            model_path=model_dir,
            backend="3d",
            reference=True,
            optim=OptimConfig(lr=1e-4),
            mini_batch_size=4,
            micro_batch_size=2,
        ),
        mesh=Mesh(tp=2, dp=2, gen_tp=1),
    )
    critic = session.group("critic", CriticWorker, session.pool("critic_pool", 1), CriticConfig(model_path=model_dir))
    groups = Groups(actor=actor, reference=actor, critic=critic, reward=RuleReward(arithmetic.score))
    algo = PPO(groups, PPO.Config(sampling=SamplingConfig(max_new_tokens=6, n=2, seed=0)))
    since = time.time()
    for _ in range(2):
        out, metrics = algo.step(batch)
        assert len(out) == 8 and all(math.isfinite(v) for v in metrics.values()), metrics
        assert metrics["actor/grad_norm"] > 0 and metrics["critic/vf_loss"] > 0
        assert metrics["actor/rollout_logprob_diff"] < 1e-4  # sampled from the weights it trains
    switches = transitions(session, since)
    assert len(switches) == 2 * 4 and all(s.extra["checked"] for s in switches)
