"""The session abused as a notebook user would: re-run cells, resize pools, kill workers.
Each check asserts the exact error, that the session still works afterwards, and that no
ALIVE worker actor or placement group is left behind (small test workers, shared Ray)."""

import os
import signal
import threading
import time

import pytest
import ray
import torch

from tests.conftest import NUM_DEVICES
from tests.controller.workers import EchoWorker, FailingInit, ReferenceLike
from workbench import Batch, PlacementError, Session, WorkerCallError, WorkerDiedError
from workbench.errors import ConfigError, GroupRemovedError


def prompts(n):
    return Batch({"x": torch.arange(n, dtype=torch.float32)}, {"uid": [f"u{i}" for i in range(n)]})


def alive_hosts() -> list[str]:
    return [
        a["ActorID"]
        for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"].startswith("WorkerHost")
    ]


def live_placement_groups() -> list[str]:
    # Sorted: Ray's table is keyed by group id, so its order is not creation order.
    return sorted(
        pg["name"]
        for pg in ray.util.placement_group_table().values()
        if pg["state"] != "REMOVED" and pg["name"].startswith("workbench:")
    )


@pytest.fixture
def clean(session):
    """The shared session without warm processes; afterwards, once cleared, nothing of the
    test may be left running."""
    kept = session.keep_processes
    session.keep_processes = False
    session.clear()
    try:
        yield session
        session.keep_processes = False  # a re-run Session(...) cell sets it again
        session.clear()
        assert not alive_hosts(), "worker actors leaked"
        assert not live_placement_groups(), "placement groups leaked"
    finally:
        session.keep_processes = kept


def test_rerunning_the_session_cell_twice_gives_one_clean_session(clean):
    first = clean.group("actor", EchoWorker, clean.pool("actor_pool", 1))
    side = clean.group("side", EchoWorker, clean.pool("side_pool", 1))
    # The first re-run resets the groups made before it, the second one made by a re-run cell:
    # a third would start from the second's state again.
    for _ in range(2):
        session = Session(num_devices=NUM_DEVICES)  # the notebook's first cell, run again
        assert session is clean and not session.pools and not session.groups
        assert not alive_hosts() and not live_placement_groups()
        group = session.group("actor", EchoWorker, session.pool("actor_pool", 1))  # no name clash
        assert group.all_reduce().get() == [1.0]
    assert first.where().get()[0]["pid"] == group.where().get()[0]["pid"]  # an old handle follows its role
    with pytest.raises(
        GroupRemovedError,
        match=r"'side' no longer exists: the Session\(\.\.\.\) cell was re-run.*session.group\('side'",
    ):
        side.where()
    assert len(live_placement_groups()) == 1


def test_workers_run_at_the_drivers_priority_and_bad_session_arguments_change_nothing(clean):
    """Ray would start workers at nice 15: any other process on the machine then takes the
    cores from the run's compute. The session's own Ray keeps them at the driver's priority.
    (One worker shows it as well as several: Ray sets one niceness for all of its workers.)"""
    group = clean.group("keep", EchoWorker, clean.pool("one", 1))
    for kwargs in (
        {"num_devices": 0},
        {"num_devices": 2.5},
        {"threads_per_worker": 0},
        {"max_colocate": -1},
        {"max_trace_records": 0},
    ):
        with pytest.raises(ConfigError, match=f"Session.{next(iter(kwargs))}="):
            Session(**kwargs)
    where = group.where().get()
    assert where[0]["rank"] == 0 and "keep" in clean.groups
    assert [w["nice"] for w in where] == [os.nice(0)]


def test_a_refused_pool_resize_leaves_pool_and_groups_as_they_were(clean):
    pool = clean.pool("actor_pool", 1)
    actor = clean.group("actor", EchoWorker, pool)
    clean.pool("other", NUM_DEVICES - 3)  # 2 devices stay free
    tables = live_placement_groups()
    with pytest.raises(PlacementError, match="asks for 4 CPU device"):
        clean.pool("actor_pool", 4)  # 3 would be free once the old pool went: refused first
    assert clean.pools["actor_pool"] is pool and live_placement_groups() == tables
    for bad in (1.5, 0, True, [1, 0], "2"):
        with pytest.raises(PlacementError, match=r"devices=.* is not a device count"):
            clean.pool("actor_pool", bad)
    assert actor.all_reduce().get() == [1.0]
    # A resize that fits (beside the old pool, which goes only then): the group on the old pool
    # is gone, and its handle says which cell to re-run.
    bigger = clean.pool("actor_pool", 2)
    assert bigger.world_size == 2 and len(live_placement_groups()) == 2
    with pytest.raises(GroupRemovedError, match=r"'actor' no longer exists: its pool 'actor_pool' was re-created"):
        actor.all_reduce()
    clean.group("actor", EchoWorker, bigger)
    assert actor.all_reduce().get() == [3.0, 3.0]


def test_releasing_a_pool_keeps_the_others_and_names_what_went(clean):
    first, second = clean.pool("first", 1), clean.pool("second", 1)
    gone, kept = clean.group("gone", EchoWorker, first), clean.group("kept", EchoWorker, second)
    with pytest.raises(ConfigError, match=r"pool.*'third'.*its pools: \['first', 'second'\]"):
        clean.release("third")
    clean.release(first)
    assert sorted(clean.pools) == ["second"] and len(live_placement_groups()) == 1
    with pytest.raises(GroupRemovedError, match=r"'gone' no longer exists: its pool 'first' was released"):
        gone.all_reduce()
    assert kept.all_reduce().get() == [1.0]
    clean.group("gone", EchoWorker, clean.pool("first", 1))  # the devices are free again
    assert gone.all_reduce().get() == [1.0]


def test_handles_follow_their_role_and_fused_partners_say_what_happened(clean):
    pool = clean.pool("one", 1)
    groups = clean.fused(pool, actor=EchoWorker, reference=ReferenceLike)
    actor, reference = groups["actor"], groups["reference"]
    clean.group("actor", EchoWorker, pool, {"scale": 3})  # re-run only the actor cell
    assert actor.double(prompts(2)).get()["x"].tolist() == [0.0, 3.0]  # the old handle, the new group
    with pytest.raises(
        GroupRemovedError, match=r"'reference' no longer exists: .*'reference' shared its processes with 'actor'"
    ):
        reference.negate(prompts(2))
    clean.fused(pool, actor=EchoWorker, reference=ReferenceLike)  # re-run the fused cell
    assert reference.negate(prompts(2)).get()["x"].tolist() == [0.0, -1.0]


def test_a_worker_exception_keeps_the_group_and_a_killed_worker_is_named_then_recovered(clean):
    """One group of two through what a worker can do to it: an exception (the group stays
    usable), a kill between calls and a kill during a call (named, then recovered)."""
    critic = clean.group("critic", EchoWorker, clean.pool("two", 2))
    with pytest.raises(
        WorkerCallError, match=r"failed on rank 1\. Every rank of the group answers, so it is still usable"
    ):
        critic.fail_on(1).get()
    assert critic.fail_on(7).get() == [0, 1]

    where = critic.where().get()
    os.kill(where[1]["pid"], signal.SIGKILL)
    # rank 0's collective fails with "connection closed"; the error names the dead rank 1.
    with pytest.raises(
        WorkerDiedError, match=rf"rank 1 of role 'critic' \(pid {where[1]['pid']} on node .*\) died"
    ) as err:
        critic.all_reduce().get(timeout=60)
    assert "still usable" not in str(err.value) and "session.recover('critic')" in str(err.value)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 of role 'critic'"):  # known dead: refused at once
        critic.where()
    assert time.monotonic() - start < 1.0
    recovered = clean.recover("critic")
    assert critic.all_reduce().get() == [3.0, 3.0] and recovered.world_size == 2
    assert critic.where().get()[1]["pid"] != where[1]["pid"]

    # Killed while a call runs on it (the recovered group is a new one, as a first start's).
    pid = critic.where().get()[1]["pid"]
    future = critic.sleep(3.0)
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(WorkerDiedError, match=rf"rank 1 of role 'critic' \(pid {pid} "):
        future.get(timeout=60)
    clean.recover("critic")
    assert critic.all_reduce().get() == [3.0, 3.0]


def test_a_failed_start_does_not_claim_a_usable_group(clean):
    pool = clean.pool("two", 2)
    with pytest.raises(WorkerCallError, match=r"was not created .* re-run the cell") as err:
        clean.group("broken", FailingInit, pool, {"fail_rank": 1})
    assert "still usable" not in str(err.value) and "cannot start on purpose" in str(err.value)
    assert "broken" not in clean.groups and not alive_hosts()
    assert clean.group("fixed", FailingInit, pool, {"fail_rank": 5}).where().get() == [0, 1]


SHUTDOWN_SCRIPT = """
import json, ray
import tests.controller.workers as workers
from workbench import Session
from workbench.errors import SessionClosedError
ray.cloudpickle.register_pickle_by_value(workers)
ray.init(num_cpus=1, include_dashboard=False)      # a Ray the session does not own
session = Session()
session.group("g", workers.EchoWorker, session.pool("p", 1)).where().get()
again = Session()                                   # re-run: the same session, reset
again.group("g", workers.EchoWorker, again.pool("p", 1)).where().get()  # the only device: given back
again.shutdown()
alive = [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]
pgs = [p for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]
try:
    session.pool("p", 1)
    closed = False
except SessionClosedError:
    closed = True
print(json.dumps({"same": again is session, "alive": len(alive), "pgs": len(pgs),
                  "ray_up": ray.is_initialized(), "closed": closed, "fresh": Session() is not session}))
"""


def test_shutdown_releases_everything_even_on_a_ray_it_did_not_start():
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # The script's Ray ends with the script: its folder goes with the test.
    with tempfile.TemporaryDirectory(prefix="wb-ray-", ignore_cleanup_errors=True) as ray_tmp:
        env = {**os.environ, "PYTHONPATH": str(root), "RAY_TMPDIR": ray_tmp}
        run = subprocess.run(
            [sys.executable, "-c", SHUTDOWN_SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=300
        )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"same": True, "alive": 0, "pgs": 0, "ray_up": True, "closed": True, "fresh": True}
