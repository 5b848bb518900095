"""How the workbench starts a Ray of its own: a Session's embedded Ray, a LocalCluster's head, a
NetnsCluster's head. No Ray import here: a driver that attaches to a cluster with a token must
set its environment before Ray is imported (Ray reads it then)."""

SYSTEM_CONFIG = {
    # Ray lowers its workers' priority (nice 15) below the driver's; here the workers do the
    # run's compute, so they keep normal priority: any other process on the machine (a peer
    # trainer in a benchmark, a build) would otherwise take the cores from them.
    "worker_niceness": 0,
    # Ray starts idle workers for tasks (one per CPU at start, more when a driver connects);
    # the workbench's groups are actors with processes of their own, so those would only take
    # the cores while the first groups start.
    "enable_worker_prestart": False,
    "prestart_worker_first_driver": False,
}

START_TIMED_OUT = "timed out during startup"
"""Ray's error when a new raylet misses its fixed 30 s to register (ray/_private/node.py, no
setting): a loaded machine can miss it once, and the start is worth one more try."""
