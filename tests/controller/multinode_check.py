"""Run as a script (its own Ray): a pool spread over two nodes of a simulated cluster.

ray.cluster_utils.Cluster starts a head and a second node (separate raylets) on this machine.
Prints one JSON line with what the group saw; the pytest test asserts on it.
"""

import json
import os
import sys
import tempfile

import ray
from ray.cluster_utils import Cluster

import tests.controller.workers as workers
from workbench import Mesh, Session


def main() -> None:
    ray.cloudpickle.register_pickle_by_value(workers)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    session = Session(address=cluster.address)
    try:
        pool = session.pool("spread", [2, 2])
        group = session.group("model", workers.EchoWorker, pool, mesh=Mesh(tp=2, dp=2))
        where = group.where().get()
        result = {
            "nodes_by_rank": [w["node"] for w in where],
            "pool_nodes": pool.node_ids,
            "cluster_nodes": [n["NodeID"] for n in ray.nodes() if n["Alive"]],
            "all_reduce": group.all_reduce().get(),
            "world": [w["world"] for w in where],
        }
    finally:
        session.shutdown()
        cluster.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="wb-ray-"))
    sys.exit(main())
