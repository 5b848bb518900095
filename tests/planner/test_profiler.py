"""The profiler on real Ray workers: a few tiny shapes, then a fit that predicts them."""

import json
from dataclasses import replace

import pytest

from workbench.deploy import profiler
from workbench.deploy.profiler import ProfileShapes, calibrate
from workbench.models import make_tiny
from workbench.planner import cluster_preset

TINY = ProfileShapes(
    forward=((4, 8, 8), (8, 16, 8)),
    sharded_forward=((4, 8, 8),),
    generate=((2, 8, 4), (8, 8, 8)),
    rows_per_step=4,
    repeats=1,
    allreduce_bytes=(1 << 12, 1 << 20),
)


def test_profile_and_fit_on_workers(session, tmp_path_factory, monkeypatch):
    models = {"kit-1m": str(make_tiny("1m", tmp_path_factory.mktemp("models") / "tiny-1m"))}
    cache = tmp_path_factory.mktemp("calibration") / "local.json"
    cal = calibrate(session, models, TINY, devices=2, cache=cache)
    assert not {"calibration_one", "calibration_all"} & set(session.pools)  # the probes are gone
    # Cached: the same machine, models, shapes and devices load it and profile nothing.
    monkeypatch.setattr(profiler, "Profiler", None)  # calling it would fail
    again = calibrate(session, models, TINY, devices=2, cache=cache)
    assert json.loads(json.dumps(again.to_dict())) == json.loads(json.dumps(cal.to_dict()))  # as JSON holds them
    with pytest.raises(TypeError):  # other shapes: profiled again
        calibrate(session, models, replace(TINY, repeats=2), devices=2, cache=cache)
    monkeypatch.undo()
    kinds = sorted({t.kind for t in cal.timings})
    assert kinds == ["generate", "inference", "sync", "train"] and len(cal.timings) == 6 + 3
    sharded = [t for t in cal.timings if t.dp == 2]
    assert sorted(t.kind for t in sharded) == ["inference", "sync", "train"]
    assert [t.batch for t in sharded if t.kind != "sync"] == [8, 8]  # both ranks' sequences
    assert cal.shard_overhead >= 0 and cal.gather_overhead >= -cal.collective_latency  # per tensor: >= 0 in all
    assert all(t.seconds > 0 for t in cal.timings)
    assert {c.group for c in cal.collectives} == {2} and cal.intra_node_bandwidth > 0
    assert cal.machine["threads"] == 1 and set(cal.machine["slowdown"]) == {"1", "2"}
    assert 1.0 <= cal.cores <= 2.0
    # Fitted to these very timings, the simulator reproduces them roughly (the machine is
    # shared: a loose bound).
    for label, measured, predicted in cal.residuals():
        assert predicted == pytest.approx(measured, rel=1.0), label
    assert cluster_preset("local", 2, calibration=cal).calibrated
