"""A Ray cluster of separate hosts on one Linux machine: each host a network namespace.

    sudo .venv/bin/python -m workbench.deploy.netns_cluster up --hosts 2    # prints its name
    sudo .venv/bin/python -m workbench.deploy.netns_cluster exec NAME -- .venv/bin/python driver.py
    sudo .venv/bin/python -m workbench.deploy.netns_cluster down NAME
    sudo .venv/bin/python -m workbench.deploy.netns_cluster check NAME       # exit 1 on leftovers

Host i is the namespace NAME-h{i} with address .{i+1} of a private /24 (10.213.0.0/24 by
default), its own loopback, and a veth to a bridge that lives in a namespace of its own
(NAME-br): the hosts reach each other and nothing else, and nothing of the machine's own
network (interfaces, routes, firewall) is touched. Ray runs on each as it would on a real host:
`ray start --head --node-ip-address` on host 0 at a fixed port, `ray start --address` on the
others, each with its own --temp-dir, a resource `host{i}: 1`, and token authentication with a
token made for this cluster. Every host sees the same filesystem: `cluster.shared` stands for
the shared storage models and checkpoints live on. A driver runs inside a host (host 0, as on a
head node) with `cluster.env()`: RAY_ADDRESS and the token's path.

Teardown never runs `ray stop`, which stops every Ray process of the machine (it matches
process names, not namespaces): it ends the processes inside this cluster's namespaces, then
deletes the namespaces, which takes their links with them. It runs again safely.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from workbench.errors import ConfigError
from workbench.ray_settings import SYSTEM_CONFIG

STATE = "cluster.json"
MAX_NAME = 11  # a link name is at most 15 characters: NAME-b{i}


@dataclass(frozen=True)
class Link:
    """A shaped link on one host's veth, both directions."""

    rate: str | None = None
    """Bandwidth, tc syntax ("100mbit"): a tbf qdisc."""
    delay: str | None = None
    """One-way delay ("5ms"): a netem qdisc (needs the kernel's sch_netem module)."""
    burst: str = "64kb"
    """tbf's bucket: at least rate / the kernel's HZ (64kb holds to about 500mbit)."""


@dataclass
class NetnsCluster:
    """A running cluster (made by `NetnsCluster.up`), or the record of one (`load`)."""

    name: str
    hosts: int
    subnet: str
    port: int
    root: str
    """This cluster's directory: state, token, each host's Ray temp dir, shared/."""
    netns_inodes: dict[str, int] = field(default_factory=dict)
    """Namespace -> inode of its /proc/*/ns/net link: finds processes left in a deleted one."""
    pids: list[tuple[int, float]] = field(default_factory=list)
    """(pid, create time) of the Ray processes each host ran after start."""
    cpus: int = 2
    """Ray CPUs per host."""
    object_store_mb: int = 256
    node_timeout_s: float = 0.0
    """How long the head waits for a silent host before giving its node up (its health checks:
    a third of it apart, 3 missed); 0: Ray's defaults (about a minute)."""

    # ---- where things are ------------------------------------------------------------------
    def namespace(self, host: int) -> str:
        return f"{self.name}-h{host}"

    def host_ip(self, host: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[host + 1])

    @property
    def address(self) -> str:
        """The head's GCS address, for Session(address=...) or RAY_ADDRESS."""
        return f"{self.host_ip(0)}:{self.port}"

    @property
    def shared(self) -> Path:
        """A directory every host sees at the same path (models, checkpoints)."""
        return Path(self.root) / "shared"

    @property
    def token_path(self) -> Path:
        return Path(self.root) / "auth_token"

    def namespaces(self) -> list[str]:
        return [f"{self.name}-br", *(self.namespace(h) for h in range(self.hosts))]

    def env(self) -> dict[str, str]:
        """The environment of a driver or Ray process in this cluster: this cluster's token
        (not ~/.ray/auth_token, not a RAY_AUTH_TOKEN of the caller) and its address."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_ADDRESS")}
        return env | {
            "RAY_ADDRESS": self.address,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            "RAY_USAGE_STATS_ENABLED": "0",
        }

    def command(self, argv: list[str], host: int = 0) -> list[str]:
        """argv run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def run(self, argv: list[str], host: int = 0, **kwargs) -> subprocess.CompletedProcess:
        """Run argv on `host` with `env()` (extra `env=` entries are added to it)."""
        env = self.env() | kwargs.pop("env", {})
        return subprocess.run(self.command(argv, host), env=env, **kwargs)

    # ---- up ----------------------------------------------------------------------------------
    @classmethod
    def up(
        cls,
        hosts: int = 2,
        cpus: int = 2,
        name: str | None = None,
        subnet: str = "10.213.0.0/24",
        port: int = 6379,
        object_store_mb: int = 256,
        links: dict[int, Link] | None = None,
        timeout: float = 120.0,
        node_timeout_s: float = 0.0,
    ) -> NetnsCluster:
        """Make the namespaces and network, start Ray on every host and wait until each node
        is alive. On any failure everything made so far is removed before the error rises."""
        name = name or f"hfw-{os.getpid()}"
        _check(hosts, cpus, name, subnet, links or {})
        root = Path(tempfile.gettempdir()) / name
        if root.exists() or any(n.startswith(f"{name}-") for n in _netns_list()):
            fix = f"{root} or its namespaces exist: `down {name}`, or pick another name"
            raise ConfigError("NetnsCluster name", name, fix)
        root.mkdir(mode=0o700)
        cluster = cls(name, hosts, subnet, port, str(root), cpus=cpus, object_store_mb=object_store_mb)
        cluster.node_timeout_s = node_timeout_s
        try:
            cluster._network(links or {})
            cluster._start_ray(timeout)
        except BaseException:
            cluster.down()
            raise
        return cluster

    def _network(self, links: dict[int, Link]) -> None:
        bridge, prefix = f"{self.name}-br", ipaddress.ip_network(self.subnet).prefixlen
        for ns in self.namespaces():
            _sh("ip", "netns", "add", ns)
            self.netns_inodes[ns] = os.stat(f"/run/netns/{ns}").st_ino
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", bridge, "link", "add", bridge, "type", "bridge")
        _sh("ip", "-n", bridge, "link", "set", bridge, "up")
        for h in range(self.hosts):
            ns, outer, inner = self.namespace(h), f"{self.name}-b{h}", f"{self.name}-v{h}"
            # Both ends are born inside namespaces: the machine's own namespace never sees them.
            _sh("ip", "-n", bridge, "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
            _sh("ip", "-n", bridge, "link", "set", outer, "master", bridge, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.host_ip(h)}/{prefix}", "dev", inner)
            _sh("ip", "-n", ns, "link", "set", inner, "up")
            if h in links:
                _shape(ns, inner, links[h])
                _shape(bridge, outer, links[h])
        self._save()

    def _start_ray(self, timeout: float) -> None:
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        self.shared.mkdir()
        finish_start(self._ray_start(0), "the head", timeout)  # the others join the head: it first
        starts = [(h, self._ray_start(h)) for h in range(1, self.hosts)]
        for h, start in starts:
            finish_start(start, f"host {h}", timeout)
        self.wait_for_nodes(timeout)
        self._record_pids()

    def _ray_start(self, h: int) -> subprocess.Popen:
        ray = str(Path(sys.executable).with_name("ray"))
        config = dict(SYSTEM_CONFIG)  # as a Session's own Ray (the head's config is the cluster's)
        if self.node_timeout_s:
            check_ms = int(self.node_timeout_s * 1000 / 3)
            config |= {"health_check_period_ms": check_ms, "health_check_timeout_ms": check_ms}
            config |= {"health_check_failure_threshold": 3}
        head = ["--head", "--port", str(self.port), "--include-dashboard", "false"]
        head += ["--system-config", json.dumps(config)]
        argv = [ray, "start", *(head if h == 0 else ["--address", self.address])]
        argv += ["--node-ip-address", self.host_ip(h), "--num-cpus", str(self.cpus)]
        argv += ["--resources", json.dumps({f"host{h}": 1}), "--temp-dir", f"{self.root}/ray-h{h}"]
        argv += ["--object-store-memory", str(self.object_store_mb * 2**20), "--disable-usage-stats"]
        return subprocess.Popen(
            self.command(argv, h), env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def _record_pids(self) -> None:
        """Add the processes now in the cluster's namespaces to those recorded (skipping any that
        ended meanwhile: a worker comes and goes)."""
        found = [p for ns in self.namespaces() for p in map(live_process, _netns_pids(ns)) if p]
        self.pids = list(dict.fromkeys([*self.pids, *((p.pid, p.create_time()) for p in found)]))
        self._save()

    # ---- faults ------------------------------------------------------------------------------
    def kill_host(self, host: int) -> int:
        """A host that dies: SIGKILL every process in its namespace (its raylet, object store,
        agents and workers; its address stays). How many there were."""
        if host == 0:
            raise ConfigError("NetnsCluster.kill_host host", host, "host 0 runs the head: kill another host")
        procs = [p for p in map(live_process, _netns_pids(self.namespace(host))) if p]
        for p in procs:
            send_signal(p, signal.SIGKILL)
        wait_gone(procs, 10.0)
        return len(procs)

    def set_link(self, host: int, up: bool) -> None:
        """Pull (or plug back) the host's cable: its end on the bridge goes down, so its packets
        vanish without an error to either side, as on a dead link."""
        _sh("ip", "-n", f"{self.name}-br", "link", "set", f"{self.name}-b{host}", "up" if up else "down")

    def rejoin(self, host: int, timeout: float = 120.0) -> None:
        """Start the host's Ray node again (joining the head), after whatever is left of the old
        one is killed; returns once every host is alive."""
        self.kill_host(host)
        finish_start(self._ray_start(host), f"host {host}", timeout)
        self.wait_for_nodes(timeout)
        self._record_pids()

    def wait_for_nodes(self, timeout: float = 120.0) -> None:
        """Return once every host's node is alive in the head's view (asked from host 0)."""
        probe = (
            "import ray, sys, time; ray.init(logging_level='ERROR'); end = time.time() + float(sys.argv[2])\n"
            "while sum(n['Alive'] for n in ray.nodes()) < int(sys.argv[1]) and time.time() < end: time.sleep(0.2)\n"
            "sys.exit(sum(n['Alive'] for n in ray.nodes()) < int(sys.argv[1]))"
        )
        run = self.run([sys.executable, "-c", probe, str(self.hosts), str(timeout)], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(
                f"cluster {self.name}: not every one of {self.hosts} nodes came alive within {timeout:.0f} s; "
                f"the hosts' Ray logs are under {self.root}/ray-h*/session_latest/logs\n{run.stderr[-2000:]}"
            )

    # ---- down --------------------------------------------------------------------------------
    def down(self, grace: float = 1.0) -> None:
        """End every process in this cluster's namespaces (and the recorded ones), delete the
        namespaces (their links go with them) and the directory. Safe to run again. SIGTERM,
        then SIGKILL after `grace` s: gcs_server and the raylet outlast a SIGTERM by seconds,
        and nothing of this cluster is kept."""
        ours = [ns for ns in _netns_list() if ns.startswith(f"{self.name}-")]
        inside = {p for ns in ours for p in _netns_pids(ns)} | set(_in_netns(set(self.netns_inodes.values())))
        procs = [p for p in map(live_process, sorted(inside)) if p]
        procs += [p for p in (live_process(pid, created) for pid, created in self.pids) if p and p not in procs]
        for p in procs:
            send_signal(p, signal.SIGTERM)
        for p in wait_gone(procs, grace):
            send_signal(p, signal.SIGKILL)
        wait_gone(procs, 10.0)
        for ns in ours:
            for late in map(live_process, _netns_pids(ns)):  # started by a dying raylet after the first sweep
                if late:
                    send_signal(late, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What of this cluster still exists: namespaces, links in the machine's own namespace
        with its name, processes in one of its namespaces (even a deleted one), its directory."""
        found = [f"namespace {ns}" for ns in _netns_list() if ns.startswith(f"{self.name}-")]
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        found += [f"link {line.split(':')[1].strip()}" for line in links.splitlines() if f": {self.name}-" in line]
        for pid in _in_netns(set(self.netns_inodes.values())):
            if p := live_process(pid):
                found.append(f"process {pid} {' '.join(p.cmdline())[:80]}")
        found += [f"process {p.pid} (recorded)" for pid, c in self.pids if (p := live_process(pid, c))]
        found += [f"directory {self.root}"] if Path(self.root).exists() else []
        return sorted(set(found))

    # ---- state -------------------------------------------------------------------------------
    def _save(self) -> None:
        (Path(self.root) / STATE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, name: str) -> NetnsCluster:
        """The cluster `up` made under this name (its record, or enough of one to tear down)."""
        state = Path(tempfile.gettempdir()) / name / STATE
        if state.exists():
            data = json.loads(state.read_text())
            data["pids"] = [tuple(p) for p in data["pids"]]
            return cls(**data)
        return cls(name, 0, "10.213.0.0/24", 6379, str(state.parent))  # down() finds namespaces by name


def _check(hosts: int, cpus: int, name: str, subnet: str, links: dict[int, Link]) -> None:
    if not isinstance(hosts, int) or not 2 <= hosts <= 8:
        raise ConfigError("NetnsCluster hosts", hosts, "pick 2 to 8 hosts")
    if not isinstance(cpus, int) or cpus < 1:
        raise ConfigError("NetnsCluster cpus", cpus, "give each host at least 1 CPU")
    if not name or len(name) > MAX_NAME or not all(c.isalnum() or c == "-" for c in name):
        raise ConfigError("NetnsCluster name", name, f"use letters, digits and '-', at most {MAX_NAME} characters")
    net = ipaddress.ip_network(subnet)
    if not net.is_private or net.prefixlen != 24:
        raise ConfigError("NetnsCluster subnet", subnet, "use a private /24, e.g. 10.213.0.0/24")
    if any(h not in range(hosts) for h in links):
        raise ConfigError("NetnsCluster links", links, f"shape hosts 0..{hosts - 1}")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise ConfigError("NetnsCluster", "this user", "run as root (network namespaces), with iproute2's `ip`")


def _shape(ns: str, dev: str, link: Link) -> None:
    qdisc = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root"]
    if link.delay:  # netem shapes the rate too
        rate = ["rate", link.rate] if link.rate else []
        run = subprocess.run([*qdisc, "netem", "delay", link.delay, *rate], capture_output=True, text=True)
        if run.returncode:
            why = "this kernel may lack sch_netem; shape the rate alone"
            raise RuntimeError(f"tc netem on {dev}: {run.stderr.strip()} ({why})")
    elif link.rate:
        _sh(*qdisc, "tbf", "rate", link.rate, "burst", link.burst, "latency", "400ms")


def _sh(*argv: str) -> None:
    run = subprocess.run(argv, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {run.stderr.strip()}")


def finish_start(start: subprocess.Popen, who: str, timeout: float) -> None:
    try:
        out, _ = start.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        start.kill()
        out, _ = start.communicate()
    if start.returncode:
        raise RuntimeError(f"`ray start` on {who} failed (exit {start.returncode}):\n{out[-3000:]}")


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _in_netns(inodes: set[int]) -> list[int]:
    """Processes in one of these network namespaces, found by inode: also in a deleted one."""
    found = []
    for pid in psutil.pids():
        try:
            link = os.readlink(f"/proc/{pid}/ns/net")  # "net:[4026532174]"
        except OSError:
            continue
        if int(link.split("[")[1].rstrip("]")) in inodes:
            found.append(pid)
    return found


def live_process(pid: int, created: float | None = None) -> psutil.Process | None:
    """The live process `pid`, if it is still the one created at `created` (pids are reused).
    A zombie is gone: it holds no namespace, only a pid its new parent has not reaped yet."""
    try:
        p = psutil.Process(pid)
        same = created is None or abs(p.create_time() - created) < 0.01
        return p if same and p.status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `procs` still alive after up to `timeout` s."""
    end = time.time() + timeout
    while (alive := [p for p in procs if live_process(p.pid, p.create_time())]) and time.time() < end:
        time.sleep(0.05)
    return alive


def send_signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def main(argv: list[str] | None = None) -> int:
    prog, about = "python -m workbench.deploy.netns_cluster", __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog=prog, description=about)
    sub = parser.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="make the hosts and start Ray; prints the cluster's name")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--cpus", type=int, default=2, help="Ray CPUs per host")
    up.add_argument("--name", help="namespace prefix (default hfw-<pid>)")
    up.add_argument("--subnet", default="10.213.0.0/24")
    up.add_argument("--shape", type=int, help="host whose link is shaped by --rate/--delay")
    up.add_argument("--rate", help='e.g. "100mbit"')
    up.add_argument("--delay", help='e.g. "5ms" (needs sch_netem)')
    up.add_argument("--node-timeout", type=float, default=0.0, help="seconds before a silent host is given up")
    run = sub.add_parser("exec", help="run a command on a host with the cluster's driver environment")
    run.add_argument("name")
    run.add_argument("--host", type=int, default=0)
    run.add_argument("argv", nargs="+")
    for verb, text in (("down", "stop Ray and remove every namespace and link"), ("check", "list leftovers")):
        sub.add_parser(verb, help=text).add_argument("name")
    args = parser.parse_args(argv)
    if args.verb == "up":
        links = {args.shape: Link(rate=args.rate, delay=args.delay)} if args.shape is not None else {}
        cluster = NetnsCluster.up(
            args.hosts, args.cpus, args.name, args.subnet, links=links, node_timeout_s=args.node_timeout
        )
        print(cluster.name)
        print(f"# Ray at {cluster.address}, shared directory {cluster.shared}", file=sys.stderr)
        return 0
    cluster = NetnsCluster.load(args.name)
    if args.verb == "exec":
        return cluster.run(args.argv, args.host).returncode
    if args.verb == "down":
        cluster.down()
    left = cluster.leftovers()
    print("\n".join(left) or "nothing left", file=sys.stderr)
    return int(bool(left))


if __name__ == "__main__":
    sys.exit(main())
