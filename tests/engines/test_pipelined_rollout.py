"""Pipelined generation (workbench.engines.pipelined_rollout) on real gloo processes,
pp=2 x tp=2: every rank of a pipeline generates the tokens and log-probs one process generates
with the whole model (greedy, seeded sampling with shared prompts, and a second turn continuing
from each stage's KV cache), and the ranks agree on unseeded samples."""

import copy
import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaForCausalLM

from tests.engines.test_pipeline import config
from workbench.data.batch import Batch
from workbench.engines.hf_rollout import HFRollout, HFRolloutConfig
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError

PAD, EOS = 0, 2


def prompts() -> Batch:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (3, 5), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded prompt
    ids[1, :2] = PAD
    return Batch({"input_ids": ids, "attention_mask": mask})


def _compare(pipelined, whole, rank: int) -> dict:
    """Both engines over the same prompts; what differs between them."""
    out = {}
    cases = {
        "greedy": SamplingConfig(greedy=True, max_new_tokens=6),
        "seeded": SamplingConfig(temperature=1.0, max_new_tokens=6, seed=5, n=2),
    }
    for name, sampling in cases.items():
        a, b = pipelined.generate(prompts(), sampling), whole.generate(prompts(), sampling)
        out[f"{name}_tokens_differ"] = int((a["responses"] != b["responses"]).sum())
        out[f"{name}_log_prob_diff"] = float((a["rollout_log_probs"] - b["rollout_log_probs"]).abs().max())
    # A second turn: each stage's cache of the first turn's context is extended, not recomputed.
    contexts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    greedy = SamplingConfig(greedy=True, max_new_tokens=4)
    turns = {name: engine.turns() for name, engine in (("pipelined", pipelined), ("whole", whole))}
    first = {name: t.generate([0, 1], contexts, greedy) for name, t in turns.items()}
    following = [c + first["whole"]["responses"][i].tolist() + [20, 21] for i, c in enumerate(contexts)]
    second = {name: t.generate([0, 1], following, greedy) for name, t in turns.items()}
    out["turns_continued"] = turns["pipelined"].continued
    out["turn_tokens_differ"] = sum(
        int((step["pipelined"]["responses"] != step["whole"]["responses"]).sum()) for step in (first, second)
    )
    torch.manual_seed(100 + rank)  # the ranks' own random streams differ: they must agree on one
    unseeded = pipelined.generate(prompts(), SamplingConfig(temperature=1.0, max_new_tokens=6, n=2))
    out["unseeded"] = unseeded["responses"].tolist()  # must agree between the pipeline's ranks
    return out


def _worker(rank: int, tp: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    world = 2 * tp
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    from torch.distributed.device_mesh import init_device_mesh

    from workbench.engines.pipeline import PipelinedModel
    from workbench.engines.pipelined_rollout import PipelinedRollout
    from workbench.engines.tensor_parallel import parallelize

    mesh = init_device_mesh("cpu", (1, 2, tp), mesh_dim_names=("dp", "pp", "tp"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config()).eval()
    whole = HFRollout(copy.deepcopy(model), PAD, EOS)
    tp_mesh = mesh["tp"] if tp > 1 else None
    stages = PipelinedModel(parallelize(model, tp_mesh), mesh["pp"])
    pipelined = PipelinedRollout(stages, PAD, EOS, tp_group=tp_mesh.get_group() if tp_mesh else None)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(_compare(pipelined, whole, rank), f)
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_a_pipeline_generates_what_one_process_generates(tmp_path):
    # pp2 x tp2: the hops between stages and the tensor-parallel peers' agreement both (pp2 alone
    # runs through Ray workers in tests/workers/test_pipeline_workers.py).
    tp = 2
    world = 2 * tp
    mp.spawn(_worker, args=(tp, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, result in enumerate(results):
        for name in ("greedy", "seeded"):
            assert result[f"{name}_tokens_differ"] == 0, f"rank {rank} {name}"
            assert result[f"{name}_log_prob_diff"] <= 1e-5, f"rank {rank} {name}"
        assert result["turn_tokens_differ"] == 0 and result["turns_continued"] == 1, f"rank {rank}"
        # Every rank of the replica, tensor-parallel peers included.
        assert result["unseeded"] == results[0]["unseeded"], f"rank {rank} sampled other tokens than rank 0"


def test_what_pipelined_generation_cannot_run_is_refused_before_any_stage_is_touched():
    from workbench.engines.pipelined_rollout import check_pipelined_rollout

    with pytest.raises(ConfigError, match=r"dynamic KV cache"):
        check_pipelined_rollout("ActorConfig", True, HFRolloutConfig(compile=True))
    # A stage's cache and mask are full causal attention's: sliding-window layers are refused.
    sliding = config(layer_types=["full_attention", "sliding_attention"] * 2)
    with pytest.raises(ConfigError, match=r"model_path.*sliding-window layers"):
        check_pipelined_rollout("ActorConfig", True, HFRolloutConfig(), sliding)
    check_pipelined_rollout("ActorConfig", True, HFRolloutConfig(), config())
