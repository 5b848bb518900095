"""Shared small inputs for the planner tests (pure Python, no Ray)."""

import dataclasses

import pytest

from workbench.planner import Workload, cluster_preset


@pytest.fixture
def tiny_cluster():
    """One machine with two devices: small enough to enumerate every execution plan."""
    return dataclasses.replace(cluster_preset("local", 2), name="tiny2")


@pytest.fixture
def tiny_workload():
    return Workload.tiny()
