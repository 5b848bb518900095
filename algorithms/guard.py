"""The finite-value guard: NaN/inf in an iteration's batch stops it before any update runs.

It checks every field the steps of `workbench.steps` produce (rewards, values, log-probs,
advantages, returns, ...), so a bad number is named with the step that made it rather than
found later as a NaN loss.
"""

from __future__ import annotations

import torch

from workbench import steps
from workbench.errors import NonFiniteError


def finite_batch(batch, before: str) -> None:
    """Refuse NaN/inf in the fields the steps made (response tokens only: padding is never
    read), on the driver, before the update `before` runs; see errors.NonFiniteError.
    Fields are checked in step order, so the first bad one named is the earliest made."""
    mask = batch["response_mask"].bool() if "response_mask" in batch else None
    for field, step in _FIELD_STEPS.items():
        if field not in batch:
            continue
        values = batch[field]
        if not isinstance(values, torch.Tensor) or not torch.is_floating_point(values):
            continue
        bad = ~torch.isfinite(values)
        if bad.dim() == 2 and mask is not None and bad.shape == mask.shape:
            bad &= mask
        rows = bad.reshape(len(bad), -1).any(dim=1).nonzero().flatten().tolist()
        if rows:
            uids = [batch["uid"][r] for r in rows] if "uid" in batch else rows
            raise NonFiniteError(field, step, list(uids), before)


_FIELD_STEPS: dict[str, str] = {}
"""Each field a step produces, and the (first) step that makes it, in step order."""
for _step in steps.STEPS:
    for _field in _step.produces:
        _FIELD_STEPS.setdefault(_field, _step.name)
