"""One Ray instance for the whole test run (it takes seconds to start); each test gets the
shared Session back with no pools or groups left over from the test before."""

import pytest
import ray

import tests.controller.workers
from workbench import Session

# Test workers live outside the installed package: ship them to Ray workers by value.
ray.cloudpickle.register_pickle_by_value(tests.controller.workers)

NUM_DEVICES = 8


@pytest.fixture(scope="session")
def shared_session():
    # Warm processes: most tests start groups on pools of the shape the test before them used.
    session = Session(num_devices=NUM_DEVICES, keep_processes=True)
    yield session
    session.shutdown()


@pytest.fixture
def session(shared_session):
    yield shared_session
    shared_session.clear()
