"""A notebook user's PPO: roles re-created between two steps (a fused one too), a worker killed
and recovered from its checkpoint, and a prompt too long for the model's positions; each with
the exact error and a working next step (tiny 1m model, short settings, shared Ray)."""

import os
import signal
import sys

import pytest
import ray
import torch

import algorithms
from algorithms import PPO, Groups
from workbench import WorkerDiedError
from workbench.data import arithmetic
from workbench.data.batch import Batch
from workbench.data.prompts import tokenize_prompts
from workbench.engines.contract import OptimConfig
from workbench.engines.rollout import SamplingConfig
from workbench.errors import GroupRemovedError
from workbench.models import load, make_tiny
from workbench.models.load import ModelLoadError
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.rule_reward import RuleReward

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    root = tmp_path_factory.mktemp("abuse")
    model = str(make_tiny("1m", root / "policy", seed=3))
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 4, seed=2)
    prompts = tokenize_prompts([p.__dict__ for p in problems], load(model).tokenizer, max_prompt_length=32)
    optim = OptimConfig(lr=1e-3)
    return {
        "root": root,
        "prompts": prompts,
        "actor": ActorConfig(model, optim=optim, mini_batch_size=4, micro_batch_size=4),
        "reference": ActorConfig(model, train=False, rollout=None, reference=True),
        "critic": CriticConfig(model, optim=optim, mini_batch_size=8),
    }


def actor_cell(session, kit):
    return session.fused(
        "actor_pool", actor=(ActorRolloutRefWorker, kit["actor"]), reference=(ActorRolloutRefWorker, kit["reference"])
    )


def test_roles_recreated_between_steps_killed_and_recovered(session, kit):
    session.pool("actor_pool", 2)
    session.pool("critic_pool", 1)
    fused = actor_cell(session, kit)
    critic = session.group("critic", CriticWorker, "critic_pool", kit["critic"])
    ppo = PPO(
        Groups(actor=fused["actor"], reference=fused["reference"], critic=critic, reward=RuleReward(arithmetic.score)),
        algorithms.PPOConfig(sampling=SamplingConfig(max_new_tokens=6, n=2, seed=0)),
    )
    prompts = kit["prompts"]
    ppo.step(prompts)

    session.group("critic", CriticWorker, "critic_pool", kit["critic"])  # re-run the critic cell
    ppo.step(prompts)

    # Re-running only the reference cell takes the fused actor's processes with it. (The cell puts
    # it on a device of its own: the actor's processes then stay warm on their pool, and the fused
    # cell's re-run below starts on them instead of two new ones.)
    session.group("reference", ActorRolloutRefWorker, session.pool("reference_pool", 1), kit["reference"])
    with pytest.raises(GroupRemovedError, match=r"'actor' no longer exists: .*shared its processes with 'reference'"):
        ppo.step(prompts)
    actor_cell(session, kit)  # re-run the fused cell: both handles follow
    batch, metrics = ppo.step(prompts)
    assert ppo.iteration == 3 and torch.isfinite(batch["advantages"]).all()

    # Kill an actor rank after a checkpoint; recover() restarts the fused group and reloads it.
    actor = ppo.groups.actor
    actor.save_checkpoint(str(kit["root"] / "ckpt")).get()
    before = actor.compute_log_prob(batch).get()["old_log_probs"]
    pid = actor.hostset.identities[1][0]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match=rf"rank 1 of role 'actor' \(pid {pid} .*\['reference'\] fused with it"):
        ppo.step(prompts)
    session.recover("actor")
    after = actor.compute_log_prob(batch).get()["old_log_probs"]
    assert torch.allclose(before, after, atol=1e-6)  # the trained weights, not the initial ones
    ppo.step(prompts)

    # A prompt longer than the model's positions allow: refused before any remote work.
    width = 512 - 6 + 1
    pad = torch.zeros(len(prompts), width - prompts["input_ids"].shape[1], dtype=torch.long)
    long = Batch(
        {
            "input_ids": torch.cat([pad, prompts["input_ids"]], 1),
            "attention_mask": torch.cat([pad, prompts["attention_mask"]], 1),
        },
        prompts.columns,
    )
    with pytest.raises(
        ModelLoadError, match=r"prompts of 507 tokens \+ max_new_tokens=6 = 513 exceed the 512 positions"
    ):
        ppo.step(long)
    assert ppo.iteration == 4
