"""Loss functions the tests ship to workers (by value, as a notebook's would be)."""

from workbench.engines.forward import response_log_probs


def reinforce_loss(model, batch):
    """-mean over rows of advantage * (sum of response log-probs): simple, deterministic."""
    log_probs, _ = response_log_probs(model, batch)
    per_row = (log_probs * batch["response_mask"]).sum(dim=1)
    loss = -(batch["advantages"] * per_row).mean()
    return loss, {"loss": loss.item()}
