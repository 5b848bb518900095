"""The GPU path, checked where a GPU exists (CUDA tensors, NCCL process groups): one-rank worker
groups of every kind on one GPU, each result compared with the same computation on the CPU in
this process. CI has no GPU; this runs on a lent GPU machine (see bench/README.md, On a GPU).

With one GPU every group has one rank: NCCL initialises and runs its collectives (the metric
all-reduces, the gradient-weight all-reduce, FSDP2's reduce-scatter) over a world of one.
Multi-rank NCCL needs a machine with several GPUs.

Checks (each prints its figure; the script exits non-zero if one fails):
- actor (FSDP2, bf16 compute on GPU): greedy generation equals the CPU model's; training log-probs
  close to the CPU's; an update moves the weights like the CPU step (bf16 tolerance);
- actor (backend "3d", fp32): log-probs and the update equal the CPU's to fp32 precision;
- critic values and reward scores equal the CPU's (fp32) / close (bf16 reward model);
- the hybrid engine's weight sync and the rollout's log-probs on the GPU.
Last line: one JSON object.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time

import torch

from workbench import Batch, Session
from workbench.controller.resource_pool import device_resource
from workbench.data.prompts import tokenize_prompts
from workbench.engines.contract import OptimConfig
from workbench.engines.forward import model_outputs, response_log_probs, response_values
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.rollout import SamplingConfig
from workbench.models import load, make_tiny
from workbench.models.value import load_value_model
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.reward import RewardModelWorker, ScoreModelConfig

OPTIM = OptimConfig(lr=1e-4, grad_clip=1.0)
GREEDY = SamplingConfig(max_new_tokens=12, greedy=True)


def reinforce_loss(outputs, batch):
    log_probs = outputs["log_probs"]
    loss = -(batch["advantages"] * (log_probs * batch["response_mask"]).sum(1)).mean()
    return loss, {"loss": loss.item()}


def cpu_step(model, train, micro: int):
    single = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(single.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, weight_decay=0.0)
    for start in range(0, len(train), micro):
        rows = train[start : start + micro]
        loss, _ = reinforce_loss(model_outputs(single, rows), rows)
        (loss * micro / len(train)).backward()
    torch.nn.utils.clip_grad_norm_(single.parameters(), OPTIM.grad_clip)
    opt.step()
    return single.eval()


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float().cpu() - v.float()).abs().max().item() for k, v in b.items())


def main() -> int:
    results, failures = {}, []

    def check(name, value, ok):
        results[name] = value
        print(f"{name:<40} {value!r:<28} {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            failures.append(name)

    root = tempfile.mkdtemp()
    model_dir = str(make_tiny("1m", f"{root}/policy", seed=3))
    session = Session(num_devices=1)
    try:
        check("device resource", device_resource(), device_resource() == "GPU")
        cpu = load(model_dir)
        model, tokenizer = cpu.model.eval(), cpu.tokenizer
        rows = [{"prompt": f"Q: {i}+{i + 3}=? A:", "ground_truth": str(2 * i + 3)} for i in range(8)]
        prompts = tokenize_prompts(rows, tokenizer, max_prompt_length=32)
        expected = HFRollout(copy.deepcopy(model), tokenizer.pad_token_id, tokenizer.eos_token_id).generate(
            prompts, GREEDY
        )

        for backend in ("fsdp", "3d"):
            cfg = ActorConfig(
                model_path=model_dir,
                backend=backend,
                reference=True,
                optim=OPTIM,
                mini_batch_size=8,
                micro_batch_size=4,
            )
            actor = session.group("actor", ActorRolloutRefWorker, session.pool("gpu", 1), cfg)
            start = time.time()
            out = actor.generate_sequences(prompts, GREEDY).get()
            same = float((out["responses"] == expected["responses"]).all(1).float().mean())
            check(f"{backend}: greedy rows equal to CPU", same, same >= 0.75)
            scored = actor.compute_log_prob(out).get()
            mask = out["response_mask"].bool()
            with torch.no_grad():
                cpu_lp, _ = response_log_probs(model, out)
            gap = float((scored["old_log_probs"] - cpu_lp.detach()).abs()[mask].max())
            check(f"{backend}: log-prob max |GPU - CPU|", gap, gap <= (5e-2 if backend == "fsdp" else 1e-3))
            ref = actor.compute_ref_log_prob(out).get()["ref_log_probs"]
            ref_gap = float((ref - cpu_lp).abs()[mask].max())
            check(f"{backend}: reference log-prob |GPU - CPU|", ref_gap, ref_gap <= 1e-3)
            drift = float(
                ((out["rollout_log_probs"] - scored["old_log_probs"]).abs() * out["response_mask"]).sum() / mask.sum()
            )
            check(f"{backend}: rollout_logprob_diff", drift, drift <= (5e-2 if backend == "fsdp" else 1e-3))
            train = out.union(Batch({"advantages": torch.linspace(-1.0, 1.0, len(out))}))
            metrics = actor.update_actor(train, reinforce_loss).get()
            check(
                f"{backend}: update grad_norm finite",
                metrics["actor/grad_norm"],
                torch.isfinite(torch.tensor(metrics["actor/grad_norm"])).item(),
            )
            single = cpu_step(model, train, 4)
            trained = load(actor.export_hf(f"{root}/export_{backend}").get()[0]).model.state_dict()
            moved = max_diff(trained, single.state_dict())
            check(f"{backend}: weights max |GPU - CPU step|", moved, moved <= (1e-3 if backend == "fsdp" else 1e-5))
            # bf16 compute flips the sign of tiny gradients (Adam then moves them by +-lr): the
            # step's direction over all weights is what must agree.
            init = model.state_dict()
            # in float64: an fp32 cosine over a million weights is off by ~1e-3
            gpu_delta = torch.cat([(trained[k].double().cpu() - v.double()).reshape(-1) for k, v in init.items()])
            cpu_delta = torch.cat([(single.state_dict()[k].double() - v.double()).reshape(-1) for k, v in init.items()])
            cosine = float(torch.nn.functional.cosine_similarity(gpu_delta, cpu_delta, dim=0))
            check(
                f"{backend}: step direction cosine(GPU, CPU)", cosine, cosine >= (0.9 if backend == "fsdp" else 0.999)
            )
            after = actor.generate_sequences(prompts, GREEDY).get()
            fresh = HFRollout(single, tokenizer.pad_token_id, tokenizer.eos_token_id).generate(prompts, GREEDY)
            same = float((after["responses"] == fresh["responses"]).all(1).float().mean())
            check(f"{backend}: greedy after update equal", same, same >= (0.5 if backend == "fsdp" else 0.75))
            results[f"{backend}: seconds"] = round(time.time() - start, 2)
            session.clear()

        scorer = load_value_model(model_dir)
        scorer.model.save_pretrained(f"{root}/scorer")
        scorer.tokenizer.save_pretrained(f"{root}/scorer")
        critic = session.group(
            "critic",
            CriticWorker,
            session.pool("gpu", 1),
            CriticConfig(model_path=f"{root}/scorer", mini_batch_size=8, micro_batch_size=4),
        )
        values = critic.compute_values(out).get()["values"]
        cpu_values = response_values(scorer.model.eval(), out) * out["response_mask"]
        gap = float((values - cpu_values).abs().max())
        check("critic: values |GPU - CPU|", gap, gap <= 5e-2)
        session.clear()
        reward = session.group("reward", RewardModelWorker, session.pool("gpu", 1), ScoreModelConfig(f"{root}/scorer"))
        scores = reward.compute_reward(out).get()["scores"]
        check("reward: scores finite", float(scores.abs().max()), bool(torch.isfinite(scores).all()))
        session.clear()
        results["torch"] = torch.__version__
        results["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    finally:
        session.shutdown()
    results["failures"] = failures
    print(json.dumps(results))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
