"""The 3D-HybridEngine on real processes: a tensor-parallel actor (DTensor over gloo ranks in Ray
actors) switching its weights into generation layouts with each of Table 2's methods.

Every generation is compared with the unsharded model in this test process, every update with
a single-process step, every transition's counted bytes with Table 2; and a PPO iteration runs
end to end on the tensor-parallel actor beside a data-parallel critic and a rule reward.
"""

import copy
import math
import time

import pytest
import ray
import torch

import tests.hybrid.workers
import tests.workers.losses as losses
from algorithms import PPO, Groups
from tests.hybrid.workers import CorruptibleActor
from tests.workers.reference import advantages_for, assert_checkpoint_roundtrip, prompts
from workbench import Mesh, layouts, transfers
from workbench.data import arithmetic
from workbench.data.prompts import tokenize_prompts
from workbench.engines import forward
from workbench.engines.contract import OptimConfig
from workbench.engines.forward import model_outputs
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError, DispatchError, WorkerCallError
from workbench.models import load, make_tiny
from workbench.workers import ActorConfig
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.rule_reward import RuleReward

ray.cloudpickle.register_pickle_by_value(losses)
ray.cloudpickle.register_pickle_by_value(tests.hybrid.workers)

OPTIM = OptimConfig(lr=1e-5, grad_clip=1.0)
GREEDY = SamplingConfig(max_new_tokens=8, greedy=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny("1m", tmp_path_factory.mktemp("tiny") / "actor", seed=5))


@pytest.fixture(scope="module")
def unsharded(model_dir):
    loaded = load(model_dir)
    return loaded.model.eval(), loaded.tokenizer


LAYOUTS = {"1-4-1to1-2-2-1": (4, 1, 2), "1-2-2to1-1-2-2": (2, 2, 1), "1-4-2to1-2-2-2": (4, 2, 2)}
METHODS = ("hybridflow", "vanilla", "deepspeed_chat")


@pytest.fixture(scope="module")
def layout_actor(request, shared_session, model_dir):
    """A tensor-parallel actor group (with a reference) for one training layout, started once
    and shared by the tests that name it: starting 4-8 processes is the slow part here. The
    transition method changes on the live group (`switch_generation`). Every layout runs on
    devices of one 8-device pool (a 4-rank one on a slice of it): processes are kept warm per
    pool, so the 8-rank layout starts on the 4-rank layouts' processes."""
    tp, dp, gen_tp = LAYOUTS[request.param]
    mesh = Mesh(tp=tp, dp=dp, gen_tp=gen_tp)
    cfg = ActorConfig(
        model_path=model_dir,
        backend="3d",
        optim=OPTIM,
        mini_batch_size=8,
        micro_batch_size=2,
        reference=True,
        share_prompts=True,  # a 1m model's forwards would not share by themselves (too little saved)
    )
    pool = shared_session.pool("actor_pool", max(tp * dp for tp, dp, _ in LAYOUTS.values()))
    if mesh.world_size < pool.world_size:
        pool = shared_session.slice("actor_ranks", pool, 0, mesh.world_size)
    group = shared_session.group("actor", CorruptibleActor, pool, cfg, mesh=mesh)
    yield group
    shared_session.clear()


@pytest.fixture
def switching_actor(layout_actor, method):
    if layout_actor.mesh.transition != method:
        layout_actor.switch_generation(transition=method)
    return layout_actor


def both(layouts, methods=METHODS):
    """Each of `layouts` under each of `methods`, ids "layout-method"; two parametrizations
    (not one list of pairs) so pytest keeps one group per layout across its methods."""

    def mark(test):
        test = pytest.mark.parametrize("layout_actor", layouts, indirect=True)(test)
        return pytest.mark.parametrize("method", methods)(test)

    return mark


def transitions(session, since: float):
    return [s for s in session.trace() if s.method == "hybrid.transition" and s.start >= since]


@both(LAYOUTS)
def test_generation_layouts_equal_the_unsharded_model_and_table_2(shared_session, switching_actor, unsharded):
    actor, mesh = switching_actor, switching_actor.mesh
    tp, dp, gen_tp, method = mesh.tp, mesh.dp, mesh.gen_tp, mesh.transition
    model, tokenizer = unsharded
    batch = prompts(tokenizer, 8)
    since = time.time()
    out = actor.generate_sequences(batch, GREEDY).get()
    expected = HFRollout(copy.deepcopy(model), tokenizer.pad_token_id, tokenizer.eos_token_id).generate(batch, GREEDY)
    assert torch.equal(out["responses"], expected["responses"])
    spans = transitions(shared_session, since)
    assert sorted(s.rank for s in spans) == list(range(mesh.world_size))
    model_bytes = spans[0].extra["model_bytes"]
    derived = layouts.transition_bytes(mesh, model_bytes)
    twins = zero3_twins(mesh, model_bytes)  # the default executor is the reallocation
    for span in spans:
        x, want = span.extra, derived[span.rank]
        counted = (x["bytes_received"] + twins, x["bytes_sent"] + twins, x["peak_param_bytes"], x["redundant_bytes"])
        assert counted == (want.received, want.sent, want.peak_params, want.redundant), (span.rank, x, want)
        assert x["executor"] == "reallocate" and x["checked"] and x["model_bytes"] == model_bytes
        assert (x["bytes_received"] + twins, x["peak_param_bytes"], x["redundant_bytes"]) == table2(
            model_bytes, tp, dp, gen_tp, method
        )


def zero3_twins(mesh: Mesh, model_bytes: int) -> int:
    """Bytes per rank deepspeed_chat's ZeRO-3 all-gather moves beyond the reallocation (each way):
    (d-1)/d of the rank's own tensor piece M/t, refetched from its data-parallel twins; 0 for the
    other methods (`transfers.switch_placements`)."""
    d = mesh.dp if mesh.transition == "deepspeed_chat" else 1
    return model_bytes * (d - 1) // (d * mesh.tp)


@both(LAYOUTS)
def test_the_switch_as_a_reallocation_is_bit_identical_and_keeps_each_methods_guarantees(
    shared_session, switching_actor, unsharded
):
    """executor="reallocate" (the default) moves the weights by point-to-point
    (`transfers.switch_placements`), "allgather" by Table 2's all-gathers: the same generation
    pieces bit for bit, the same peak and redundancy (hybridflow's training piece re-pointed
    inside its generation piece, not kept beside it), training restored after; the reallocation's
    bytes are its plan's: Table 2's, for deepspeed_chat less the ZeRO-3 twins' share."""
    actor, mesh = switching_actor, switching_actor.mesh
    model, tokenizer = unsharded
    rows = actor.switch_by_each_executor().get()
    model_bytes = rows[0]["allgather"]["stats"]["model_bytes"]
    table = layouts.transition_bytes(mesh, model_bytes)
    shapes = {name: tuple(t.shape) for name, t in model.named_parameters()}
    planned = transfers.rank_bytes(
        transfers.llama_params(shapes, model.config.num_hidden_layers), *transfers.switch_placements(mesh)
    )
    twins = zero3_twins(mesh, model_bytes)
    for rank, row in enumerate(rows):
        gathered, moved = row["allgather"]["stats"], row["reallocate"]["stats"]
        assert row["different"] == [], (rank, row["different"])
        assert row["allgather"]["restored"] and row["reallocate"]["restored"], rank
        assert row["allgather"]["inside"] == row["reallocate"]["inside"] == (mesh.transition != "vanilla"), rank
        assert moved["executor"] == "reallocate" and moved["checked"] and moved["model_bytes"] == model_bytes
        assert (moved["peak_param_bytes"], moved["redundant_bytes"]) == (table[rank].peak_params, table[rank].redundant)
        assert (gathered["peak_param_bytes"], gathered["redundant_bytes"]) == (
            moved["peak_param_bytes"],
            moved["redundant_bytes"],
        )
        assert (moved["bytes_sent"], moved["bytes_received"]) == tuple(planned[rank])
        assert tuple(planned[rank]) == (table[rank].sent - twins, table[rank].received - twins)
        assert (gathered["bytes_sent"], gathered["bytes_received"]) == (table[rank].sent, table[rank].received)
    batch = prompts(tokenizer, 8)
    expected = HFRollout(copy.deepcopy(model), tokenizer.pad_token_id, tokenizer.eos_token_id).generate(batch, GREEDY)
    actor.use_transition_executor("allgather")  # the default generations use "reallocate"
    try:
        since = time.time()
        out = actor.generate_sequences(batch, GREEDY).get()
    finally:
        actor.use_transition_executor("reallocate")  # the group is shared
    assert torch.equal(out["responses"], expected["responses"])
    spans = transitions(shared_session, since)
    assert sorted(s.rank for s in spans) == list(range(mesh.world_size))
    assert all(s.extra["executor"] == "allgather" and s.extra["checked"] for s in spans)


def table2(m: int, t: int, d: int, t_g: int, method: str) -> tuple[int, int, int]:
    """HybridFlow Table 2 per rank (p = 1): communication volume, peak parameter memory,
    redundancy."""
    if method == "deepspeed_chat":
        return m * (t * d - 1) // (t * d), m, m // (t * d)
    if method == "vanilla" and t_g < t:
        return m * (t - 1) // t, m, m // t
    return m * (t - t_g) // (t_g * t), m // t_g, 0


def single_process_step(model, train, dp: int, micro: int = 2):
    """The actor's step in one process: each of `dp` replicas' rows in micro-batches of `micro`,
    the mean over replicas, clipping, AdamW."""
    single = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(single.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, weight_decay=0.0)
    per_rank = len(train) // dp
    for rank in range(dp):
        for start in range(0, per_rank, micro):
            rows = train[rank * per_rank + start : rank * per_rank + start + micro]
            loss, _ = losses.reinforce_loss(model_outputs(single, rows), rows)
            (loss * (micro / per_rank) / dp).backward()
    torch.nn.utils.clip_grad_norm_(single.parameters(), OPTIM.grad_clip)
    opt.step()
    return single.eval()


@both(["1-4-1to1-2-2-1", "1-2-2to1-1-2-2"], ["hybridflow"])
def test_tensor_parallel_update_equals_single_process_and_next_generation_uses_it(
    switching_actor, unsharded, tmp_path, monkeypatch
):
    """Two samples per prompt: the ranks' forwards compute each prompt once (KV cache of
    sharded heads, workbench.engines.forward.shared_prompt_logits); the reference step here
    computes every row whole."""
    actor = switching_actor
    tp, dp = actor.mesh.tp, actor.mesh.dp
    model, tokenizer = unsharded
    actor.save_checkpoint(str(tmp_path / "untrained")).get()  # put back at the end: the group is shared
    batch = prompts(tokenizer, 8)
    rolled = actor.generate_sequences(prompts(tokenizer, 4), SamplingConfig(max_new_tokens=10, n=2, seed=3)).get()
    monkeypatch.setattr(forward, "can_share_prompts", lambda model: False)
    scored = actor.compute_log_prob(rolled).get()
    assert ((scored["old_log_probs"] - rolled["rollout_log_probs"]).abs() * rolled["response_mask"]).max() <= 1e-4
    ref = actor.compute_ref_log_prob(rolled).get()["ref_log_probs"]
    assert torch.allclose(ref, scored["old_log_probs"], atol=1e-5)  # nothing trained yet

    train = rolled.union(advantages_for(rolled))
    metrics = actor.update_actor(train, losses.reinforce_loss).get()
    assert metrics["actor/grad_norm"] > 0
    single = single_process_step(model, train, dp)
    trained = load(actor.export_hf(str(tmp_path / "hf")).get()[0]).model.state_dict()
    worst = max((trained[k] - v).abs().max().item() for k, v in single.state_dict().items())
    assert worst <= 1e-5, f"tensor parallel {tp}x{dp} vs single process: max param diff {worst}"

    # The next generation samples from the updated weights: its log-probs are the updated
    # model's on the same tokens, not the old model's (greedy tokens could flip at near-ties).
    after = actor.generate_sequences(batch, GREEDY).get()
    mask = after["response_mask"].bool()
    with torch.no_grad():
        new, old = (model_outputs(m, after)["log_probs"] for m in (single, model))
    to_new = (after["rollout_log_probs"] - new).abs()[mask].max()
    to_old = (after["rollout_log_probs"] - old).abs()[mask].max()
    assert to_new <= 1e-4 and to_old > 20 * to_new, f"generation did not pick up the update: {to_new} vs {to_old}"
    moved = actor.compute_ref_log_prob(rolled).get()["ref_log_probs"]
    assert torch.equal(moved, ref), "the reference must stay frozen"
    assert_checkpoint_roundtrip(actor, train, tmp_path / "ckpt")
    actor.load_checkpoint(str(tmp_path / "untrained")).get()


@both(["1-4-1to1-2-2-1"], ["hybridflow"])
def test_a_corrupted_switch_is_caught_by_the_weight_sync_check_and_the_group_recovers(switching_actor, unsharded):
    actor, (_, tokenizer) = switching_actor, unsharded
    batch = prompts(tokenizer, 4)
    before = actor.generate_sequences(batch, GREEDY).get()
    actor.corrupt_next_switch(0).get()
    with pytest.raises(WorkerCallError, match="weight sync check failed"):
        actor.generate_sequences(batch, GREEDY).get()
    actor.corrupt_next_switch(0, on=False).get()
    after = actor.generate_sequences(batch, GREEDY).get()
    assert torch.equal(after["responses"], before["responses"])


@both(["1-4-1to1-2-2-1"], ["hybridflow"])
def test_the_generation_layout_changes_on_the_live_processes(shared_session, switching_actor, unsharded):
    actor, (model, tokenizer) = switching_actor, unsharded
    pids = [identity[0] for identity in actor.hostset.identities]
    batch = prompts(tokenizer, 4)
    expected = HFRollout(copy.deepcopy(model), tokenizer.pad_token_id, tokenizer.eos_token_id).generate(batch, GREEDY)
    with pytest.raises(DispatchError, match=r"\['tp'\] change the training layout"):
        actor.switch_generation(tp=2)
    with pytest.raises(ConfigError, match="Mesh.transition"):
        actor.switch_generation(transition="broadcast")
    try:
        mesh = actor.switch_generation(gen_tp=1, transition="vanilla")  # the whole model on every rank
        assert (mesh.tp, mesh.gen_tp, mesh.transition) == (4, 1, "vanilla") and actor.mesh == mesh
        since = time.time()
        out = actor.generate_sequences(batch, GREEDY).get()
        assert torch.equal(out["responses"], expected["responses"])
        spans = transitions(shared_session, since)
        assert {s.extra["peak_param_bytes"] for s in spans} == {spans[0].extra["model_bytes"]}
    finally:
        actor.switch_generation(gen_tp=2, transition="hybridflow")
    assert [identity[0] for identity in actor.hostset.identities] == pids, "no process was restarted"


@both(["1-2-2to1-1-2-2"], ["hybridflow"])
def test_a_tensor_parallel_ppo_iteration_end_to_end(shared_session, switching_actor, model_dir, tmp_path):
    actor, tokenizer = switching_actor, load(model_dir).tokenizer
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 4, seed=1)
    batch = tokenize_prompts([p.__dict__ for p in problems], tokenizer, max_prompt_length=32)
    actor.save_checkpoint(str(tmp_path / "untrained")).get()  # put back at the end: the group is shared
    # The critic beside the actor's ranks, on the actor's pool (which holds every device).
    beside = shared_session.slice("critic_pool", "actor_pool", actor.mesh.world_size, 1)
    critic = shared_session.group("critic", CriticWorker, beside, CriticConfig(model_path=model_dir))
    reward = RuleReward(arithmetic.score, processes=1)  # 8 rows a step: one scoring process is plenty
    groups = Groups(actor=actor, reference=actor, critic=critic, reward=reward)
    algo = PPO(groups, PPO.Config(sampling=SamplingConfig(max_new_tokens=6, n=2, seed=0)))
    since = time.time()
    for _ in range(2):
        out, metrics = algo.step(batch)
        assert len(out) == 8 and all(math.isfinite(v) for v in metrics.values()), metrics
        assert metrics["actor/grad_norm"] > 0 and metrics["critic/vf_loss"] > 0
        assert metrics["actor/rollout_logprob_diff"] < 1e-4  # sampled from the weights it trains
    switches = transitions(shared_session, since)
    assert len(switches) == 2 * 4 and all(s.extra["checked"] for s in switches)
    actor.load_checkpoint(str(tmp_path / "untrained")).get()
