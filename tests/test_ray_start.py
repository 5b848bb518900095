"""Starting a local Ray on a machine under load: Ray gives its raylet a fixed 30 s to register,
and a suite's worth of load once made a notebook's start miss it. Session starts it again
(workbench.session.start_local_ray). Ray's own start is replaced here by one that fails as that
start did: the retry, and the cleanup of what the failed start left, are what is tested."""

import os
import subprocess
import sys
import time

import pytest
import ray

from workbench.session import STARTS, start_local_ray

SLEEP = "import time; time.sleep(60)"
TIMED_OUT = (
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


@pytest.fixture
def starts(monkeypatch):
    """Each ray.init's arguments; the first fails as a start under load does, leaving a process
    of Ray's behind (its command line in Ray's package, as a raylet's is), while this process's
    other work starts a child of its own meanwhile."""
    calls, left = [], {}
    package = os.path.dirname(ray.__file__)

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            left["ray"] = subprocess.Popen([sys.executable, "-c", SLEEP, os.path.join(package, "raylet")])
            left["other"] = subprocess.Popen([sys.executable, "-c", SLEEP])
            time.sleep(0.5)  # both running before the cleanup looks
            raise Exception(TIMED_OUT)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # this process's Ray (a shared one) stays
    yield calls, left
    for process in left.values():
        process.kill()
        process.wait()


def test_a_start_that_times_out_is_cleaned_up_and_tried_again(starts, capsys):
    calls, left = starts
    start_local_ray(num_cpus=2, include_dashboard=False)
    assert calls == [{"num_cpus": 2, "include_dashboard": False}] * 2
    assert left["ray"].poll() is not None  # the failed start's process was ended
    assert left["other"].poll() is None  # a child of other work is left alone
    assert "starting it again" in capsys.readouterr().err


@pytest.mark.parametrize("error, tries", [("bad argument", 1), (TIMED_OUT, STARTS)])
def test_other_errors_at_once_and_the_last_timeout_are_raised(monkeypatch, error, tries):
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise Exception(error)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(Exception, match=error[:20]):
        start_local_ray()
    assert len(calls) == tries


def test_the_docs_start_a_cluster_head_as_a_session_starts_its_ray():
    """docs/cluster.md's `ray start --head --system-config` is the workbench's own."""
    import json
    import re
    from pathlib import Path

    from workbench.ray_settings import SYSTEM_CONFIG

    page = (Path(__file__).resolve().parents[1] / "docs" / "cluster.md").read_text()
    [given] = re.findall(r"--system-config='(\{.*?\})'", page)
    assert json.loads(given) == SYSTEM_CONFIG
