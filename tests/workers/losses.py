"""Loss functions the tests ship to workers (by value, as a notebook's would be)."""


def reinforce_loss(outputs, batch):
    """-mean over rows of advantage * (sum of response log-probs): simple, deterministic."""
    log_probs = outputs["log_probs"]
    per_row = (log_probs * batch["response_mask"]).sum(dim=1)
    loss = -(batch["advantages"] * per_row).mean()
    return loss, {"loss": loss.item()}
