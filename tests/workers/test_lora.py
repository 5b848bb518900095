"""LoRA actors and critics on real processes (2 gloo ranks): FSDP2 and DeepSpeed ZeRO-3, where
the HF rollout holds its own generation copy, so each sync moves the adapters alone.

Each actor test checks, on one group: the reference (adapters disabled) is the base exactly,
before and after an update; the trained policy equals the merged export within 1e-5 and its
greedy generations; the sync moved the adapter bytes and nothing else; a checkpoint resumes
bit-exactly (the step after loading equals the step after saving).
"""

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

import tests.workers.losses as losses
from tests.workers.reference import advantages_for, prompts
from workbench import Batch
from workbench.engines.contract import OptimConfig
from workbench.engines.forward import response_log_probs
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.rollout import SamplingConfig
from workbench.models import load, make_tiny
from workbench.models.lora import LoRAConfig, apply_lora, is_trained
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker

ray.cloudpickle.register_pickle_by_value(losses)
LORA = LoRAConfig(rank=4, alpha=8.0)
OPTIM = OptimConfig(lr=1e-2)  # large enough that two steps move log-probs far above rounding


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny("1m", tmp_path_factory.mktemp("tiny") / "actor", seed=3))


def adapter_bytes(model_dir) -> int:
    model = apply_lora(load(model_dir).model, LORA)
    return sum(v.numel() * v.element_size() for n, v in model.state_dict().items() if is_trained(n))


@pytest.mark.parametrize("backend, stage", [("fsdp", 2), ("deepspeed", 3)], ids=["fsdp", "zero3"])
def test_lora_actor_step_reference_sync_export_and_resume(session, model_dir, tmp_path, backend, stage):
    config = ActorConfig(
        model_path=model_dir,
        backend=backend,
        zero_stage=stage,
        reference=True,
        optim=OPTIM,
        mini_batch_size=8,
        micro_batch_size=2,
        lora=LORA,
    )
    actor = session.group("actor", ActorRolloutRefWorker, session.pool(f"lora_{backend}", 2), config)
    tokenizer = load(model_dir).tokenizer
    greedy = SamplingConfig(max_new_tokens=10, greedy=True)
    batch = actor.generate_sequences(prompts(tokenizer), greedy).get()
    train = batch.union(advantages_for(batch))
    initial = actor.compute_log_prob(batch).get()["old_log_probs"]
    assert torch.equal(actor.compute_ref_log_prob(batch).get()["ref_log_probs"], initial)  # B = 0: the base

    actor.update_actor(train, losses.reinforce_loss).get()
    actor.update_actor(train, losses.reinforce_loss).get()  # the second step moves A as well
    trained = actor.compute_log_prob(batch).get()["old_log_probs"]
    assert (trained - initial).abs().max() > 1e-3
    # The frozen base did not move: with adapters off the same module gives the initial log-probs.
    assert torch.equal(actor.compute_ref_log_prob(batch).get()["ref_log_probs"], initial)

    merged = AutoModelForCausalLM.from_pretrained(actor.export_hf(str(tmp_path / "merged"), merged=True).get()[0])
    with torch.no_grad():
        local, _ = response_log_probs(merged.eval(), batch)
    assert (local - trained).abs().max() <= 1e-5

    since = max(r.end for r in session.trace())
    after = actor.generate_sequences(prompts(tokenizer), greedy).get()
    expected = HFRollout(merged, tokenizer.pad_token_id, tokenizer.eos_token_id).generate(prompts(tokenizer), greedy)
    assert torch.equal(after["responses"], expected["responses"]), "the rollout did not get the adapters"
    syncs = [r for r in session.trace() if r.method == "hybrid.sync_weights" and r.start >= since]
    assert len(syncs) == 2 and all(r.extra["bytes_loaded"] == adapter_bytes(model_dir) for r in syncs)

    adapter_dir = tmp_path / "adapter"
    actor.export_hf(str(adapter_dir)).get()
    assert (adapter_dir / "adapter_model.safetensors").exists() and not (adapter_dir / "model.safetensors").exists()

    # Resume: the step after loading is the step after saving, bit for bit (adapters + Adam state).
    actor.save_checkpoint(str(tmp_path / "ckpt")).get()
    held = actor.snapshot("saved").get()  # the same point, in memory
    actor.update_actor(train, losses.reinforce_loss).get()
    continued = actor.compute_log_prob(batch).get()["old_log_probs"]
    actor.update_actor(train, losses.reinforce_loss).get()  # wander off
    actor.load_checkpoint(str(tmp_path / "ckpt")).get()
    assert torch.equal(actor.compute_log_prob(batch).get()["old_log_probs"], trained)
    actor.update_actor(train, losses.reinforce_loss).get()
    assert torch.equal(actor.compute_log_prob(batch).get()["old_log_probs"], continued)

    # The in-memory snapshot rewinds the same way; it holds the adapters and their optimizer
    # state (Adam's two moments; ZeRO-3's fp32 copy, and the adapters whole on every rank, as
    # they are under its persistence threshold), never the frozen base.
    actor.update_actor(train, losses.reinforce_loss).get()  # wander off again
    actor.restore_snapshot("saved").get()
    assert torch.equal(actor.compute_log_prob(batch).get()["old_log_probs"], trained)
    actor.update_actor(train, losses.reinforce_loss).get()
    assert torch.equal(actor.compute_log_prob(batch).get()["old_log_probs"], continued)
    model = load(model_dir).model
    base_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert adapter_bytes(model_dir) * 3 <= sum(held) < base_bytes

    # Replay (workbench.workers.replay) takes the update on the adapters and rewinds it: the
    # adapters, their optimizer state and the frozen base are as they were, bit for bit.
    digest = actor.state_digest().get()
    replayed = actor.replay_update(train, {"a": losses.reinforce_loss, "b": losses.reinforce_loss}, kl=True).get()
    assert actor.state_digest().get() == digest
    assert torch.equal(actor.compute_ref_log_prob(batch).get()["ref_log_probs"], initial)
    update = actor.update_actor(train, losses.reinforce_loss).get()
    a, b = replayed["metrics"]["a"], replayed["metrics"]["b"]
    assert a == b and a.pop("replay/kl_to_current") > 0 and a == update
    (aa, ab), (_, bb) = replayed["dots"]
    assert aa == ab == bb > 0


@pytest.mark.numerics
def test_lora_critic_trains_adapters_and_head(session, model_dir, tmp_path):
    from algorithms.losses import CriticLoss

    config = CriticConfig(
        model_path=model_dir, optim=OptimConfig(lr=3e-3), mini_batch_size=8, micro_batch_size=4, lora=LORA
    )
    critic = session.group("critic", CriticWorker, session.pool("lora_critic", 2), config)
    tokenizer = load(model_dir).tokenizer
    loaded = load(model_dir)
    rollout = HFRollout(loaded.model, tokenizer.pad_token_id, tokenizer.eos_token_id).generate(
        prompts(tokenizer), SamplingConfig(max_new_tokens=6, seed=0)
    )
    values = critic.compute_values(rollout).get()["values"]
    batch = rollout.union(Batch({"values": values, "returns": torch.ones_like(values)}))
    vf = [critic.update_critic(batch, CriticLoss()).get()["critic/vf_loss"] for _ in range(3)]
    assert min(vf[1:]) < vf[0], vf  # a step lowered the loss (which one may differ by machine)
    critic.export_hf(str(tmp_path / "critic")).get()
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "critic" / "adapter_model.safetensors")
    assert any(".lora_A." in k for k in saved) and any("score" in k for k in saved)  # adapters + the value head


def test_lora_vllm_rollout_gets_the_adapter(session, model_dir, tmp_path):
    """vLLM keeps the base and applies the trained adapter itself (its LoRA support)."""
    from workbench.engines.vllm_rollout import VLLMRolloutConfig

    config = ActorConfig(
        model_path=model_dir,
        rollout="vllm",
        optim=OPTIM,
        mini_batch_size=8,
        micro_batch_size=4,
        lora=LORA,
        vllm=VLLMRolloutConfig(max_model_len=128, cpu_threads_bind="per-rank"),
    )
    actor = session.group("actor", ActorRolloutRefWorker, session.pool("lora_vllm", 1), config)
    tokenizer = load(model_dir).tokenizer
    greedy = SamplingConfig(max_new_tokens=10, greedy=True)
    batch = actor.generate_sequences(prompts(tokenizer), greedy).get()
    for _ in range(2):
        actor.update_actor(batch.union(advantages_for(batch)), losses.reinforce_loss).get()
    since = max(r.end for r in session.trace())
    after = actor.generate_sequences(prompts(tokenizer), greedy).get()
    merged = AutoModelForCausalLM.from_pretrained(actor.export_hf(str(tmp_path / "merged"), merged=True).get()[0])
    expected = HFRollout(merged, tokenizer.pad_token_id, tokenizer.eos_token_id).generate(prompts(tokenizer), greedy)
    # The update moved the policy on the first batch's tokens (whether or not it changed a greedy
    # token: that depends on this machine's rounding), so the log-prob check below would catch an
    # engine still on the base.
    with torch.no_grad():
        moved = (response_log_probs(merged.eval(), batch)[0] - batch["rollout_log_probs"]).abs().max()
    assert moved > 1e-3, moved
    assert torch.equal(after["responses"], expected["responses"])
    assert (after["rollout_log_probs"] - expected["rollout_log_probs"]).abs().max() <= 1e-3
    syncs = [r for r in session.trace() if r.method == "hybrid.sync_weights" and r.start >= since]
    assert [r.extra["bytes_loaded"] for r in syncs] == [adapter_bytes(model_dir)]
