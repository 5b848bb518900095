"""Every socket the workbench opens in a single-machine session listens on loopback.

Listing the listening sockets of the session's real worker processes (psutil): what is left
after taking out Ray's own core-worker server must all be on 127.0.0.1 / ::1. Ray's servers
themselves listen on every interface in Ray 2.60 (guarded by its token auth; see docs/controller.md)."""

import ipaddress

import psutil
import ray

from tests.controller.workers import EchoWorker
from workbench import Mesh


def listening(pid: int) -> list[tuple[str, int]]:
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def ray_ports(group) -> set[int]:
    """The core-worker gRPC port Ray opened in each of the group's processes."""
    ids = [h._actor_id.hex() for h in group.hostset.hosts]
    return {ray._private.state.actors(actor_id=i)["Address"]["Port"] for i in ids}


def test_worker_sockets_of_a_single_machine_session_are_on_loopback(session):
    group = session.group("model", EchoWorker, session.pool("four", 4), mesh=Mesh(tp=2, dp=2))
    assert group.all_reduce().get() == [10.0] * 4  # the process group is up and has talked
    group.where().get()

    ours = {}
    for pid, *_ in group.hostset.identities:
        sockets = [s for s in listening(pid) if s[1] not in ray_ports(group)]
        ours[pid] = sockets
    assert any(ours.values()), "the gloo process group should have opened listeners"
    exposed = {pid: [s for s in socks if not ipaddress.ip_address(s[0]).is_loopback] for pid, socks in ours.items()}
    assert not any(exposed.values()), f"sockets on a non-loopback address: {exposed} (all: {ours})"
