"""Starting a local Ray on a machine under load: Ray gives its raylet a fixed 30 s to register,
and a suite's worth of load once made a notebook's start miss it. Session starts it again
(workbench.session.start_local_ray). Ray's own start is replaced here by one that fails as that
start did: the retry, and the cleanup of what the failed start left, are what is tested."""

import subprocess

import pytest
import ray

from workbench.session import STARTS, start_local_ray

TIMED_OUT = (
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


@pytest.fixture
def starts(monkeypatch):
    """Each ray.init's arguments; the first fails as a start under load does, leaving a child
    process behind (a raylet of the failed start)."""
    calls, left = [], []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            left.append(subprocess.Popen(["sleep", "60"]))
            raise Exception(TIMED_OUT)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # this process's Ray (a shared one) stays
    return calls, left


def test_a_start_that_times_out_is_cleaned_up_and_tried_again(starts, capsys):
    calls, left = starts
    start_local_ray(num_cpus=2, include_dashboard=False)
    assert calls == [{"num_cpus": 2, "include_dashboard": False}] * 2
    assert left[0].wait(timeout=10) is not None  # the failed start's process was ended
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
