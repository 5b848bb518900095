"""Whole-run checkpoints on real worker groups (shared Ray): PPO with an actor (+ reference) on two
data-parallel ranks and a critic, under FSDP2 and under DeepSpeed ZeRO-2. Resuming gives the
uninterrupted run's metrics bit for bit; a crash mid-save leaves the last checkpoint usable; the
export loads in plain transformers; NaN in a batch stops the step before any weight changes."""

import math
import sys

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from algorithms import GRPO, PPO, Groups, GRPOConfig, PPOConfig
from workbench.data import arithmetic
from workbench.data.prompts import PromptLoader, PromptLoaderConfig
from workbench.engines.contract import OptimConfig
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError, NonFiniteError, WorkbenchError
from workbench.models import load, make_tiny
from workbench.run import checkpoint as checkpoint_module
from workbench.run.checkpoint import RunCheckpointer
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.rule_reward import RuleReward

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def length_score(text: str, truth: str) -> float:
    """Varied scores from an untrained model, so advantages are not all zero."""
    return float(len(text) % 3)


def nan_loss(outputs, batch):
    return outputs["log_probs"].sum() * math.nan, {"nan_loss": 0.0}


class EditedAdvantages(PPO):
    """A live edit of the numerics gone wrong: one row's advantages become NaN."""

    def advantages(self, batch):
        batch = super().advantages(batch)
        batch["advantages"][1] = math.nan
        return batch


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = make_tiny("1m", root / "policy", seed=7)
    tokenizer = load(model_dir).tokenizer
    rows = [p.__dict__ for p in arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 12, seed=2)]
    loader = PromptLoader(rows, tokenizer, PromptLoaderConfig(batch_size=4, max_prompt_length=32, seed=3))
    return {"model": str(model_dir), "loader": loader, "root": root}


@pytest.fixture(scope="module", params=["fsdp", "deepspeed"])
def ppo_groups(request, shared_session, kit):
    s, backend = shared_session, request.param
    optim = OptimConfig(lr=1e-3)
    actor = s.group(
        "actor",
        ActorRolloutRefWorker,
        s.pool("actor_pool", 2),
        ActorConfig(
            model_path=kit["model"],
            reference=True,
            optim=optim,
            backend=backend,
            mini_batch_size=4,
            micro_batch_size=2,
            epochs=2,
        ),
    )
    critic = s.group(
        "critic",
        CriticWorker,
        s.pool("critic_pool", 1),
        CriticConfig(model_path=kit["model"], optim=optim, backend=backend, mini_batch_size=4),
    )
    yield {
        "backend": backend,
        "groups": Groups(actor=actor, reference=actor, critic=critic, reward=RuleReward(length_score)),
    }
    s.clear()


def new_ppo(groups):
    return PPO(groups, PPOConfig(sampling=SamplingConfig(max_new_tokens=5, n=2, seed=11), kl_coef=0.05))


def comparable(metrics: dict) -> dict:
    """Everything but wall-clock figures."""
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/"))}


def run(ppo, loader, start: int, iterations: int) -> list[dict]:
    batches = loader.batches(start)
    return [comparable(ppo.step(next(batches))[1]) for _ in range(iterations)]


def test_resume_gives_the_uninterrupted_metrics_bit_for_bit(ppo_groups, kit, tmp_path):
    groups, loader = ppo_groups["groups"], kit["loader"]
    ckpt = RunCheckpointer(tmp_path / "ckpt", keep=2)
    first = new_ppo(groups)
    run(first, loader, 0, 2)
    saved = ckpt.save(first, extra={"batches": 2})
    uninterrupted = run(first, loader, 2, 3)  # goes on past the checkpoint (worker RNGs, weights, KL all move)

    resumed = new_ppo(groups)  # a fresh driver-side algorithm, the same live groups
    state = ckpt.restore(resumed)
    assert state["path"] == saved and state["iteration"] == 2 and state["extra"] == {"batches": 2}
    assert resumed.iteration == 2 and len(resumed.history) == 2
    again = run(resumed, loader, state["extra"]["batches"], 3)
    assert again == uninterrupted  # every metric, exactly
    assert [m["iteration"] for m in again] == [3.0, 4.0, 5.0]


def test_a_snapshot_in_memory_rewinds_the_run_bit_for_bit(ppo_groups, kit):
    """snapshot() holds every trained group's state in its own processes; restore() rewinds
    to it: the same iterations again give the same metrics, every weight and Adam moment equal."""
    groups, loader = ppo_groups["groups"], kit["loader"]
    ppo = new_ppo(groups)
    run(ppo, loader, 0, 1)
    taken = ppo.snapshot()
    digests = {role: getattr(groups, role).state_digest().get() for role in ("actor", "critic")}
    assert taken.roles == ("actor", "critic") and taken.nbytes > 0
    later = run(ppo, loader, 1, 2)  # two updates of both models (actor: 2 epochs x 2 mini-batches each)
    assert groups.actor.state_digest().get() != digests["actor"]

    ppo.restore(taken)
    assert ppo.iteration == 1 and len(ppo.history) == 1
    assert {role: getattr(groups, role).state_digest().get() for role in ("actor", "critic")} == digests
    assert run(ppo, loader, 1, 2) == later  # every metric, exactly
    ppo.restore(taken)  # still held: a second rewind
    assert groups.critic.state_digest().get() == digests["critic"]
    ppo.drop(taken)
    with pytest.raises(ConfigError, match="it was dropped"):
        ppo.restore(taken)
    other = GRPO(Groups(actor=groups.actor, reference=groups.actor, reward=groups.reward), GRPOConfig())
    with pytest.raises(ConfigError, match=r"taken of a PPO with trained roles \['actor', 'critic'\]; this is a GRPO"):
        other.restore(ppo.snapshot())  # refused on the driver, before any worker is touched


def test_replay_puts_one_batch_through_variants_and_leaves_the_run_as_it_was(ppo_groups, kit):
    """algo.replay: each variant's real update (2 epochs x 2 mini-batches on two ranks) taken on
    the actor, measured and rewound. The live config's variant is the live update, exactly."""
    groups, loader = ppo_groups["groups"], kit["loader"]
    ppo = new_ppo(groups)
    run(ppo, loader, 0, 1)
    taken = ppo.snapshot()
    batch, live = ppo.step(next(loader.batches(1)))  # an iteration's batch, and what its update did
    ppo.restore(taken)  # back to before that update: replay it on the same weights
    ppo.drop(taken)
    digest = groups.actor.state_digest().get()
    variants = {
        "live": {},
        "again": {},
        "clip_higher": {"clip_ratio_high": 0.28},
        "seq_mean": {"loss_agg_mode": "seq-mean-token-mean"},
        "gspo": {"policy_loss": "gspo"},
        "no_kl": {"kl_coef": 0.0},
    }
    result = ppo.replay(batch, variants, kl=True)
    assert groups.actor.state_digest().get() == digest  # weights, Adam's moments: as they were
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm", "actor/lr"):
        assert result.metrics["live"][key] == live[key], key
    cos = result.cosines()
    assert cos["live"]["live"] == pytest.approx(1, abs=1e-12) and cos["live"]["again"] == pytest.approx(1, abs=1e-12)
    assert result.metrics["live"] == result.metrics["again"]
    for other in ("gspo", "no_kl"):  # another loss, other advantages: another update
        assert cos["live"][other] < 1 - 1e-6 and cos["live"][other] == cos[other]["live"], other
    assert torch.equal(result.advantages["live"], batch["advantages"])
    assert not torch.equal(result.advantages["no_kl"], batch["advantages"])
    assert all(m["replay/kl_to_current"] > 0 and m["replay/update_norm"] > 0 for m in result.metrics.values())
    assert [row["variant"] for row in result.table()] == list(variants) and "gspo" in repr(result)
    assert run(ppo, loader, 1, 1) == [comparable(live)]  # the run goes on as if replay had not happened

    with pytest.raises(ConfigError, match=r"replay variant 'typo'.*not fields of PPOConfig"):
        ppo.replay(batch, {"typo": {"clip_ratio": 0.3}})
    with pytest.raises(ConfigError, match=r"replay variant 'bad'.*loss_agg_mode"):
        ppo.replay(batch, {"bad": {"loss_agg_mode": "mean"}})
    unsampled = batch.select(*[k for k in batch.keys() if k != "rollout_log_probs"])
    with pytest.raises(ConfigError, match=r"replay variant 'tis'.*reads the batch's \['rollout_log_probs'\]"):
        ppo.replay(unsampled, {"tis": {"off_policy_correction": "tis"}})


def test_a_crash_mid_save_leaves_the_last_checkpoint_usable(ppo_groups, kit, tmp_path, monkeypatch):
    groups = ppo_groups["groups"]
    ckpt = RunCheckpointer(tmp_path / "ckpt", keep=2)
    ppo = new_ppo(groups)
    run(ppo, kit["loader"], 0, 1)
    good = ckpt.save(ppo)
    run(ppo, kit["loader"], 1, 1)

    real_save = torch.save

    def crash_on_run_state(obj, path, *args, **kwargs):
        if str(path).endswith("run.pt"):  # the groups' shards are written; the driver dies now
            raise KeyboardInterrupt("simulated crash")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", crash_on_run_state)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(ppo)
    monkeypatch.undo()
    assert ckpt.latest() == good and ckpt.steps() == [good]
    assert groups.actor.hostset.checkpoints["actor"] == str(good / "actor")  # what session.recover reloads
    assert any(p.name.startswith(".partial-") for p in ckpt.directory.iterdir())  # the half-written step
    assert ckpt.restore(new_ppo(groups))["iteration"] == 1

    for _ in range(3):  # later saves clean up the crash's leftovers and keep the newest two
        run(ppo, kit["loader"], ppo.iteration, 1)
        ckpt.save(ppo)
    assert [p.name for p in ckpt.steps()] == ["step-000004", "step-000005"]
    assert not any(p.name.startswith(".partial-") for p in ckpt.directory.iterdir())


def test_export_loads_in_plain_transformers(ppo_groups, tmp_path):
    groups = ppo_groups["groups"]
    ppo = new_ppo(groups)
    out = RunCheckpointer(tmp_path / "ckpt").export_hf(ppo, tmp_path / "hf")
    assert set(out) == {"actor", "critic"}
    actor = AutoModelForCausalLM.from_pretrained(out["actor"])
    critic = AutoModelForTokenClassification.from_pretrained(out["critic"])
    ids = torch.tensor([[3, 4, 5]])
    assert actor(ids).logits.shape[-1] == actor.config.vocab_size
    assert critic(ids).logits.shape == (1, 3, 1)


def test_restore_refuses_another_algorithm_s_checkpoint(ppo_groups, tmp_path):
    ckpt = RunCheckpointer(tmp_path / "empty")
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        ckpt.restore(new_ppo(ppo_groups["groups"]))


def test_nan_in_a_batch_stops_the_step_before_any_weight_changes(ppo_groups, kit, tmp_path):
    groups = ppo_groups["groups"]
    ckpt = RunCheckpointer(tmp_path / "ckpt")
    before = ckpt.export_hf(new_ppo(groups), tmp_path / "before")
    bad = EditedAdvantages(groups, PPOConfig(sampling=SamplingConfig(max_new_tokens=5, n=2, seed=11)))
    prompts = next(kit["loader"].batches(0))
    with pytest.raises(NonFiniteError, match=r"'advantages' \(made by the 'adv' step\) in 1 row") as info:
        bad.step(prompts)
    assert len(info.value.uids) == 1 and info.value.uids[0] in set(prompts["uid"])
    after = ckpt.export_hf(bad, tmp_path / "after")
    for role in ("actor", "critic"):
        old = (before[role] / "model.safetensors").read_bytes()
        assert (after[role] / "model.safetensors").read_bytes() == old, f"{role} weights changed"
    good = new_ppo(groups)  # the session is still usable: the next iteration runs
    assert math.isfinite(good.step(next(kit["loader"].batches(1)))[1]["actor/pg_loss"])


def test_a_nan_loss_skips_the_optimizer_step_on_every_rank(ppo_groups, kit, tmp_path):
    groups = ppo_groups["groups"]
    ckpt = RunCheckpointer(tmp_path / "ckpt")
    gen = groups.actor.generate_sequences(
        next(kit["loader"].batches(0)), SamplingConfig(max_new_tokens=3, n=2, seed=1)
    ).get()
    before = ckpt.export_hf(new_ppo(groups), tmp_path / "before")
    with pytest.raises(WorkbenchError, match="optimizer step 1 of this update.*no weight changed"):
        groups.actor.update_actor(gen, nan_loss).get()
    after = ckpt.export_hf(new_ppo(groups), tmp_path / "after")
    assert (after["actor"] / "model.safetensors").read_bytes() == (before["actor"] / "model.safetensors").read_bytes()
    assert math.isfinite(new_ppo(groups).step(next(kit["loader"].batches(2)))[1]["actor/pg_loss"])  # still usable
