"""Run as a script (its own driver and Ray, like a user's fresh kernel): Ctrl-C while waiting
on a long call. Prints one JSON line with what happened; the pytest test asserts on it.

Own process because the interrupt is delivered to the driver's main thread: inside the long
test session, earlier tests' driver state made the delivery unreliable (the wait outlived it).
"""

import json
import os
import signal
import threading
import time

import ray

import tests.controller.workers as workers
from workbench import Session


def main() -> None:
    # Python's own Ctrl-C handler, as a kernel has it: a child inherits an ignored SIGINT from
    # its parent (the long test session's driver ignores it), and then no interrupt arrives.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ray.cloudpickle.register_pickle_by_value(workers)
    with Session(num_devices=1) as session:
        group = session.group("slow", workers.EchoWorker, session.pool("one", 1))
        future = group.sleep(6.0)
        # A real SIGINT, as a kernel's interrupt button sends.
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            future.get()
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        waited = time.monotonic() - start
        rank = group.where().get()[0]["rank"]
        print(json.dumps({"interrupted": interrupted, "waited_s": waited, "rank": rank, "result": future.get()}))


if __name__ == "__main__":
    main()
