"""Packed forwards and token-budget micro-batches on real worker groups (2 Ray processes, gloo):
FSDP2, FSDP2 with LoRA, DeepSpeed ZeRO-3, tensor parallel and pipeline stages. Each actor scores
like one process's padded forward and takes the update one process takes over the same rows by
row count. Rank 0's rows are long and rank 1's short, so under the token budget rank 0 needs more
micro-batches than rank 1 by itself: the ranks must agree on one count (FSDP and ZeRO-3 gather
weights in every forward and would wait forever otherwise). Pipeline stages take 2D masks: they
refuse packing by name, and run padded under the budget."""

import copy

import pytest
import ray
import torch

import tests.workers.losses as losses
from tests.workers.reference import OPTIM, prompts
from workbench import Batch, Mesh
from workbench.engines.forward import model_outputs
from workbench.errors import ConfigError
from workbench.models import load, make_tiny
from workbench.models.lora import LoRAConfig, apply_lora
from workbench.workers import ActorConfig, ActorRolloutRefWorker

ray.cloudpickle.register_pickle_by_value(losses)

BUDGET = 48
CASES = {
    "fsdp": ({"backend": "fsdp"}, Mesh(dp=2)),
    "fsdp-lora": ({"backend": "fsdp", "lora": LoRAConfig(rank=4, alpha=8.0)}, Mesh(dp=2)),
    "zero3": ({"backend": "deepspeed", "zero_stage": 3}, Mesh(dp=2)),
    "tp2": ({"backend": "3d"}, Mesh(tp=2, gen_tp=2)),
    "pp2": ({"backend": "3d", "packing": None}, Mesh(pp=2, gen_pp=1, gen_tp=1)),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny("1m", tmp_path_factory.mktemp("tiny") / "actor", seed=7))


def training_rows(tokenizer) -> Batch:
    """8 rows, 2 per prompt: rank 0's four with 20-24 response tokens, rank 1's with 1-4."""
    batch = prompts(tokenizer, 4).repeat(2, interleave=True)
    g = torch.Generator().manual_seed(0)
    r = 24
    lengths = torch.tensor([24, 20, 22, 21, 1, 4, 2, 3])
    response_mask = (torch.arange(r)[None, :] < lengths[:, None]).long()
    responses = torch.randint(5, 200, (len(batch), r), generator=g) * response_mask
    attention = torch.cat([batch["attention_mask"], response_mask], 1)
    return Batch(
        {
            "input_ids": torch.cat([batch["input_ids"], responses], 1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": response_mask,
            "advantages": torch.linspace(-1.0, 1.0, len(batch)),
        }
    )


def one_process_step(model, train: Batch):
    """The update in one process: every row in one padded forward, the mean loss, clipping, AdamW."""
    single = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(
        [p for p in single.parameters() if p.requires_grad],
        lr=OPTIM.lr,
        betas=OPTIM.betas,
        eps=OPTIM.eps,
        weight_decay=0.0,
    )
    loss, _ = losses.reinforce_loss(model_outputs(single, train), train)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in single.parameters() if p.requires_grad], OPTIM.grad_clip)
    opt.step()
    return single.eval()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_packed_budgeted_actor_scores_and_steps_like_one_padded_process(session, model_dir, case):
    extra, mesh = CASES[case]
    config = ActorConfig(
        model_path=model_dir,
        rollout=None,
        optim=OPTIM,
        mini_batch_size=8,
        micro_batch_size=4,
        max_tokens_per_micro_batch=BUDGET,
        **{"packing": True, **extra},
    )
    actor = session.group("actor", ActorRolloutRefWorker, session.pool("packed", 2), config, mesh=mesh)
    torch.manual_seed(config.seed)  # as the worker does before it loads: LoRA's A starts alike
    loaded = load(model_dir)
    model = loaded.model
    if config.lora is not None:
        model = apply_lora(model, config.lora)
    train = training_rows(loaded.tokenizer)
    with torch.no_grad():
        before = model_outputs(model.eval(), train)["log_probs"]
    scored = actor.compute_log_prob(train).get()["old_log_probs"]
    assert (scored - before).abs().max() <= 1e-5

    metrics = actor.update_actor(train, losses.reinforce_loss).get()
    assert metrics["actor/grad_norm"] > 0
    single = one_process_step(model, train)
    with torch.no_grad():
        want = model_outputs(single, train)["log_probs"]
    got = actor.compute_log_prob(train).get()["old_log_probs"]
    moved, off = (before - want).abs().max(), (got - want).abs().max()
    assert off <= 1e-4 and moved > 20 * off, f"{case}: off the one-process step by {off} (the step moved {moved})"


def test_pipeline_stages_refuse_packing_by_name_on_the_driver(session, model_dir):
    config = ActorConfig(model_path=model_dir, rollout=None, backend="3d", packing=True, optim=OPTIM)
    with pytest.raises(ConfigError, match=r"ActorConfig.packing.*pipeline-parallel"):
        session.group("actor", ActorRolloutRefWorker, session.pool("packed", 2), config, mesh=CASES["pp2"][1])
