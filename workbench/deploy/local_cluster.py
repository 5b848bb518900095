"""A Ray cluster on this machine, started the way a cluster's head is (`ray start --head`), for a
notebook or a test to attach a Session to, detach from and attach to again: it outlives every
driver, as a real cluster does. One node, reached at 127.0.0.1 (Ray registers it under the
machine's own address and its servers listen on every interface; the hosts of a NetnsCluster
need root).

    cluster = LocalCluster.up(cpus=4)
    os.environ.update(cluster.env())          # the driver's side: the cluster's token
    session = Session(address=cluster.address)
    ...
    session.shutdown()                        # detaches; the cluster keeps running
    cluster.down()

Like a real cluster it guards its servers with a token of its own (docs/cluster.md): a driver
attaches with `env()`. `down()` ends this cluster's processes and nothing else: never `ray stop`,
which ends every Ray process of the machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from workbench import checks
from workbench.deploy.netns_cluster import finish_start, live_process, send_signal, wait_gone
from workbench.ray_settings import START_TIMED_OUT, SYSTEM_CONFIG


@dataclass(frozen=True)
class LocalCluster:
    """A running one-node cluster (made by `LocalCluster.up`)."""

    root: str
    """Its directory: the token, and Ray's temp dir (ray/) every Ray process of it names."""
    port: int
    cpus: int
    raylets: set[int] = field(default_factory=set)
    """Pids of its raylets seen so far: their workers' environment names them (RAY_RAYLET_PID),
    so a worker is found also once its raylet is gone."""

    @property
    def address(self) -> str:
        """The head's GCS address, for Session(address=...) or RAY_ADDRESS."""
        return f"127.0.0.1:{self.port}"

    @property
    def token_path(self) -> Path:
        return Path(self.root) / "auth_token"

    def env(self) -> dict[str, str]:
        """What a driver needs in its environment to attach: the token's mode and path."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}

    @classmethod
    def up(cls, cpus: int = 4, timeout: float = 120.0) -> LocalCluster:
        """Start the head and return once it serves. On a failure, what started is ended."""
        checks.whole("LocalCluster", "cpus", cpus, fix="give the cluster at least 1 CPU")
        # Short: Ray's socket paths under it must fit a Unix socket's 107 characters.
        root = tempfile.mkdtemp(prefix="hfw-ray-")
        cluster = cls(root, _free_port(), cpus)
        cluster.token_path.write_text(secrets.token_hex(32))
        cluster.token_path.chmod(0o600)
        ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray") or "ray"
        argv = [ray, "start", "--head", "--port", str(cluster.port), "--num-cpus", str(cpus)]
        argv += ["--temp-dir", f"{root}/ray", "--include-dashboard", "false", "--disable-usage-stats"]
        argv += ["--system-config", json.dumps(SYSTEM_CONFIG)]  # as a Session's own Ray
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_ADDRESS")} | cluster.env()
        tries = 2
        while True:
            tries -= 1
            try:
                start = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                finish_start(start, "the head", timeout)
                cluster.processes()  # notes its raylet
                return cluster
            except BaseException as error:
                # Ray gives its raylet a fixed 30 s to register: a loaded machine can miss it once.
                if tries and START_TIMED_OUT in str(error):
                    cluster.end_processes()
                    continue
                cluster.down()
                raise

    def processes(self) -> list[psutil.Process]:
        """This cluster's live processes: Ray's own (gcs_server, raylet, agents, log monitor:
        Ray's programs or Python, with an argument under its temp dir), and what its raylets
        started (workers rename themselves "ray::...": found by the raylet they name)."""
        ours, programs = f"{self.root}/ray", _ray_programs()
        found = {}
        for p in psutil.process_iter(["cmdline", "exe", "name"]):
            cmdline, exe = p.info["cmdline"] or (), p.info["exe"] or ""
            if any(ours in part for part in cmdline) and (exe.startswith(programs) or exe == PYTHON):
                found[p.pid] = p
                if p.info["name"] == "raylet":
                    self.raylets.add(p.pid)
        for p in psutil.process_iter():
            if p.pid not in found and self.raylets:
                try:
                    if int(p.environ().get("RAY_RAYLET_PID", 0)) in self.raylets:
                        found[p.pid] = p
                except (psutil.Error, ValueError):
                    pass
        return [p for p in found.values() if live_process(p.pid)]

    def down(self, grace: float = 1.0) -> None:
        """End the cluster's processes and remove its directory. Safe to run again."""
        self.end_processes(grace)
        shutil.rmtree(self.root, ignore_errors=True)

    def end_processes(self, grace: float = 1.0) -> None:
        """SIGTERM, then SIGKILL after `grace` s: gcs_server and the raylet outlast a SIGTERM."""
        procs = self.processes()
        for p in procs:
            send_signal(p, signal.SIGTERM)
        for p in wait_gone(procs, grace):
            send_signal(p, signal.SIGKILL)
        wait_gone(procs, 10.0)
        for late in self.processes():  # started by a dying raylet after the first sweep
            send_signal(late, signal.SIGKILL)
        wait_gone(self.processes(), 10.0)

    def leftovers(self) -> list[str]:
        """What of this cluster still exists: processes, its directory."""
        found = [f"process {p.pid} {p.name()}" for p in self.processes()]
        return found + ([f"directory {self.root}"] if Path(self.root).exists() else [])


PYTHON = os.path.realpath(sys.executable)


def _ray_programs() -> str:
    """Where Ray's own programs (gcs_server, raylet) live, found without importing Ray (a
    driver's environment must be set before Ray is imported)."""
    spec = importlib.util.find_spec("ray")
    return os.path.realpath(list(spec.submodule_search_locations or [""])[0]) if spec else "\0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
