"""The real-model paths on a GPU (issues 23 and 25), each compared with the same computation on
the CPU in this process; bench/gpu_check.py checks the worker groups' basic GPU path.

Sections (one-rank FSDP2 worker groups on one GPU, NCCL; each prints name/value/ok rows):
- chunked: token_log_probs over a 65,536-token vocabulary (three 64 MiB chunks) against a
  float64 full softmax, its entropy and gradients, fp32 and bf16 logits; on CUDA the chunked
  forward and backward peak below the one-shot log-softmax's;
- lora (fp32 compute; again with bf16 compute and gradient checkpointing): the reference (adapters
  disabled) equals the adapted model before the first update and stays put after it; the
  update moves the adapters like a CPU peft step from the same initial adapters; log-probs,
  before and after, close to the CPU's; the rollout generates with the updated adapters;
- vocab (fp32 compute; again bf16 + gradient checkpointing): an actor on a tiny Llama with a
  65,536-token vocabulary (the chunked path in rollout, scoring and training): log-probs and
  entropy against a float64 full softmax on the CPU, an update with an entropy bonus against a
  CPU step, the CUDA allocator's peak in the memory metrics the runner logs;
- chat: chat-template prompts with stop strings and stop token ids, greedy, equal to the CPU
  rollout's; multi-turn episodes with the calculator tool in its sandbox (masks, turn ends,
  observations, the same seed the same episodes); a training forward re-scores the rollout's
  log-probs; an update on episodes against a CPU step.

    PYTHONPATH=. python bench/gpu_check_real.py          # on a GPU machine (bench/gpu_run.sh)
    PYTHONPATH=. python bench/gpu_check_real.py --cpu    # the same code on the CPU: a dry run

Tolerances: fp32 compute on the GPU matches the CPU to 1e-3 in log-probs, 1e-3 in gradient
norm; bf16 compute to 5e-2 in log-probs and gradient norm, 0.9 in step direction (cosine). One
Adam step moves a weight by at most lr, so two first steps never differ by more than 2 lr.
Exits non-zero if a check fails. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import traceback

import torch

# bench/gpu_check.py: run as `python bench/<script>.py`, this folder is on sys.path
from gpu_check import GREEDY, OPTIM, reinforce_loss

from tests.chat_kit import make_tiny_chat
from workbench import Batch, Session
from workbench.agents import ToolEnvironment, calculator
from workbench.controller.resource_pool import device_resource
from workbench.data.prompts import tokenize_prompts
from workbench.engines import forward
from workbench.engines.forward import model_outputs, pad_responses, response_log_probs, response_logits, trim_padding
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.multi_turn import EpisodeConfig
from workbench.engines.rollout import SamplingConfig, end_token_ids
from workbench.models import load, make_tiny
from workbench.models.load import LoadConfig
from workbench.models.lora import LoRAConfig, is_trained
from workbench.tracing import GIB, memory_metrics
from workbench.workers import ActorConfig, ActorRolloutRefWorker

VOCAB = 65_536
"""A real model's vocabulary size: 256 rows per 64 MiB chunk on a GPU, 16 per 4 MiB on the CPU."""
FP32, BF16_GC = "fp32", "bf16+gc"
PRECISIONS = {
    FP32: LoadConfig(compute_dtype="float32"),
    BF16_GC: LoadConfig(compute_dtype="bfloat16", gradient_checkpointing=True),
}
LOG_PROB_TOL = {FP32: 1e-3, BF16_GC: 5e-2}
NORM_TOL = {FP32: 1e-3, BF16_GC: 5e-2}
COSINE_MIN = {FP32: 0.999, BF16_GC: 0.9}
ONE_STEP = 2 * OPTIM.lr + 1e-6


class Report:
    """name/value/ok rows as they come; the failures' names."""

    def __init__(self):
        self.results, self.failures = {}, []

    def check(self, name: str, value, ok: bool) -> None:
        self.results[name] = value
        print(f"{name:<56} {value!r:<28} {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            self.failures.append(name)


def entropy_bonus_loss(outputs, batch):
    """REINFORCE with an entropy bonus: the training step runs the chunked entropy's backward too."""
    loss, metrics = reinforce_loss(outputs, batch)
    entropy = (outputs["entropy"] * batch["response_mask"]).sum() / batch["response_mask"].sum()
    return loss - 0.01 * entropy, {**metrics, "entropy": entropy.item()}


entropy_bonus_loss.needs = ("log_probs", "entropy")


def cpu_step(model, train: Batch, micro: int, loss_fn):
    """One AdamW step of a copy of `model` over `train` in micro-batches, as the engines take it
    (rows-weighted accumulation, global-norm clipping): (stepped model, gradient norm)."""
    single = copy.deepcopy(model).train()
    trained = [p for p in single.parameters() if p.requires_grad]  # the adapters alone under LoRA
    opt = torch.optim.AdamW(trained, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, weight_decay=0.0)
    wanted = getattr(loss_fn, "needs", ("log_probs",))
    for start in range(0, len(train), micro):
        rows = train[start : start + micro]
        loss, _ = loss_fn(model_outputs(single, rows, wanted), rows)
        (loss * len(rows) / len(train)).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(trained, OPTIM.grad_clip))
    opt.step()
    return single.eval(), norm


def rows_equal(a: Batch, b: Batch, *keys: str) -> float:
    """The fraction of rows where every one of `keys` is equal in `a` and `b`."""
    same = torch.stack([(a[key] == b[key]).all(1) for key in keys]).all(0)
    return float(same.float().mean())


def with_advantages(batch: Batch) -> Batch:
    return batch.union(Batch({"advantages": torch.linspace(-1.0, 1.0, len(batch))}))


def masked_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs()[mask.bool()].max())


def step_agreement(report, name, init: dict, gpu: dict, cpu: dict, precision: str, max_gap: float) -> None:
    """The GPU step against the CPU step from the same start: direction and largest difference."""
    # float64: over millions of weights an fp32 cosine is off by ~1e-3 (0.998 for equal steps)
    gpu_delta = torch.cat([(gpu[k].double().cpu() - v.double()).reshape(-1) for k, v in init.items()])
    cpu_delta = torch.cat([(cpu[k].double() - v.double()).reshape(-1) for k, v in init.items()])
    cosine = float(torch.nn.functional.cosine_similarity(gpu_delta, cpu_delta, dim=0))
    report.check(f"{name}: step direction cosine(GPU, CPU)", cosine, cosine >= COSINE_MIN[precision])
    gap = max(float((gpu[k].float().cpu() - cpu[k].float()).abs().max()) for k in init)
    report.check(f"{name}: weights max |GPU - CPU step|", gap, gap <= max_gap)


def grad_norm_agreement(report, name, metrics: dict, cpu_norm: float, precision: str) -> None:
    ratio = metrics["actor/grad_norm"] / cpu_norm
    report.check(f"{name}: grad_norm GPU / CPU", ratio, abs(ratio - 1) <= NORM_TOL[precision])


def arithmetic_prompts(tokenizer) -> Batch:
    rows = [{"prompt": f"Q: {i}+{i + 3}=? A:", "ground_truth": str(2 * i + 3)} for i in range(8)]
    return tokenize_prompts(rows, tokenizer, max_prompt_length=32)


# ---- chunked log-probs, on the driver's device --------------------------------------------------
def check_chunked_kernel(report: Report, device: str) -> None:
    """ChunkedLogProbs on `device` against the float64 full softmax: log-probs, entropy and the
    gradient of a weighted sum of both, at T = 0.7; then from bf16 logits; then peak memory."""
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 300, VOCAB, generator=generator)
    tokens = torch.randint(0, VOCAB, (2, 300), generator=generator).to(device)
    weights = torch.randn(2, 2, 300, generator=generator, dtype=torch.float64).to(device)
    logits = logits.to(device)
    rows = forward.CHUNK_ELEMENTS["cpu" if device == "cpu" else "other"] // VOCAB
    report.results["chunked: rows per chunk"] = rows

    def run(leaf, exact: bool):
        if exact:
            log_p = torch.log_softmax(leaf / 0.7, -1)
            picked, entropy = log_p.gather(-1, tokens[..., None])[..., 0], -(log_p.exp() * log_p).sum(-1)
        else:
            picked, entropy = forward.token_log_probs(leaf, tokens, 0.7, with_entropy=True)  # chunked by size
        ((weights[0] * picked).sum() + (weights[1] * entropy).sum()).backward()
        return picked.detach().double(), entropy.detach().double(), leaf.grad.double()

    for dtype in (torch.float32, torch.bfloat16):
        values = logits.to(dtype)
        exact = run(values.double().requires_grad_(), exact=True)
        chunked = run(values.clone().requires_grad_(), exact=False)
        for what, got, truth in zip(("log-probs", "entropy", "gradient"), chunked, exact):
            # relative to the largest value: fp32 holds log-probs of -20 to ~2e-6
            gap = float((got - truth).abs().max()) / max(1.0, float(truth.abs().max()))
            tol = 1e-5 if what != "gradient" or dtype == torch.float32 else 1e-2  # bf16 gradients round
            report.check(f"chunked {str(dtype)[6:]}: {what} |chunked - float64|", gap, gap <= tol)
        del exact, chunked
    if device != "cpu":
        peaks = {}
        for by_chunks in (True, False):
            leaf = logits.clone().requires_grad_()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            picked, entropy = forward.token_log_probs(leaf, tokens, 0.7, with_entropy=True, chunked=by_chunks)
            ((weights[0] * picked).sum() + (weights[1] * entropy).sum()).backward()
            torch.cuda.synchronize()
            peaks[by_chunks] = (torch.cuda.max_memory_allocated() - base) / 2**20
            del leaf, picked, entropy
        report.results["chunked: one-shot peak MiB"] = round(peaks[False], 1)
        report.check("chunked: peak MiB above the logits", round(peaks[True], 1), peaks[True] < peaks[False])
        del logits, tokens, weights
        torch.cuda.empty_cache()  # the workers share this GPU


# ---- LoRA actor ---------------------------------------------------------------------------------
def adapters(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu() for k, v in model.named_parameters() if is_trained(k)}


def peft_from(model_dir: str, adapter_dir: str, trainable: bool = False):
    from peft import PeftModel

    return PeftModel.from_pretrained(load(model_dir).model, adapter_dir, is_trainable=trainable).eval()


def check_lora(report: Report, session: Session, model_dir: str, root: str, precision: str) -> None:
    name = f"lora {precision}"
    cfg = ActorConfig(
        model_path=model_dir,
        reference=True,
        optim=OPTIM,
        mini_batch_size=8,
        micro_batch_size=4,
        lora=LoRAConfig(rank=8),
        load=PRECISIONS[precision],
    )
    actor = session.group("lora", ActorRolloutRefWorker, session.pool("gpu", 1), cfg)
    cpu = load(model_dir)
    base, tokenizer = cpu.model.eval(), cpu.tokenizer
    prompts = arithmetic_prompts(tokenizer)
    out = actor.generate_sequences(prompts, GREEDY).get()
    mask = out["response_mask"]
    if precision == FP32:
        rollout = HFRollout(copy.deepcopy(base), tokenizer.pad_token_id, tokenizer.eos_token_id)
        same = rows_equal(out, rollout.generate(prompts, GREEDY), "responses")
        report.check(f"{name}: greedy rows equal to the CPU base's", same, same >= 0.75)
    adapted = actor.compute_log_prob(out).get()["old_log_probs"]
    ref = actor.compute_ref_log_prob(out).get()["ref_log_probs"]
    gap = masked_gap(adapted, ref, mask)
    report.check(f"{name}: |adapted - reference| before update", gap, gap == 0.0)  # B = 0: base exactly
    with torch.no_grad():
        cpu_lp, _ = response_log_probs(base, out)
    gap = masked_gap(ref, cpu_lp, mask)
    report.check(f"{name}: reference |GPU - CPU base|", gap, gap <= LOG_PROB_TOL[precision])

    initial = actor.export_hf(f"{root}/lora_{precision}_initial").get()[0]
    train = with_advantages(out)
    metrics = actor.update_actor(train, reinforce_loss).get()
    ref_after = actor.compute_ref_log_prob(out).get()["ref_log_probs"]
    gap = masked_gap(ref_after, ref, mask)
    report.check(f"{name}: reference |after - before update|", gap, gap <= 1e-6)  # the base is frozen
    after = actor.compute_log_prob(out).get()["old_log_probs"]
    moved = masked_gap(after, ref, mask)
    report.check(f"{name}: adapters moved the log-probs", moved, moved > 1e-5)

    start = peft_from(model_dir, initial, trainable=True)
    stepped, cpu_norm = cpu_step(start, train, 4, reinforce_loss)
    trained = peft_from(model_dir, actor.export_hf(f"{root}/lora_{precision}_trained").get()[0])
    grad_norm_agreement(report, name, metrics, cpu_norm, precision)
    # fp32: equal but where a gradient is within rounding of zero (Adam's first step is ~lr * sign)
    max_gap = 5e-5 if precision == FP32 else ONE_STEP
    step_agreement(report, name, adapters(start), adapters(trained), adapters(stepped), precision, max_gap)
    with torch.no_grad():
        cpu_after, _ = response_log_probs(stepped, out)
    gap = masked_gap(after, cpu_after, mask)
    report.check(f"{name}: log-probs after update |GPU - CPU step|", gap, gap <= LOG_PROB_TOL[precision])
    fresh = actor.generate_sequences(prompts, SamplingConfig(max_new_tokens=12, seed=1)).get()
    scored = actor.compute_log_prob(fresh).get()["old_log_probs"]
    drift = float((fresh["rollout_log_probs"] - scored).abs().sum() / fresh["response_mask"].sum())
    report.check(f"{name}: rollout_logprob_diff after update", drift, drift <= LOG_PROB_TOL[precision])
    session.clear()


# ---- a large vocabulary -------------------------------------------------------------------------
def make_large_vocab(directory: str, base_dir: str) -> str:
    """The 1m kit's model with a 65,536-row embedding and head (its tokenizer covers the first
    262; ids past it decode to nothing, as a real model's padded vocabulary does)."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    config.vocab_size = VOCAB
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = LlamaForCausalLM(config)
    base = load(base_dir)
    model.generation_config = base.model.generation_config
    model.save_pretrained(directory)
    base.tokenizer.save_pretrained(directory)
    return directory


def exact_log_probs(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 full log-softmax of the CPU model: (log-probs, entropy) of the responses, B x R."""
    inputs, _ = trim_padding(batch)
    with torch.no_grad():
        log_p = torch.log_softmax(response_logits(copy.deepcopy(model).double(), inputs), -1)
    picked = log_p.gather(-1, inputs["responses"][..., None])[..., 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    r = batch["responses"].shape[1]
    return pad_responses(picked, r), pad_responses(entropy, r)


def check_large_vocab(report: Report, session: Session, model_dir: str, root: str, precision: str, gpu: bool):
    name = f"vocab {precision}"
    role = f"vocab_{'fp32' if precision == FP32 else 'bf16'}"
    cfg = ActorConfig(
        model_path=model_dir, optim=OPTIM, mini_batch_size=8, micro_batch_size=4, load=PRECISIONS[precision]
    )
    started = time.time()
    actor = session.group(role, ActorRolloutRefWorker, session.pool("gpu", 1), cfg)
    cpu = load(model_dir)
    model = cpu.model.eval()
    # 80 tokens: 4 rows x 80 positions per micro-batch are two chunks of 256 rows on a GPU
    out = actor.generate_sequences(arithmetic_prompts(cpu.tokenizer), SamplingConfig(max_new_tokens=80, seed=0)).get()
    mask = out["response_mask"]
    scored = actor.compute_log_prob(out).get()
    exact, exact_entropy = exact_log_probs(model, out)
    tol = LOG_PROB_TOL[precision]
    gap = masked_gap(scored["old_log_probs"], exact, mask)
    report.check(f"{name}: log-probs |GPU - CPU float64|", gap, gap <= tol)
    gap = masked_gap(scored["entropy"], exact_entropy, mask)
    report.check(f"{name}: entropy |GPU - CPU float64|", gap, gap <= tol)
    drift = float((out["rollout_log_probs"] - scored["old_log_probs"]).abs().sum() / mask.sum())
    report.check(f"{name}: rollout_logprob_diff", drift, drift <= tol)

    train = with_advantages(out)
    metrics = actor.update_actor(train, entropy_bonus_loss).get()
    stepped, cpu_norm = cpu_step(model, train, 4, entropy_bonus_loss)
    grad_norm_agreement(report, name, metrics, cpu_norm, precision)
    trained = load(actor.export_hf(f"{root}/{role}_trained").get()[0]).model.state_dict()
    step_agreement(report, name, model.state_dict(), trained, stepped.state_dict(), precision, ONE_STEP)
    after = actor.compute_log_prob(out).get()["old_log_probs"]
    with torch.no_grad():
        cpu_after, _ = response_log_probs(stepped, out)
    gap = masked_gap(after, cpu_after, mask)
    report.check(f"{name}: log-probs after update |GPU - CPU step|", gap, gap <= tol)

    memory = memory_metrics(r for r in session.trace() if r.start >= started)
    rss = memory.get(f"perf/peak_rss_gib/{role}/rank0")
    report.check(f"{name}: peak RSS in the metrics (GiB)", rss, rss is not None and rss > 0)
    peak = memory.get(f"perf/cuda_peak_gib/{role}/rank0")
    # at least the fp32 weights, their gradients and Adam's two moments: 16 bytes a parameter
    floor = 16 * sum(p.numel() for p in model.parameters()) / GIB
    total = torch.cuda.get_device_properties(0).total_memory / GIB if gpu else 0.0
    ok = floor <= peak <= total if gpu and peak is not None else peak is None and not gpu
    report.check(f"{name}: CUDA peak in the metrics (GiB)", peak, ok)
    session.clear()


# ---- chat prompts, stop strings, multi-turn episodes --------------------------------------------
class CalculatorFirst(ToolEnvironment):
    """The tiny policy writes no tool calls: its first turn is answered as if it had called the
    calculator on the question, so the tool runs in its sandbox and its answer comes back as
    template tokens; the second turn is the final answer."""

    def start(self, row):
        question = row["prompt"][-1]["content"]  # "What is 12 * 3?"
        return {**row, "turn": 0, "expression": question.removeprefix("What is ").rstrip("?")}

    def step(self, state, text):
        state["turn"] += 1
        if state["turn"] == 1:
            call = {"name": "calculator", "arguments": {"expression": state["expression"]}}
            text = f"<tool_call>{json.dumps(call)}</tool_call>"
        return super().step(state, text)


def final_answer_is_short(text: str, truth: str) -> float:
    return float(len(text) < 12)


def stop_sampling(free: Batch, tokenizer) -> SamplingConfig:
    """Greedy sampling with a stop string and a stop token id taken from an unconstrained greedy
    rollout's responses, so both end some responses early."""
    mask = free["response_mask"].bool()
    texts = [tokenizer.decode([t]) for t in free["responses"][0][mask[0]][2:].tolist()]
    stop = [t for t in texts if t.strip() and t.isascii() and t.isprintable()][:1]  # a whole character
    long_rows = mask[:, 4].nonzero().flatten().tolist()  # another row's fifth token, where one has five
    stop_ids = [int(free["responses"][long_rows[-1], 4])] if long_rows else []
    return SamplingConfig(max_new_tokens=16, greedy=True, stop=tuple(stop), stop_token_ids=tuple(stop_ids))


def check_chat(report: Report, session: Session, chat_dir: str) -> None:
    cfg = ActorConfig(model_path=chat_dir, optim=OPTIM, mini_batch_size=8, micro_batch_size=4, load=PRECISIONS[FP32])
    actor = session.group("chat", ActorRolloutRefWorker, session.pool("gpu", 1), cfg)
    cpu = load(chat_dir)
    model, tokenizer = cpu.model.eval(), cpu.tokenizer
    pairs = [(12, 3), (7, 8), (21, 4), (9, 9)]
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}], "ground_truth": str(a * b)} for a, b in pairs
    ]
    prompts = tokenize_prompts(rows, tokenizer, max_prompt_length=48)

    rollout = HFRollout(
        copy.deepcopy(model), tokenizer.pad_token_id, end_token_ids(model, tokenizer), tokenizer=tokenizer
    )
    free = rollout.generate(prompts, SamplingConfig(max_new_tokens=16, greedy=True))
    stops = stop_sampling(free, tokenizer)
    expected = rollout.generate(prompts, stops)
    cut = int((expected["response_mask"].sum(1) < free["response_mask"].sum(1)).sum())
    report.check("chat: rows the stops end early (CPU)", cut, cut >= 1)
    got = actor.generate_sequences(prompts, stops).get()
    same = rows_equal(got, expected, "responses", "response_mask")
    report.check("chat: stopped greedy rows equal to the CPU's", same, same >= 0.75)

    shared = SamplingConfig(max_new_tokens=16, greedy=True, n=2)  # n rows per prompt from one prefill
    same = rows_equal(actor.generate_sequences(prompts, shared).get(), rollout.generate(prompts, shared), "responses")
    report.check("chat: n samples from one prefill, rows equal to the CPU's", same, same >= 0.75)

    env = CalculatorFirst({"calculator": calculator}, score=final_answer_is_short)
    sampling = SamplingConfig(max_new_tokens=8, n=2, seed=0)
    episode = EpisodeConfig(max_turns=3, turn_tokens=8, max_tokens=64)
    batch = actor.generate_episodes(prompts, env, sampling, episode).get()
    again = actor.generate_episodes(prompts, env, sampling, episode).get()
    check_episode_structure(report, batch, tokenizer, [str(a * b) for a, b in pairs for _ in range(2)])
    same = rows_equal(batch, again, "responses", "response_mask")
    report.check("episodes: the same seed, the same episodes (rows)", same, same == 1.0)

    policy = batch["response_mask"]
    scored = actor.compute_log_prob(batch).get()["old_log_probs"]
    gap = masked_gap(scored, batch["rollout_log_probs"], policy)
    report.check("episodes: training forward |GPU - rollout|", gap, gap <= LOG_PROB_TOL[FP32])
    with torch.no_grad():
        cpu_lp, _ = response_log_probs(model, batch)
    gap = masked_gap(scored, cpu_lp, policy)
    report.check("episodes: log-probs |GPU - CPU|", gap, gap <= LOG_PROB_TOL[FP32])
    train = with_advantages(batch)
    metrics = actor.update_actor(train, reinforce_loss).get()
    _, cpu_norm = cpu_step(model, train, 4, reinforce_loss)
    grad_norm_agreement(report, "episodes", metrics, cpu_norm, FP32)
    session.clear()


def check_episode_structure(report: Report, batch: Batch, tokenizer, answers: list[str]) -> None:
    """Two turns each (a tool call, then the answer); observations attended but out of the loss."""
    policy = batch["response_mask"].bool()
    attended = batch["attention_mask"][:, -policy.shape[1] :].bool()
    report.check("episodes: turns per episode", batch["turns"].tolist(), bool((batch["turns"] == 2).all()))
    calls, errors = batch["tool_calls"], batch["tool_errors"]
    report.check(
        "episodes: tool calls / errors",
        [calls.sum().item(), errors.sum().item()],
        bool((calls == 1).all() and not errors.any()),
    )
    observed = batch["observation_tokens"]
    counted = bool((attended.sum(1) == policy.sum(1) + observed).all() and (observed > 0).all())
    report.check("episodes: attended = policy + observation tokens", observed.tolist(), counted)
    unscored = float(batch["rollout_log_probs"][~policy].abs().max()) if (~policy).any() else 0.0
    report.check("episodes: rollout log-probs off policy tokens", unscored, unscored == 0.0)
    ends_ok = True
    for row in range(len(batch)):
        ends = [e for e in batch["turn_ends"][row].tolist() if e >= 0]
        ends_ok &= len(ends) == 2 and all(policy[row, e] for e in ends) and not policy[row, ends[0] + 1]
    report.check("episodes: turn ends on policy tokens, then observation", ends_ok, ends_ok)
    shown = [tokenizer.decode(batch["responses"][row][attended[row] & ~policy[row]]) for row in range(len(batch))]
    seen = all(text.count("<|im_start|>tool") == 1 and answer in text for text, answer in zip(shown, answers))
    report.check("episodes: the calculator's answer in the tool turn", shown[0], seen)


def run_section(report: Report, session: Session, name: str, section, args: tuple) -> None:
    """One section; one that raises is a failed row (with its traceback above it), and the next
    section still runs: the GPU machine is lent for one run."""
    started = time.time()
    try:
        section(*args)
    except Exception as error:  # reported, and the run goes on
        traceback.print_exc()
        report.check(f"{name}: raised", f"{type(error).__name__}: {error}"[:300], False)
        session.clear()
    report.results[f"{name}: seconds"] = round(time.time() - started, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU: a dry run where no GPU is")
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1), help="torch threads here")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these sections alone (e.g. chat, lora)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = Report()
    root = tempfile.mkdtemp()
    tiny = str(make_tiny("1m", f"{root}/policy", seed=3))
    large = make_large_vocab(f"{root}/large_vocab", tiny)
    chat = str(make_tiny_chat(f"{root}/chat"))
    session = Session(num_devices=1, threads_per_worker=min(4, args.threads))
    start = time.time()
    try:
        gpu = device_resource() == "GPU"
        report.check("device resource", device_resource(), gpu or args.cpu)
        sections = [
            ("chunked", check_chunked_kernel, (report, "cuda" if gpu else "cpu")),
            *[(f"lora {p}", check_lora, (report, session, tiny, root, p)) for p in (FP32, BF16_GC)],
            *[(f"vocab {p}", check_large_vocab, (report, session, large, root, p, gpu)) for p in (FP32, BF16_GC)],
            ("chat", check_chat, (report, session, chat)),
        ]
        for name, section, section_args in sections:
            if args.only and not any(name.startswith(wanted) for wanted in args.only):
                continue
            run_section(report, session, name, section, section_args)
        report.results["torch"] = torch.__version__
        report.results["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    finally:
        session.shutdown()
    report.results["seconds"] = round(time.time() - start, 1)
    report.results["failures"] = report.failures
    print(json.dumps(report.results))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
