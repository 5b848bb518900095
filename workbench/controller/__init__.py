"""The single controller's machinery: pools, protocols, workers and worker groups."""

import warnings

from workbench.controller.future import DataFuture, RemoteSlice
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
