"""Warm processes (Session(keep_processes=True), as the shared test session runs): a removed
group's processes serve the next group on a pool of the same shape, whatever its classes."""

import time

import psutil
import ray
import torch

import workbench.session
from tests.controller.workers import EchoWorker, Lingering, ReferenceLike
from workbench import Batch, Mesh


def pids(group) -> list[int]:
    return [w["pid"] for w in group.where().get()]


def host_pids() -> set[int]:
    """Every live worker process of this session's Ray (warm ones included)."""
    return {
        a["Pid"]
        for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"] == "WorkerHost"
    }


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_new_group_starts_on_the_warm_processes_whatever_its_classes(session):
    assert session.keep_processes
    first = session.group("actor", EchoWorker, session.pool("p", 2))
    before = pids(first)
    session.clear()
    warm = host_pids()  # the shared session may keep more than these two
    assert set(before) <= warm
    # Another role name, pool name and layout over the same shape: warm processes, reset.
    again = session.group("critic", EchoWorker, session.pool("q", 2), mesh=Mesh(tp=2))
    assert set(pids(again)) <= warm
    assert [w["rank"] for w in again.where().get()] == [0, 1]
    assert again.all_reduce().get() == [3.0, 3.0]  # a new process group over them
    batch = Batch({"x": torch.arange(4.0)}, {"uid": list(range(4))})
    assert torch.equal(again.double(batch).get()["x"], torch.arange(4.0) * 2)
    session.clear()
    # Other classes take them too: a host runs any worker's methods through one entry, and
    # only the new worker's methods answer (its place's methods, not the old worker's).
    warm = host_pids()
    other = session.group("reference", ReferenceLike, session.pool("r", 2))
    assert set(w["pid"] for w in other.where().get()) <= warm
    assert torch.equal(other.negate(batch).get()["x"], -torch.arange(4.0))
    assert not hasattr(other, "double")


def test_a_process_that_left_a_thread_running_is_not_kept(session):
    group = session.group("tool", Lingering, session.pool("p", 1))
    pid = group.start_thread().get()[0]
    session.clear()
    assert gone(pid), "the process whose worker left a thread behind should have been stopped"
    again = session.group("tool", Lingering, session.pool("p", 1))
    assert again.start_thread().get()[0] != pid


def test_a_process_that_set_up_deepspeed_is_not_kept_one_that_only_imported_it_is(session):
    group = session.group("saver", EchoWorker, session.pool("p", 1))
    pid = group.use_deepspeed(comm=False).get()[0]  # what saving a model through transformers does
    session.clear()
    again = session.group("saver", EchoWorker, session.pool("p", 1))
    assert again.use_deepspeed(comm=True).get() == [pid]  # kept: an import leaves no state
    session.clear()
    assert gone(pid), "the process whose DeepSpeed comm was set up should have been stopped"
    third = session.group("saver", EchoWorker, session.pool("p", 1))
    assert pids(third) != [pid]


def test_at_most_max_warm_processes_are_kept(session, monkeypatch):
    monkeypatch.setattr(workbench.session, "MAX_WARM_PROCESSES", 2)  # 4 processes for a limit of 2
    pool = session.pool("p", 2)
    groups = [session.group(f"g{i}", EchoWorker, pool) for i in range(2)]
    every = [pid for g in groups for pid in pids(g)]
    session.clear()
    deadline = time.monotonic() + 10
    while sum(psutil.pid_exists(pid) for pid in every) > 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(psutil.pid_exists(pid) for pid in every) == 2
    again = session.group("g", EchoWorker, session.pool("p", 2))  # the two kept
    assert set(pids(again)) <= set(every)


def test_a_warm_process_reports_the_memory_peak_of_its_new_group(session):
    def peak(role: str) -> int:
        return [r for r in session.trace() if r.role == role][-1].extra["peak_rss_bytes"]

    first = session.group("big", EchoWorker, session.pool("p", 1))
    first.touch_memory(512).get()
    before, pid = peak("big"), pids(first)
    session.clear()
    again = session.group("small", EchoWorker, session.pool("p", 1))
    assert pids(again) == pid  # the same process: its peak counts again from the reset
    assert peak("small") < before - 256 * 2**20
