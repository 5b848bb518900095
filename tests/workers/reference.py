"""What the actor tests compare against: the same inputs and the same step in one process."""

import copy

import torch

from tests.workers import losses
from tests.workers.losses import reinforce_loss
from workbench import Batch
from workbench.data.prompts import tokenize_prompts
from workbench.engines.contract import OptimConfig
from workbench.engines.forward import model_outputs

OPTIM = OptimConfig(lr=1e-3, grad_clip=1.0)
ADAM_SAFE_GRAD = 1e-6
"""Below this |gradient| AdamW's first step amplifies rounding: lr * g / (|g| + eps), eps = 1e-8,
turns a nearly cancelling gradient's different rounding (another summation order: ranks,
micro-batches, a prompt computed once for its samples) into a parameter difference of up to lr."""


def prompts(tokenizer, n=8):
    rows = [{"prompt": f"Q: {i}+{i + 3}=? A:", "ground_truth": str(2 * i + 3)} for i in range(n)]
    return tokenize_prompts(rows, tokenizer, max_prompt_length=32)


def advantages_for(batch):
    return Batch({"advantages": torch.linspace(-1.0, 1.0, len(batch))})


def single_process_step(model, train, optim=OPTIM):
    """The 2-rank actor's step in one process, with the same arithmetic: each rank's 4 rows in
    micro-batches of 2 (gradient accumulation), the mean over the two ranks, clipping, AdamW.
    Returns (updated copy of model, its clipped gradients)."""
    single = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(single.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=0.0)
    for rank in range(2):
        for micro in range(2):
            rows = train[rank * 4 + micro * 2 : rank * 4 + micro * 2 + 2]
            loss, _ = reinforce_loss(model_outputs(single, rows), rows)
            (loss * 0.5 * 0.5).backward()
    torch.nn.utils.clip_grad_norm_(single.parameters(), optim.grad_clip)
    grads = {name: p.grad.clone() for name, p in single.named_parameters()}
    opt.step()
    return single, grads


def assert_checkpoint_roundtrip(actor, batch, path):
    """save -> update (log-probs change) -> load gives back exactly the saved log-probs."""
    actor.save_checkpoint(str(path)).get()
    saved = actor.compute_log_prob(batch).get()["old_log_probs"]
    actor.update_actor(batch.union(advantages_for(batch)), losses.reinforce_loss).get()
    changed = actor.compute_log_prob(batch).get()["old_log_probs"]
    assert (changed - saved).abs().max() > 1e-4
    actor.load_checkpoint(str(path)).get()
    restored = actor.compute_log_prob(batch).get()["old_log_probs"]
    assert torch.equal(restored, saved)


def param_diffs(trained: dict, single, grads: dict) -> tuple[float, float]:
    """(max |trained - single| over every weight, the same where the single-process gradient is
    at least ADAM_SAFE_GRAD): the second is held to rounding, the first to AdamW's 2 lr."""
    worst = worst_safe = 0.0
    for name, expected in single.state_dict().items():
        diff = (trained[name] - expected).abs()
        worst = max(worst, diff.max().item())
        if name in grads:
            safe = grads[name].abs() >= ADAM_SAFE_GRAD
            worst_safe = max(worst_safe, diff[safe].max().item() if safe.any() else 0.0)
    return worst, worst_safe
