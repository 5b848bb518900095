"""HybridFlow Workbench: a notebook-first RLHF workbench on a single controller over Ray."""

from workbench.controller import (
    ALL_TO_ALL,
    DP_PROTO,
    DP_REDUCED,
    ONE_TO_ALL,
    RANK_ZERO,
    THREE_D_ALL_MICRO_DP,
    THREE_D_PP_ONLY,
    THREE_D_PROTO,
    DataFuture,
    Mesh,
    Protocol,
    ResourcePool,
    Worker,
    WorkerGroup,
    register,
)
from workbench.data import Batch
from workbench.errors import DispatchError, PlacementError, WorkerCallError, WorkerDiedError
from workbench.session import Session

__all__ = [
    "ALL_TO_ALL", "DP_PROTO", "DP_REDUCED", "ONE_TO_ALL", "RANK_ZERO", "THREE_D_ALL_MICRO_DP", "THREE_D_PP_ONLY",
    "THREE_D_PROTO", "Batch", "DataFuture", "DispatchError", "Mesh", "PlacementError", "Protocol",
    "ResourcePool", "Session", "Worker", "WorkerCallError", "WorkerDiedError", "WorkerGroup", "register",
]
