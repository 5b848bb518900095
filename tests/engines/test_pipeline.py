"""Pipeline parallelism (backend "3d", pp > 1) on real gloo processes: pp=2, pp=2 x tp=2 and
dp=2 x pp=2, one after another on the same 4 ranks (one spawn for the module).

Every rank also builds the unsplit model and steps it in one process (the tensor-parallel engine
with no tensor parallelism: plain AdamW, the same clipping); the pipelined engine must match it
within 1e-5 — scoring forwards (log-probs, values), a PPO actor step and a value-loss critic
step (loss metrics, grad norm, every weight after the step), `full_weights()`, and a checkpoint
saved after one step, loaded after another, and stepped again; a NaN loss skips the step on
every rank.
"""

import copy
import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

from algorithms import core
from algorithms.losses import ActorLoss, CriticLoss
from workbench.data.batch import Batch
from workbench.engines.accumulation import NonFiniteStep
from workbench.engines.contract import OptimConfig, needs
from workbench.engines.forward import model_outputs, response_log_probs, response_values
from workbench.engines.pipeline import PipelineEngine
from workbench.engines.pipeline_stages import check_pipeline
from workbench.engines.tensor_parallel import TensorParallelEngine
from workbench.errors import ConfigError

# Adam's first steps move every weight by about lr whatever its gradient, so a gradient near
# eps rounded differently by a tensor-parallel all-reduce moves it by up to ~lr/250 differently:
# 1e-3 keeps that inside TOL while the step itself moves weights 100x TOL.
OPTIM = OptimConfig(lr=1e-3, grad_clip=1.0)
TOL = 1e-5


def config(**kw) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        **kw,
    )


def models():
    torch.manual_seed(0)
    actor = LlamaForCausalLM(config())
    torch.manual_seed(1)
    critic = LlamaForTokenClassification(config(num_labels=1, classifier_dropout=0.0))
    return actor, critic


def batch(rows: int = 4, prompt: int = 5, response: int = 4) -> Batch:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left-padded prompts
    mask[2, :1] = 0
    response_mask = torch.ones(rows, response, dtype=torch.long)
    response_mask[0, 3:] = 0  # right-padded responses
    response_mask[3, 2:] = 0
    mask[:, prompt:] = response_mask
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": position_ids,
            "responses": ids[:, prompt:],
            "response_mask": response_mask,
            "advantages": torch.randn(rows, response, generator=g),
            "old_log_probs": -4 - torch.rand(rows, response, generator=g),
            "returns": torch.randn(rows, response, generator=g),
            "values": torch.randn(rows, response, generator=g),
        }
    )


def forward_for(loss_fn):
    wanted = needs(loss_fn, ("log_probs",))
    return lambda model, mb: model_outputs(model, mb, wanted)


def diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def metric_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) for k in a)


class Poisoned:
    """`loss` times NaN: a step whose gradient norm is not finite."""

    def __init__(self, loss):
        self.loss, self.needs = loss, loss.needs

    def weight(self, batch):
        return self.loss.weight(batch)

    def __call__(self, outputs, batch):
        loss, metrics = self.loss(outputs, batch)
        return loss * float("nan"), metrics


def _check(name, model, loss_fn, score, data, pp_mesh, tp_mesh, dp_mesh, ckpt) -> dict:
    """Each data-parallel replica takes its share of the rows; the one-process step takes them all."""
    dp, d = (dp_mesh.size(), dp_mesh.get_local_rank()) if dp_mesh is not None else (1, 0)
    mine = data[2 * d : 2 * d + 2] if dp == 2 else data
    # At dp=1 uneven micro-batches (3 rows, then 1 with a shorter response): the schedule's
    # inputs are padded to one shape, and the padding must not reach the loss.
    micro = [mine[:1], mine[1:]] if dp == 2 else [data[:3], data[3:]]
    whole = [data[:2], data[2:]] if dp == 2 else micro
    # Loss metrics are each replica's own rows (workers average them over ranks): compared at dp=1.
    compared = (lambda m: m) if dp == 1 else (lambda m: {"grad_norm": m["grad_norm"]})  # noqa: E731
    reference = TensorParallelEngine(copy.deepcopy(model), OPTIM, None)
    engine = PipelineEngine(model, OPTIM, pp_mesh, tp_mesh, dp_mesh.get_group() if dp > 1 else None)
    engine.model.eval()
    with torch.no_grad():
        scored = score(engine.model, mine) - score(reference.model.eval(), mine)
    out = {
        "score": float(scored.abs().max()),
        "full_weights_start": diff(engine.full_weights(), reference.full_weights()),
    }
    forward = forward_for(loss_fn)
    got, want = engine.train_step(loss_fn, micro, forward), reference.train_step(loss_fn, whole, forward)
    out["metrics"] = metric_diff(compared(got), compared(want))
    out["weights_after_step"] = diff(engine.full_weights(), reference.full_weights())
    out["grad_norm"] = got["grad_norm"]
    engine.save(os.path.join(ckpt, name))
    after_save = engine.full_weights()
    engine.train_step(loss_fn, micro, forward)
    engine.load(os.path.join(ckpt, name))
    out["loaded"] = diff(engine.full_weights(), after_save)
    got, want = engine.train_step(loss_fn, micro, forward), reference.train_step(loss_fn, whole, forward)
    out["step_after_load"] = max(
        metric_diff(compared(got), compared(want)), diff(engine.full_weights(), reference.full_weights())
    )
    before = engine.full_weights()
    try:
        engine.train_step(Poisoned(loss_fn), micro, forward)
        out["nan_step_not_refused"] = 1.0
    except NonFiniteStep:  # on every rank: the norm is global
        out["nan_step_not_refused"] = 0.0
    out["nan_step_changed_weights"] = diff(engine.full_weights(), before)
    return out


def _roles(layout: str, pp_mesh, tp_mesh, dp_mesh, ckpt: str) -> dict:
    actor, critic = models()
    data = batch()
    actor_loss = ActorLoss(core.ppo_clip, entropy_coeff=0.01)

    def log_probs(m, b):
        return response_log_probs(m, b, with_entropy=True)[0]

    meshes = (pp_mesh, tp_mesh, dp_mesh, ckpt)
    return {
        "actor": _check(f"{layout}-actor", actor, actor_loss, log_probs, data, *meshes),
        "critic": _check(f"{layout}-critic", critic, CriticLoss(), response_values, data, *meshes),
    }


WORLD = 4


def _worker(rank: int, store: str, out_dir: str) -> None:
    """Every layout on the same 4 ranks, one after another (process starts, not the tiny
    models' steps, are what these runs cost)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    from torch.distributed.device_mesh import init_device_mesh

    names = ("dp", "pp", "tp")  # the workers' order
    tp2 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=names)
    dp2 = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=names)
    results = {
        "pp2xtp2": _roles("pp2xtp2", tp2["pp"], tp2["tp"], None, out_dir),
        # pp=2 alone: each pp group of the dp=2 mesh is a pipeline of its own (no data-parallel
        # group), both run the pp2 layout side by side on the whole batch.
        "pp2": _roles("pp2", dp2["pp"], None, None, out_dir),
        "dp2xpp2": _roles("dp2xpp2", dp2["pp"], None, dp2["dp"], out_dir),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's checks of every layout: one spawn of 4 gloo processes for all three."""
    out = tmp_path_factory.mktemp("pipeline")
    mp.spawn(_worker, args=(str(out / "store"), str(out)), nprocs=WORLD, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("layout", ["pp2", "pp2xtp2", "dp2xpp2"])
def test_pipelined_steps_scores_and_checkpoints_equal_one_process(ranks, layout):
    for rank, result in enumerate(ranks):
        for role, checks in result[layout].items():
            assert checks["grad_norm"] > 0
            for what, value in checks.items():
                if what != "grad_norm":
                    assert value <= TOL, f"rank {rank} {layout} {role} {what}: {value}"


def test_a_pipeline_that_does_not_divide_the_layers_is_refused():
    with pytest.raises(ConfigError, match=r"num_hidden_layers.*pp=3"):
        check_pipeline(config(), 3)
    with pytest.raises(ConfigError, match=r"tie_word_embeddings"):
        check_pipeline(LlamaConfig(num_hidden_layers=2, tie_word_embeddings=True), 2)
