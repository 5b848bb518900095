"""Headless runs placed by a planner plan, on real worker groups (the shared Ray session): a
hand-written YAML plan through `python -m workbench run`'s loader lands every group on the
pool and mesh the plan gives it and records the plan and its estimate; placement.plan=automap
runs the auto-mapper's plan."""

import json

import pytest
import yaml

from tests.run.test_plan_config import PER_CALL
from tests.run.test_runner import tiny, tiny_config  # noqa: F401  (a fixture)
from workbench.run.runner import Runner

ITERATIONS = 2
FAST = (
    f"iterations={ITERATIONS}",
    "evaluation.every=0",
    "checkpoint.every=0",
    "faults.max_recoveries=0",
    "placement.calibration=",
    "actor.micro_batch_size=4",
)
SPLIT = {
    "name": "split",
    "sets": [
        {"devices": 2, "models": {"actor": {"dp": 2, "generation": {"dp": 2}}, "reference": {"dp": 2}}},
        {"devices": 1, "models": {"critic": {"pp": 1, "tp": 1, "dp": 1}}},
    ],
}


def placed(where: dict):
    """A callback noting each group's pool and mesh after the first iteration."""

    def note(algorithm, batch, metrics):
        if not where:
            for role in ("actor", "reference", "critic"):
                group = getattr(algorithm.groups, role)
                where[role] = (group, group.pool.name, group.pool.world_size, group.mesh)

    return note


def test_a_yaml_plan_places_the_groups_and_is_recorded(tiny, tmp_path, shared_session):  # noqa: F811
    plan_file = tmp_path / "split.yaml"
    plan_file.write_text(yaml.safe_dump(SPLIT))
    out = tmp_path / "run"
    config = tiny_config(tiny, out, *FAST, f"placement.plan={plan_file}")
    where: dict = {}
    result = Runner(config, session=shared_session, callbacks=[placed(where)]).run()
    assert result.iterations == ITERATIONS

    actor, reference, critic = where["actor"], where["reference"], where["critic"]
    assert actor[1:3] == ("actor+reference", 2) and (actor[3].pp, actor[3].tp, actor[3].dp) == (1, 1, 2)
    assert actor[3].gen_tp in (None, 1) and actor[3].gen_pp in (None, 1)
    assert reference[0] is actor[0]  # the reference lives in the actor's processes
    assert critic[1:3] == ("critic", 1) and (critic[3].pp, critic[3].tp, critic[3].dp) == (1, 1, 1)

    record = yaml.safe_load((out / "plan.yaml").read_text())
    assert record["source"] == str(plan_file) and record["name"] == "split" and "UNCALIBRATED" in record["cluster"]
    assert record["sets"][0]["models"]["actor"] == {
        "pp": 1,
        "tp": 1,
        "dp": 2,
        "generation": {"pp": 1, "tp": 1, "dp": 2},
    }
    assert record["measured_iteration_s"]["iterations"] == ITERATIONS and record["measured_iteration_s"]["median"] > 0
    assert set(record["estimated_call_s"]) >= {"gen", "update_actor", "update_critic"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == ITERATIONS
    for row in rows:
        assert row["planner/estimated_iteration_s"] == pytest.approx(record["estimated_iteration_s"], rel=1e-5)
        assert row["timing_s/step"] > 0
    assert result.files["plan"] == out / "plan.yaml"


def test_placement_plan_automap_runs_the_auto_mappers_plan(tiny, tmp_path, shared_session):  # noqa: F811
    out = tmp_path / "run"
    config = tiny_config(tiny, out, *FAST, "placement.plan=automap", "placement.num_devices=2")
    where: dict = {}
    Runner(config, session=shared_session, callbacks=[placed(where)]).run()
    record = yaml.safe_load((out / "plan.yaml").read_text())
    assert record["source"] == "automap"
    planned = {m: (s["devices"], s["models"][m]["dp"]) for s in record["sets"] for m in s["models"]}
    for role in ("actor", "critic"):
        group, _, world, mesh = where[role]
        assert (world, mesh.dp) == planned[role]
    assert where["reference"][0] is where["actor"][0]


def test_a_per_call_yaml_plan_runs_headless(tiny, tmp_path, shared_session):  # noqa: F811
    """The actor generates on d1 and the critic's values run there while both train on d0."""
    plan_file = tmp_path / "calls.yaml"
    plan_file.write_text(yaml.safe_dump(PER_CALL))
    out = tmp_path / "run"
    config = tiny_config(tiny, out, *FAST, f"placement.plan={plan_file}")
    seen: dict = {}

    def note(algorithm, batch, metrics):  # where the groups are, while they are
        g = algorithm.groups
        seen.update(rollout=g.rollout.pool.name, actor=g.actor.pool.name, critic_version=g.critic.version)
        seen["values"] = g.critic.routes["compute_values"].pool.name

    result = Runner(config, session=shared_session, callbacks=[note]).run()
    assert result.iterations == ITERATIONS
    assert seen == {"rollout": "calls_d1", "actor": "calls_d0", "values": "calls_d1", "critic_version": ITERATIONS}
    record = yaml.safe_load((out / "plan.yaml").read_text())
    assert record["name"] == "gen-and-values-apart" and record["calls"]["values"]["first_device"] == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == ITERATIONS
    for row in rows:
        assert row["planner/estimated_iteration_s"] == pytest.approx(record["estimated_iteration_s"], rel=1e-5)
