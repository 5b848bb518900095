"""Worker groups on a real local Ray: real processes, gloo process groups, object refs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from tests.controller.workers import EchoWorker, ReferenceLike
from workbench import Batch, DispatchError, Mesh, PlacementError, WorkerCallError, WorkerDiedError
from workbench.controller.future import _UNSET
from workbench.errors import ConfigError, GroupRemovedError

ROOT = Path(__file__).resolve().parents[2]


def prompts(n):
    return Batch({"x": torch.arange(n, dtype=torch.float32)}, {"uid": [f"u{i}" for i in range(n)]})


def alive_actors():
    return sum(1 for a in ray._private.state.actors().values() if a["State"] == "ALIVE")


# The order of the tests is the order of their pools' shapes: the shared session keeps a removed
# group's processes warm for the next group of the same classes on a pool of the same shape, as
# long as their reservations fit beside new pools. A request the cluster cannot meet gives every
# warm process up, so that test comes first; the fused roles (other classes) come last.


def test_asking_for_more_devices_than_exist_fails_at_once(session):
    start = time.monotonic()
    with pytest.raises(PlacementError, match="asks for 99 CPU device"):
        session.pool("huge", 99)
    with pytest.raises(PlacementError, match="on 2 nodes but the cluster has 1"):
        session.pool("spread", [1, 1])
    assert time.monotonic() - start < 5
    with pytest.raises(DispatchError, match="has 4 ranks but pool 'two' has 2"):
        session.group("g", EchoWorker, session.pool("two", 2), mesh=Mesh(dp=4))


def test_ranks_know_their_place_and_all_reduce(session):
    pool = session.pool("four", 4)
    group = session.group("model", EchoWorker, pool, mesh=Mesh(pp=1, tp=2, dp=2))
    where = group.where().get()
    assert [w["rank"] for w in where] == [0, 1, 2, 3]
    assert [w["coord"] for w in where] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]
    assert len({w["pid"] for w in where}) == 4 and {w["world"] for w in where} == {4}
    assert group.all_reduce().get() == [10.0] * 4  # 1 + 2 + 3 + 4 on every rank


def test_user_protocol_and_rank_zero_execution(session):
    group = session.group("g", EchoWorker, session.pool("four", 4))  # the warm processes of the test above
    assert group.identity(1).get() == 1 + 2 + 3 + 4
    assert group.only_rank_zero(prompts(5)).get() == 500  # rank 0 alone saw all 5 rows


def test_future_flows_between_groups_with_different_dp(session):
    actor = session.group("actor", EchoWorker, session.pool("a", 2))  # dp = 2
    critic = session.group("critic", EchoWorker, session.pool("b", 2), {"scale": 3}, mesh=Mesh(tp=2))  # dp = 1
    generated = actor.double(prompts(5))  # 5 rows over dp=2: padded to 6, padding dropped later
    valued = critic.double_3d(generated)  # each critic rank pulls its rows from actor ranks
    out = valued.get()
    assert out["x"].tolist() == [0.0, 6.0, 12.0, 18.0, 24.0]
    assert list(out["uid"]) == [f"u{i}" for i in range(5)]
    assert out["seen_by"].tolist() == [0] * 5  # THREE_D_PROTO collects tp rank 0
    assert generated._value is _UNSET  # the driver never fetched the actor's output
    # And the other way: dp=1 source into a dp=2 destination, then driver-side check.
    back = actor.double(valued).get()
    assert back["x"].tolist() == [0.0, 12.0, 24.0, 36.0, 48.0]
    assert back["seen_by"].tolist() == [0, 0, 0, 1, 1]


def test_disjoint_pools_overlap_and_colocated_groups_take_turns(session):
    left = session.group("left", EchoWorker, session.pool("p1", 2))
    right = session.group("right", EchoWorker, session.pool("p2", 2))
    shared = session.group("shared", EchoWorker, session.pool("p1", 2))  # colocated with `left`
    for g in (left, right, shared):
        g.where().get()  # warm: processes are up

    start = time.monotonic()
    a, b = left.sleep(1.0), right.sleep(1.0)
    a.get(), b.get()
    disjoint = time.monotonic() - start

    start = time.monotonic()
    a, b = left.sleep(1.0), shared.sleep(1.0)
    a.get(), b.get()
    colocated = time.monotonic() - start

    assert disjoint < 1.6, f"disjoint pools did not overlap: {disjoint:.2f} s"
    assert colocated >= 2.0, f"colocated groups ran concurrently: {colocated:.2f} s"


def test_slices_share_their_pools_devices_call_by_call(session):
    """A slice is some of a pool's devices (a per-call plan's reference on d0 while the actor
    trains on d0-1): a call on it waits for another group's call on any of its devices, calls on
    disjoint slices run concurrently, and the slices go with their pool."""
    pool = session.pool("whole", 2)
    whole = session.group("whole", EchoWorker, pool)
    left = session.group("left", EchoWorker, session.slice("left", pool, 0, 1))
    right = session.group("right", EchoWorker, session.slice("right", "whole", 1, 1))
    where = {g.role: g.where().get() for g in (whole, left, right)}
    assert {w["world"] for w in where["left"] + where["right"]} == {1}  # a world of its own
    bundle = [g.pool.scheduling(0)["scheduling_strategy"].placement_group_bundle_index for g in (left, right)]
    assert bundle == [0, 1] and left.pool.placement is right.pool.placement is pool.placement  # the pool's devices
    assert len(session.pools) == 3 and session.slice("left", pool, 0, 1) is left.pool

    def seconds(*calls):
        start = time.monotonic()
        futures = [group.sleep(s) for group, s in calls]
        for future in futures:
            future.get()
        return time.monotonic() - start

    assert seconds((left, 1.0), (right, 1.0)) < 1.6  # disjoint slices overlap
    assert seconds((left, 1.0), (whole, 1.0)) >= 2.0  # the pool's call waits for device 0
    assert seconds((whole, 1.0), (right, 1.0)) >= 2.0  # and a slice's for the pool's
    assert 1.5 <= seconds((left, 1.0), (right, 0.2), (whole, 0.5)) < 2.3  # after both slices, not more

    with pytest.raises(PlacementError, match=r"slice 'far' of pool 'whole': devices \[1, 1\+2\) are not within"):
        session.slice("far", pool, 1, 2)
    with pytest.raises(ConfigError, match=r"slice pool 'whole' itself"):
        session.slice("nested", "left", 0, 1)
    with pytest.raises(ConfigError, match=r"names a slice of pool 'whole'"):
        session.pool("left", 1)
    squeezed = session.pool("squeezed", 2, max_colocate=2)
    session.group("b", EchoWorker, session.slice("b", squeezed, 1, 1))
    session.group("c", EchoWorker, session.slice("c", squeezed, 1, 1))
    with pytest.raises(DispatchError, match=r"already runs 2 separate group\(s\) on its device 1"):
        session.group("a", EchoWorker, squeezed)  # the pool's groups count its slices' on each device

    session.release(pool)
    assert "left" not in session.pools and "right" not in session.pools and "whole" not in session.pools
    with pytest.raises(GroupRemovedError, match="'whole' was released"):
        left.where()


def test_padding_or_refusal_when_rows_do_not_divide(session):
    group = session.group("g", EchoWorker, session.pool("two", 2))
    assert group.double(prompts(3)).get()["x"].tolist() == [0.0, 2.0, 4.0]
    with pytest.raises(DispatchError, match=r"g.strict_double: a Batch of 3 rows .* 2 equal"):
        group.strict_double(prompts(3))


def test_worker_error_names_role_rank_method_and_group_stays_usable(session):
    group = session.group("critic", EchoWorker, session.pool("two", 2))
    with pytest.raises(WorkerCallError) as err:
        group.fail_on(1).get()
    message = str(err.value)
    assert "critic.fail_on failed on rank 1" in message
    assert "ValueError: boom on purpose at rank 1" in message  # the remote traceback
    assert group.fail_on(5).get() == [0, 1]
    # Arguments that do not fit the method are refused on the driver, before any remote work.
    with pytest.raises(DispatchError, match=r"critic.fail_on\(self, rank.*unexpected keyword argument 'bogus'"):
        group.fail_on(1, bogus=2)
    with pytest.raises(DispatchError, match=r"critic.double\(self, batch.*missing a required argument: 'batch'"):
        group.double()


def test_killed_worker_is_reported_and_group_can_be_recreated(session):
    pool = session.pool("two", 2)
    group = session.group("actor", EchoWorker, pool)
    other = session.group("other", EchoWorker, session.pool("spare", 1))
    pid = group.where().get()[1]["pid"]
    store = group.hostset.store_file  # the ranks' rendezvous, a file on this machine
    assert store is not None and os.path.exists(store)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match=r"rank 1 of role .actor. \(pid \d+ on node .*\) died during actor.where"):
        group.where().get(timeout=60)
    assert other.where().get()[0]["rank"] == 0  # the rest of the session is fine
    group = session.group("actor", EchoWorker, pool)
    assert group.all_reduce().get() == [3.0, 3.0]
    assert not os.path.exists(store)  # the dead set's store went with it (torch could not delete it)


def test_a_start_past_its_bound_names_the_silent_ranks(session):
    """A group's start waits START_TIMEOUT_S for its processes' first answer (fetch_all's
    timeout), then names the ranks still silent, instead of waiting for ever on a process Ray
    cannot place. Here rank 1's answer never comes in time (a task that sleeps)."""
    from workbench.controller.future import CallInfo, fetch_all

    answer = ray.remote(lambda seconds: time.sleep(seconds) or seconds)
    refs = [answer.remote(0), answer.remote(600)]
    try:
        with pytest.raises(WorkerCallError, match=r"rank\(s\) \[(0, )?1\] did not answer within 10 s") as err:
            fetch_all(refs, CallInfo("late", "start", [0, 1], starting=True), [0, 1], timeout=10)
        assert not err.value.usable and "was not created" in str(err.value)
    finally:
        ray.cancel(refs[1], force=True)


def test_rerunning_a_group_cell_does_not_leak_actors(session):
    pool = session.pool("one", 1)
    session.group("cell", EchoWorker, pool)
    before = alive_actors()
    for _ in range(3):  # each re-run starts a process (~3 s): a leak per re-run shows after any of them
        group = session.group("cell", EchoWorker, pool)
    assert alive_actors() == before
    assert group.where().get()[0]["rank"] == 0


def test_trace_records_every_rank_and_exports_chrome_json(session, tmp_path):
    group = session.group("traced", EchoWorker, session.pool("two", 2))
    group.double(prompts(4)).get()
    records = [r for r in session.trace() if r.role == "traced" and r.method == "double"]
    assert sorted(r.rank for r in records) == [0, 1]
    assert all(r.ok and r.end >= r.fetched >= r.start and r.bytes_in > 0 and r.bytes_out > 0 for r in records)
    import json

    trace = json.loads(session.save_trace(tmp_path / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert "traced.double" in names


def test_futures_passed_between_groups_leave_no_references_behind(session):
    """A RemoteSlice travels without the driver's HostSet (its pool, pending refs and span tags):
    shipped along, every receiving worker borrowed those refs and the driver's grew per call."""
    source = session.group("src", EchoWorker, session.pool("one", 1))
    sink = session.group("dst", EchoWorker, session.pool("other", 1))

    def held() -> int:  # object references the driver's Ray core worker tracks
        return len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())

    future = source.double(prompts(4))
    shipped = ray.cloudpickle.loads(ray.cloudpickle.dumps(future.slice(0, 1)))
    assert shipped.source.hostset is None and shipped.source.role == "src"
    assert future.info.hostset is source.hostset  # the driver's own future keeps it (errors need it)
    for _ in range(20):
        sink.double(source.double(prompts(4))).get()
    before = held()
    for _ in range(300):
        sink.double(source.double(prompts(4))).get()
    assert held() <= before + 2


def test_fused_roles_share_processes_but_are_separate_groups(session):
    groups = session.fused(session.pool("fused", 2), actor=EchoWorker, reference=ReferenceLike)
    actor, reference = groups["actor"], groups["reference"]
    assert [w["pid"] for w in actor.where().get()] == [w["pid"] for w in reference.where().get()]
    assert reference.negate(actor.double(prompts(4))).get()["x"].tolist() == [0.0, -2.0, -4.0, -6.0]
    start = time.monotonic()
    a, b = actor.sleep(0.6), reference.negate(prompts(2))
    a.get(), b.get()
    assert time.monotonic() - start >= 0.6
    with pytest.raises(AttributeError, match="registered: .*negate"):
        _ = reference.double


def test_ctrl_c_while_waiting_leaves_session_usable():
    # In a fresh driver (tests/controller/ctrl_c_check.py), as in a user's kernel: the wait
    # on a 6 s call is interrupted at once (0.5 s in), and the group
    # still answers and hands over the call's result afterwards.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "tests.controller.ctrl_c_check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["interrupted"] and result["waited_s"] < 3.0, result
    assert result["rank"] == 0 and result["result"] == [6.0]


def test_a_batch_is_stored_once_only_when_ranks_share_it(shared_session):
    """A Batch for one rank travels inside its task; one that several ranks receive (tensor
    parallel replicas of a chunk) goes to the object store once and they share the reference."""
    from workbench.controller.worker_group import _put_once

    own, shared = prompts(2), prompts(4)
    sent = _put_once([own, shared, shared, 7])
    assert sent[0] is own and sent[3] == 7
    assert isinstance(sent[1], ray.ObjectRef) and sent[1] == sent[2]
    assert ray.get(sent[1]).equals(shared)
