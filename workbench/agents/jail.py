"""The jail a tool sandbox runs in: the kernel's namespaces through Debian's bubblewrap (`bwrap`).

    jail_command(["python", "-I", "child.py"], disk_mib=64)  # -> ["bwrap", ..., "python", ...]

Inside, a tool process
- runs as an unprivileged user: a uid of its own when the workbench runs as root (dropped to with
  `setpriv` after the jail is built), the caller's own uid in a user namespace otherwise;
- has its own pid, mount, network, ipc and uts namespaces: no process outside is visible or can be
  signalled, and the network is only a loopback of its own;
- sees the interpreter and its libraries read-only, a fresh /proc of its own namespace, a minimal
  /dev, and a private scratch directory (a tmpfs of `disk_mib`) as its working directory. Nothing
  else of the host's filesystem (no /etc, no home, no project) exists there;
- has no environment variables of the caller's (API keys stay outside).

Limits per process (file size, processes, memory, CPU seconds) are set by the child itself
(workbench/agents/sandbox_child.py), before any tool code runs.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import PurePosixPath

SCRATCH = "/scratch"
"""The tool's working directory inside the jail."""
UIDS = range(3_000_000, 4_000_000)
"""Unprivileged uids for jails started by root: no account uses them, so a jailed process owns no
file of the host's and can signal no process but its jail's. A fresh one, unused by any process,
for each jail started, so the process cap (RLIMIT_NPROC counts per uid) is each jail's own."""


@functools.cache
def unavailable() -> str | None:
    """Why no jail can be built on this machine (None: it can). Probed once per process."""
    if sys.platform != "linux":
        return f"tool jails need Linux namespaces; this is {sys.platform}"
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    try:
        done = subprocess.run(
            jail_command(["/bin/true"], disk_mib=1), capture_output=True, text=True, timeout=30, env={}
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bubblewrap could not start: {err}"
    if done.returncode != 0:
        return f"bubblewrap could not build namespaces here: {done.stderr.strip() or done.returncode}"
    return None


def readable_roots() -> list[str]:
    """What a tool may read: the interpreter (its prefix and the base it was built from) and the
    system's libraries."""
    return sorted({os.path.realpath(root) for root in (sys.prefix, sys.base_prefix, "/usr")})


def new_uid() -> int | None:
    """A jail's own uid when the workbench runs as root (None otherwise: the caller's uid): drawn
    at random from UIDS until no process runs as it (not even a killed jail's last ones)."""
    if os.geteuid() != 0:
        return None
    for _ in range(100):
        uid = UIDS[secrets.randbelow(len(UIDS))]
        if uid not in _running_uids():
            return uid
    raise RuntimeError(f"no free uid for a tool jail in {UIDS}")


def _running_uids() -> set[int]:
    """The real uids of this machine's processes (from status: a jail's /proc entries are root's)."""
    uids = set()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as status:
                uids.update(int(line.split()[1]) for line in status if line.startswith("Uid:"))
        except (OSError, ValueError, IndexError):
            pass
    return uids


def jail_command(
    command: list[str],
    disk_mib: int,
    network: bool = False,
    files: dict[str, str] | None = None,
    uid: int | None = None,
) -> list[str]:
    """`command` run in a fresh jail (see the module's docstring), with `files` ({path inside:
    host path}) bound read-only beside the interpreter, as `uid` (root only: see new_uid)."""
    argv = [
        shutil.which("bwrap") or "bwrap",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",  # the driver's end is the jail's end
        "--new-session",  # no terminal to inject keystrokes into
        "--clearenv",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
    ]
    if not network:
        argv.append("--unshare-net")  # a loopback of its own, nothing else
    binds = [(root, root) for root in readable_roots()] + [(host, inside) for inside, host in (files or {}).items()]
    # The folders above each bound path, traversable: bwrap would make them 0700 (root's).
    above = sorted({str(p) for _, inside in binds for p in PurePosixPath(inside).parents if str(p) != "/"})
    for folder in above:
        argv += ["--perms", "0755", "--dir", folder]
    for host, inside in binds:
        argv += ["--ro-bind", host, inside]
    for link in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(link):  # merged /usr: the links, not the host's targets
            argv += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            argv += ["--ro-bind", link, link]
    argv += ["--size", str(disk_mib * 2**20), "--perms", "1777", "--tmpfs", SCRATCH, "--chdir", SCRATCH]
    argv += ["--setenv", "HOME", SCRATCH, "--setenv", "TMPDIR", SCRATCH, "--setenv", "PATH", "/usr/bin:/bin"]
    argv += ["--setenv", "LANG", "C.UTF-8"]
    # Nothing writable but the scratch directory (unprivileged, / and /dev would be the caller's).
    argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
    if os.geteuid() == 0:
        # Built as root (no user namespace, so uid 0 inside would be root outside): drop to a uid
        # of its own with no capabilities, and no way back (no_new_privs).
        uid = uid if uid is not None else new_uid()
        assert uid is not None
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--"]
        argv += ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        argv += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    else:
        argv += ["--unshare-user", "--"]  # the caller's own uid, mapped into a user namespace
    return argv + command
