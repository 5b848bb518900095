"""Planner errors: each names what cannot be planned, where, and what to change."""

from __future__ import annotations

from workbench.errors import WorkbenchError

GIB = 1024**3


class PlannerError(WorkbenchError):
    """Base of the planner's errors."""


class UnknownPresetError(PlannerError, KeyError):
    """A preset name (model, cluster, dataflow) that is not defined."""

    def __init__(self, kind: str, name: str, known: list[str]):
        self.kind, self.name, self.known = kind, name, sorted(known)
        super().__init__(f"unknown {kind} preset {name!r}; known {kind} presets: {', '.join(self.known)}")

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return self.args[0]


class ModelDoesNotFitError(PlannerError):
    """A model's memory does not fit the cluster even when sharded over every device."""

    def __init__(self, model: str, spec_name: str, n_devices: int, need_bytes: float, device_bytes: float):
        self.model, self.n_devices = model, n_devices
        self.need_bytes, self.device_bytes = need_bytes, device_bytes
        self.short_bytes = need_bytes - device_bytes
        super().__init__(
            f"model {model!r} ({spec_name}) does not fit on the cluster: sharded over all "
            f"{n_devices} devices it still needs {need_bytes / GIB:.1f} GiB per device, the "
            f"device has {device_bytes / GIB:.1f} GiB, short by {self.short_bytes / GIB:.1f} GiB "
            f"per device. Use more devices or devices with more memory, a smaller model, or a "
            f"smaller micro-batch / shorter sequences."
        )


class NoFeasiblePlanError(PlannerError):
    """Every model fits alone, but no placement fits all of them together."""


class NoMeshError(PlannerError):
    """A device count (or cluster shape) that no valid device mesh covers."""

    def __init__(self, n_devices: int, devices_per_node: int, valid: list[int], what: str = ""):
        self.n_devices, self.devices_per_node, self.valid = n_devices, devices_per_node, valid
        shown = ", ".join(str(v) for v in valid[:12]) + (", ..." if len(valid) > 12 else "")
        super().__init__(
            f"{what or 'device count'} {n_devices} is not covered by any device mesh with "
            f"{devices_per_node} devices per node: meshes are divisors of one node or whole "
            f"nodes, i.e. {shown}. Choose one of those counts."
        )
