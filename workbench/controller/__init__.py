"""The single controller's machinery: pools, protocols, workers and worker groups."""

import warnings

from workbench.controller.future import DataFuture, RemoteSlice
from workbench.controller.mesh import Coord, Mesh
from workbench.controller.protocols import (
    ALL_TO_ALL,
    DP_PROTO,
    DP_REDUCED,
    ONE_TO_ALL,
    ONE_TO_ALL_KEEP_RANK0,
    THREE_D_ALL_MICRO_DP,
    THREE_D_PP_ONLY,
    THREE_D_PROTO,
    THREE_D_REDUCED,
    Protocol,
)
from workbench.controller.register import register
from workbench.controller.resource_pool import ResourcePool
from workbench.controller.worker import Worker
from workbench.controller.worker_group import WorkerGroup, joint_calls


def __getattr__(name: str):
    if name == "RANK_ZERO":
        from workbench.controller import protocols

        warnings.warn(protocols.RANK_ZERO_RENAMED, DeprecationWarning, stacklevel=2)
        return protocols.ONE_TO_ALL_KEEP_RANK0
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
