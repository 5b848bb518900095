"""The actor worker on real processes: FSDP2 over 2 gloo ranks, HF rollout, hybrid-engine sync.

Every check compares against a single-process copy of the same model trained the same way in
this test process.
"""

import copy
import time
from pathlib import Path

import pytest
import ray
import torch

import tests.workers.losses as losses
from tests.workers.reference import (
    OPTIM,
    advantages_for,
    assert_checkpoint_roundtrip,
    param_diffs,
    prompts,
    single_process_step,
)
from workbench import Batch
from workbench.engines import forward
from workbench.engines.forward import response_log_probs, sequence_nll
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.rollout import SamplingConfig
from workbench.engines.vllm_rollout import VLLMRolloutConfig
from workbench.models import load, make_tiny
from workbench.stages import encode_examples
from workbench.workers import ActorConfig, ActorRolloutRefWorker

ray.cloudpickle.register_pickle_by_value(losses)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny("1m", tmp_path_factory.mktemp("tiny") / "actor", seed=3))


# Each rollout backend with the reference kept another way (workbench.engines.frozen): FSDP
# shards, and those shards in host memory.
@pytest.fixture(scope="module", params=[("hf", "sharded"), ("vllm", "host")], ids=["hf", "vllm"])
def actor(request, shared_session, model_dir):
    rollout, keep = request.param
    config = ActorConfig(
        model_path=model_dir,
        rollout=rollout,
        reference=True,
        reference_keep=keep,
        optim=OPTIM,
        mini_batch_size=8,
        micro_batch_size=2,
        vllm=VLLMRolloutConfig(max_model_len=128, cpu_threads_bind="per-rank"),
        share_prompts=True,  # a 1m model's forwards would not share by themselves (too little saved)
    )
    group = shared_session.group("actor", ActorRolloutRefWorker, shared_session.pool("actor_pool", 2), config)
    yield group
    shared_session.clear()


def local_model(model_dir):
    loaded = load(model_dir)
    return loaded.model, loaded.tokenizer


def test_rollout_log_probs_match_training_forward(actor, model_dir):
    _, tokenizer = local_model(model_dir)
    batch = actor.generate_sequences(prompts(tokenizer, 6), SamplingConfig(max_new_tokens=12, n=2, seed=7))
    scored = actor.compute_log_prob(batch).get()
    rolled = batch.get()
    assert len(rolled) == 12 and rolled["responses"].shape == (12, 12)
    diff = (scored["old_log_probs"] - rolled["rollout_log_probs"]).abs() * rolled["response_mask"]
    assert diff.max() <= 1e-3, diff.max()
    assert torch.isfinite(scored["entropy"]).all()


def test_update_matches_single_process_and_next_generation_uses_new_weights(
    actor, model_dir, tmp_path, shared_session, monkeypatch
):
    model, tokenizer = local_model(model_dir)
    greedy = SamplingConfig(max_new_tokens=10, greedy=True)
    before = actor.generate_sequences(prompts(tokenizer), greedy).get()
    reference = HFRollout(copy.deepcopy(model), tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert torch.equal(before["responses"], reference.generate(prompts(tokenizer), greedy)["responses"])

    # Two samples per prompt: FSDP's forwards compute each prompt once
    # (workbench.engines.forward.shared_prompt_logits); the reference step computes rows whole.
    train = actor.generate_sequences(prompts(tokenizer, 4), SamplingConfig(max_new_tokens=10, n=2, seed=5)).get()
    train = train.union(advantages_for(train))
    monkeypatch.setattr(forward, "can_share_prompts", lambda model: False)
    metrics = actor.update_actor(train, losses.reinforce_loss).get()
    assert set(metrics) >= {"actor/loss", "actor/grad_norm", "actor/lr"} and metrics["actor/grad_norm"] > 0

    single, grads = single_process_step(model, train)

    exported = actor.export_hf(str(tmp_path / "hf")).get()[0]
    worst, worst_safe = param_diffs(load(exported).model.state_dict(), single, grads)
    assert worst_safe <= 1e-5, f"FSDP (2 ranks) vs single process: max param diff {worst_safe} where |grad| >= 1e-6"
    assert worst <= 2 * OPTIM.lr, f"FSDP (2 ranks) vs single process: max param diff {worst}"

    after = actor.generate_sequences(prompts(tokenizer), greedy).get()
    expected = HFRollout(single.eval(), tokenizer.pad_token_id, tokenizer.eos_token_id).generate(
        prompts(tokenizer), greedy
    )
    assert torch.equal(after["responses"], expected["responses"]), "generation did not pick up the update"
    assert (after["rollout_log_probs"] - expected["rollout_log_probs"]).abs().max() <= 1e-3
    syncs = [r for r in shared_session.trace() if r.method == "hybrid.sync_weights"]
    assert syncs and all(r.extra["peak_rss_bytes"] > 0 for r in syncs)

    # The reference copy still holds the initial weights, each rank about half of them (FSDP
    # shards; in host memory for "host", which on a CPU machine is where the device is too).
    ref = actor.compute_ref_log_prob(after).get()["ref_log_probs"]
    initial, _ = response_log_probs(model.eval(), after)
    assert (ref - initial).abs().max() <= 1e-4
    whole = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    kept = actor.reference_bytes().get()
    # (after forwards: the root unit, embeddings and head, gives its gathered weights back too)
    assert len(kept) == 2 and all(0.45 * whole <= sum(k.values()) <= 0.55 * whole for k in kept), (kept, whole)
    if actor.config.reference_keep == "host":
        assert all(set(k) == {"cpu"} for k in kept)


def test_ranks_whose_rows_repeat_prompts_differently_make_the_same_model_calls(actor, model_dir, tmp_path):
    """share_prompts=True computes a repeated prompt once, in a second model call. Rank 0's rows
    repeat one prompt and rank 1's do not; the FSDP actor and the sharded reference gather
    weights in every forward, so both ranks must still call alike (forward.agreed), or hang."""
    model, tokenizer = local_model(model_dir)
    rows = prompts(tokenizer, 3)[torch.tensor([0, 0, 1, 2])]
    rolled = actor.generate_sequences(rows, SamplingConfig(max_new_tokens=6, seed=11)).get()
    old = actor.compute_log_prob(rolled).get()["old_log_probs"]
    ref = actor.compute_ref_log_prob(rolled).get()["ref_log_probs"]
    current = load(actor.export_hf(str(tmp_path / "now")).get()[0]).model.eval()
    assert (old - response_log_probs(current, rolled)[0]).abs().max() <= 1e-4
    assert (ref - response_log_probs(model.eval(), rolled)[0]).abs().max() <= 1e-4


def test_checkpoint_save_load_restores_log_probs(actor, model_dir, tmp_path):
    _, tokenizer = local_model(model_dir)
    batch = actor.generate_sequences(prompts(tokenizer), SamplingConfig(max_new_tokens=8, seed=1)).get()
    assert_checkpoint_roundtrip(actor, batch, tmp_path / "ckpt")


def test_compute_loss_matches_a_local_forward(actor, model_dir):
    model, tokenizer = local_model(model_dir)
    ids, attention, loss_mask = encode_examples(
        tokenizer, ["Q: 1+2=? A:", "Q: 30+4=? A:", "Q: 5+5=? A:"], [" 3", " 34", " 10"], max_length=32
    )
    batch = Batch({"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask})
    remote = actor.compute_loss(batch).get()["ptx_loss"]
    exported = load(actor.export_hf(str(Path(model_dir).parent / f"ptx-{id(actor)}")).get()[0]).model
    with torch.no_grad():
        local = sequence_nll(exported, ids, attention, loss_mask)
    assert remote.shape == (3,) and (remote - local).abs().max() <= 1e-5


def test_one_rank_rollout_shares_the_training_weights(session, model_dir):
    """At dp = 1 the HF rollout reads the training tensors themselves: generation after an update
    equals the single-process model's, and no weight sync ever runs."""
    config = ActorConfig(model_path=model_dir, optim=OPTIM, mini_batch_size=8, micro_batch_size=4)
    actor = session.group("actor", ActorRolloutRefWorker, session.pool("one", 1), config)
    model, tokenizer = local_model(model_dir)
    greedy = SamplingConfig(max_new_tokens=10, greedy=True)
    since = time.time()  # the session's trace holds every earlier test's spans too
    train = actor.generate_sequences(prompts(tokenizer), greedy).get()
    actor.update_actor(train.union(advantages_for(train)), losses.reinforce_loss).get()
    single, _ = single_process_step(model, train.union(advantages_for(train)))
    after = actor.generate_sequences(prompts(tokenizer), greedy).get()
    expected = HFRollout(single.eval(), tokenizer.pad_token_id, tokenizer.eos_token_id).generate(
        prompts(tokenizer), greedy
    )
    assert torch.equal(after["responses"], expected["responses"]), "generation did not see the update"
    assert (after["rollout_log_probs"] - expected["rollout_log_probs"]).abs().max() <= 1e-4
    assert not [r for r in session.trace() if r.method == "hybrid.sync_weights" and r.start >= since]
