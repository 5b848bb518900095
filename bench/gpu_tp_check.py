"""The tensor-parallel engine and the 3D-HybridEngine's switch with CUDA tensors, several ranks on
one GPU (the companion of bench/gpu_check.py for a machine with a single GPU).

NCCL refuses two ranks on one GPU, so these ranks talk over gloo while every tensor lives on the
GPU: what is checked is the CUDA side of the code (parameters, pieces, buffers, checksums and
generation on the device), not NCCL. For each method: a training step of a tp=4 model against the
same step of the unsharded model on the GPU, the switch to gen_tp=2 with its counted bytes against
`hybrid.layouts`, the weight-sync check, and greedy generation against the unsharded model.
Last line: one JSON object.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workbench.controller.mesh import Mesh
from workbench.engines.contract import OptimConfig
from workbench.engines.forward import model_outputs
from workbench.engines.tensor_parallel import TensorParallelEngine, parallelize
from workbench.hybrid import layouts
from workbench.hybrid.transition import HybridEngine
from workbench.models import load, make_tiny

WORLD, TP, GEN_TP = 4, 4, 2


def loss_fn(outputs, batch):
    return -outputs["log_probs"].mean(), {}


def rank_main(rank: int, model_dir: str, method: str, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    device = torch.device("cuda", 0)
    model = load(model_dir).model.to(device)
    single, gen = copy.deepcopy(model), copy.deepcopy(model)
    mesh = Mesh(tp=TP, gen_tp=GEN_TP, transition=method)
    train_mesh = init_device_mesh("cuda", (mesh.dp, mesh.tp), mesh_dim_names=("dp", "tp"))
    engine = TensorParallelEngine(model, OptimConfig(lr=1e-5), train_mesh["tp"], None)
    gen_mesh = DeviceMesh("cuda", torch.tensor(layouts.generation_groups(mesh)), mesh_dim_names=("replica", "tp"))
    parallelize(gen, gen_mesh["tp"])
    hybrid = HybridEngine(engine.model, gen, mesh, rank, tp_group=engine.tp_group, gen_tp_group=gen_mesh["tp"].get_group())

    torch.manual_seed(0)
    ids = torch.randint(3, 200, (4, 12), device=device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(12, device=device).expand(4, -1),
             "responses": ids[:, 6:], "response_mask": torch.ones_like(ids[:, 6:])}
    from workbench import Batch
    batch = Batch(batch)
    engine.train_step(loss_fn, [batch], lambda m, mb: model_outputs(m, mb))
    opt = torch.optim.AdamW(single.parameters(), lr=1e-5)
    single.train()
    loss_fn(model_outputs(single, batch), batch)[0].backward()
    torch.nn.utils.clip_grad_norm_(single.parameters(), 1.0)
    opt.step()
    worst = max((engine.full_weights()[k].float() - v.float()).abs().max().item() for k, v in single.state_dict().items())

    stats = hybrid.to_generation()
    with torch.no_grad():
        out = gen.generate(ids[:, :6], max_new_tokens=8, do_sample=False)
        expected = single.eval().generate(ids[:, :6], max_new_tokens=8, do_sample=False)
    hybrid.to_training()
    want = layouts.transition_bytes(mesh, stats.model_bytes)[rank]
    result = {
        "method": method, "rank": rank, "device": str(next(engine.model.parameters()).device),
        "step_max_param_diff": worst, "generation_equal": bool(torch.equal(out, expected)),
        "bytes_as_layouts": (stats.bytes_received, stats.peak_param_bytes, stats.redundant_bytes)
        == (want.received, want.peak_params, want.redundant),
        "checked": stats.checked, "switch_seconds": stats.seconds,
    }
    with open(f"{out_dir}/{method}-{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU here: run this on a GPU machine")
        return 2
    root = tempfile.mkdtemp()
    model_dir = str(make_tiny("1m", f"{root}/m", seed=5))
    results = []
    for i, method in enumerate(("hybridflow", "vanilla", "deepspeed_chat")):
        mp.spawn(rank_main, args=(model_dir, method, 29600 + i, root), nprocs=WORLD)
        results += [json.load(open(f"{root}/{method}-{r}.json")) for r in range(WORLD)]
    failures = [r for r in results if not (r["generation_equal"] and r["bytes_as_layouts"] and r["checked"]
                                           and r["step_max_param_diff"] <= 1e-5 and r["device"].startswith("cuda"))]
    for r in results:
        print(r)
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "ranks": WORLD, "tp": TP,
                      "gen_tp": GEN_TP, "backend": "gloo (CUDA tensors)", "failures": len(failures), "results": results}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
