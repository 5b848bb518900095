"""placement.plan read, priced and checked on the driver (no Ray): a hand-written YAML plan
inline or in a file, automap for the run's models, and every refusal naming its field."""

from pathlib import Path

import pytest
import yaml

from workbench.errors import ConfigError
from workbench.models import make_tiny
from workbench.run import build
from workbench.run.config import load_config
from workbench.run.runner import Runner

SPLIT = {
    "sets": [
        {"devices": 2, "models": {"actor": {"dp": 2, "generation": {"dp": 2}}, "reference": {"dp": 2}}},
        {"devices": 1, "models": {"critic": {}}},
    ]
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("1m", tmp_path_factory.mktemp("plan-kit") / "tiny-1m", seed=0)


def config(tiny, *overrides, plan=None, algorithm="ppo"):
    cfg = load_config(
        None,
        [
            f"model.path={tiny}",
            f"algorithm.name={algorithm}",
            "data.loader.batch_size=4",
            "sampling.n=2",
            "actor.mini_batch_size=8",
            "critic.mini_batch_size=8",
            "placement.calibration=",
            *overrides,
        ],
    )
    if plan is not None:
        cfg.placement.plan = plan
    return cfg


def planned(cfg):
    return build.run_plan(cfg, Path(cfg.model.path))


def test_the_workload_prices_the_switch_the_actor_runs(tiny):
    assert build.run_workload(config(tiny)).transition_executor == "reallocate"
    cfg = config(tiny, "actor.transition_executor=allgather")
    assert build.run_workload(cfg).transition_executor == "allgather"


def test_the_workload_prices_the_rollout_pushes_the_run_makes(tiny):
    assert build.run_workload(config(tiny)).rollout_weights == "broadcast"
    assert build.run_workload(config(tiny, "algorithm.rollout_weights=reallocate")).rollout_weights == "reallocate"


def test_the_workload_names_the_homes_whose_copies_take_the_broadcast(tiny):
    assert build.run_workload(config(tiny)).broadcast_homes == ()
    deepspeed = config(tiny, "actor.backend=deepspeed", "critic.backend=deepspeed")
    assert build.run_workload(deepspeed).broadcast_homes == ("actor", "critic", "cost_critic")
    assert build.run_workload(config(tiny, "critic.backend=3d")).broadcast_homes == ()


def test_the_workload_prices_the_reference_as_the_actor_config_keeps_it(tiny):
    assert build.run_workload(config(tiny)).frozen_keep == "whole"
    assert build.run_workload(config(tiny, "actor.reference_keep=host")).frozen_keep == "host"


def test_the_workload_checkpoints_activations_only_where_the_actor_does(tiny):
    # The planner's Workload defaults to the papers' full checkpointing (a 4th forward per
    # training pass); the workers checkpoint only with actor.load.gradient_checkpointing.
    assert build.run_workload(config(tiny)).gradient_checkpointing is False
    assert build.run_workload(config(tiny, "actor.load.gradient_checkpointing=true")).gradient_checkpointing is True


def test_the_workload_prices_the_prompts_the_workers_see(tiny):
    # max_prompt_length is a bound; the loader pads each Batch to its longest prompt, so the
    # planner is given the loader's mean width (pricing the bound made every call ~1.5x dearer).
    cfg = config(tiny, "data.loader.max_prompt_length=64")
    assert build.run_workload(cfg).prompt_len == 64
    assert build.run_workload(cfg, prompt_width=10.4).prompt_len == 10
    cfg.placement.plan = SPLIT
    wide, narrow = (build.run_plan(cfg, Path(cfg.model.path), w) for w in (None, 10.0))
    assert narrow.estimated_iteration_s < wide.estimated_iteration_s


def test_no_plan_keeps_the_hand_written_pools(tiny):
    assert planned(config(tiny)) is None


def test_an_inline_plan_is_priced_for_the_run(tiny):
    run = planned(config(tiny, plan=SPLIT))
    assert run.source == "inline" and "UNCALIBRATED" in run.cluster and run.n_devices == 3
    assert [s.name for s in run.plan.sets] == ["actor+reference", "critic"]
    assert set(run.plan.call_times) == {"gen", "old_log_prob", "ref", "values", "update_critic", "update_actor"}
    assert run.estimated_iteration_s == pytest.approx(sum(run.plan.level_times)) and run.estimated_iteration_s > 0
    assert run.plan.workload.batch_size == 4 and run.plan.workload.n == 2
    assert [s.models for s in run.deployable().sets] == [("actor",), ("critic",)]  # the reference: actor's processes
    record = run.to_dict()
    assert record["source"] == "inline" and record["sets"][1]["first_device"] == 2


def test_a_plan_file_and_plan_yaml_read_back(tiny, tmp_path):
    path = tmp_path / "split.yaml"
    path.write_text(yaml.safe_dump(SPLIT))
    run = planned(config(tiny, f"placement.plan={path}"))
    assert run.source == str(path)
    again = tmp_path / "plan.yaml"  # what a run writes: runs again as it is
    again.write_text(yaml.safe_dump(run.to_dict()))
    assert planned(config(tiny, f"placement.plan={again}")).plan.call_times == pytest.approx(run.plan.call_times)


def test_grpo_without_a_reference_plans_the_actor_alone(tiny):
    run = planned(config(tiny, "algorithm.kl_loss_coef=0", plan="automap", algorithm="grpo"))
    assert run.plan.dataflow.models == ("actor",)


def test_automap_plans_the_run_on_the_calibrated_cluster_when_there_is_one(tiny, tmp_path):
    from tests.planner.test_calibrate import MEM_BW, PEAK, _synthetic
    from workbench.planner.calibrate import fit

    missing = tmp_path / "no-calibration.json"
    run = planned(config(tiny, "placement.num_devices=2", f"placement.calibration={missing}", plan="automap"))
    assert run.source == "automap" and run.n_devices <= 2 and "UNCALIBRATED" in run.cluster
    assert set(run.plan.set_of("actor").models) >= {"actor", "reference"}
    timings, collectives = _synthetic()
    path = fit(timings, collectives, peak_flops=PEAK, memory_bandwidth=MEM_BW, slowdown={1: 1.0, 2: 1.0}).save(
        tmp_path / "calibration.json"
    )
    calibrated = planned(config(tiny, "placement.num_devices=2", f"placement.calibration={path}", plan="automap"))
    assert calibrated.cluster.startswith("calibrated local cluster") and str(path) in calibrated.cluster


def test_placement_plan_search_finds_a_per_call_plan_this_runtime_runs(tiny):
    run = planned(config(tiny, "placement.num_devices=2", plan="search"))
    assert run.source == "search" and run.n_devices <= 2
    assert set(run.call_times) == {c.name for c in run.dataflow.calls} and min(run.call_times.values()) > 0
    record = run.to_dict()
    assert set(record["calls"]) == set(run.call_times) and record["estimated_iteration_s"] > 0
    again = planned(config(tiny, "placement.num_devices=2", plan=record))  # plan.yaml runs again as it is
    assert again.plan.layouts == run.plan.layouts


def edited(change):
    values = yaml.safe_load(yaml.safe_dump(SPLIT))
    change(values)
    return values


@pytest.mark.parametrize(
    "plan, overrides, where, words",
    [
        (7, (), "placement.plan", "automap"),
        ("no/such/plan.yaml", (), "placement.plan", "no such plan file"),
        ({"layouts": {"gen": {}}}, (), "placement.plan", "calls: {<call>"),
        (SPLIT, ("placement.critic_devices=2",), "placement.critic_devices", "not both"),
        (SPLIT, ("placement.rollout_devices=1", "asynchronous.enabled=true"), "placement.rollout_devices", "not both"),
        (edited(lambda v: v["sets"][1]["models"].pop("critic")), (), "placement.plan.sets[1].models", "model ->"),
        (
            edited(lambda v: v["sets"][1].update(models={"reward": {}})),
            (),
            "placement.plan.sets[1].models.reward",
            "no model 'reward'",
        ),
        (edited(lambda v: v["sets"].pop(1)), (), "placement.plan.sets", "needs ['critic']"),
        (edited(lambda v: v["sets"][1].update(devices=3)), (), "placement.plan.sets[1].devices", "num_devices"),
        (
            edited(lambda v: v["sets"][1].update(devices=2)),
            ("placement.num_devices=3",),
            "placement.plan.sets[1].devices",
            "beyond the 3 device",
        ),
        (
            edited(lambda v: v["sets"][0]["models"].update(actor={"dp": 1, "tp": 2})),
            (),
            "placement.plan.sets[0].models.actor.tp",
            "actor.backend=3d",
        ),
        (
            edited(lambda v: v["sets"][1].update(devices=2, models={"critic": {"tp": 2}})),
            (),
            "placement.plan.sets[1].models.critic.tp",
            "critic.backend=3d",
        ),
        (
            edited(lambda v: v["sets"][0]["models"].update(actor={"dp": 1, "pp": 2})),
            (),
            "placement.plan.sets[0].models.actor.pp",
            "pipeline parallelism",
        ),
        (
            edited(lambda v: v["sets"][0]["models"].update(actor={"dp": 1})),
            (),
            "placement.plan.sets[0].models.actor",
            "pp*tp*dp",
        ),
        (
            {
                "sets": [
                    {"devices": 1, "models": {"actor": {}}},
                    {"devices": 1, "models": {"reference": {}, "critic": {}}},
                ]
            },
            (),
            "placement.plan.sets[1].models.reference",
            "actor's processes",
        ),
    ],
)
def test_refusals_name_the_field(tiny, plan, overrides, where, words):
    with pytest.raises(ConfigError) as info:
        planned(config(tiny, *overrides, plan=plan))
    assert info.value.where == where and words in info.value.fix, str(info.value)


def test_the_runner_refuses_a_bad_plan_before_any_worker_starts(tiny, tmp_path, monkeypatch):
    import workbench.run.runner as runner_module

    started = []
    monkeypatch.setattr(runner_module, "Session", lambda *a, **k: started.append(a) or pytest.fail("Session started"))
    cfg = config(tiny, f"logging.output_dir={tmp_path}", plan=edited(lambda v: v["sets"].pop(1)))
    with pytest.raises(ConfigError, match="needs \\['critic'\\]"):
        Runner(cfg).run()
    assert not started  # refused on the driver: no session (Ray may be up for other tests)


def test_the_planned_config_reads(tiny):
    cfg = load_config("configs/ppo_planned.yaml", [f"model.path={tiny}", "placement.calibration="])
    run = planned(cfg)
    assert run.source == "inline" and [s.name for s in run.plan.sets] == ["actor+reference", "critic"]
    assert run.name == "actor-dp2-critic-alone" and run.to_dict()["name"] == run.name
    assert build.devices_needed(cfg, run) == 3


PIPELINED = {
    "sets": [
        {
            "devices": 2,
            "models": {"actor": {"pp": 2, "generation": {"pp": 1, "dp": 2}}, "reference": {"pp": 2}},
        },
        {"devices": 2, "models": {"critic": {"pp": 2}}},
    ]
}


def test_a_pipelined_plan_runs_on_the_3d_backend_and_its_generation_layout_has_no_stages(tiny):
    backends = ("actor.backend=3d", "critic.backend=3d")
    run = planned(config(tiny, *backends, plan=PIPELINED))
    actor = run.plan.set_of("actor").assignments["actor"]
    assert (actor.strategy.pp, actor.generation.pp, actor.generation.dp) == (2, 1, 2)
    with pytest.raises(ConfigError) as info:
        planned(
            config(
                tiny,
                *backends,
                plan=edited_from(PIPELINED, lambda v: v["sets"][0]["models"]["actor"].pop("generation")),
            )
        )
    assert (
        info.value.where == "placement.plan.sets[0].models.actor.generation.pp" and "not generation" in info.value.fix
    )


def edited_from(values, change):
    values = yaml.safe_load(yaml.safe_dump(values))
    change(values)
    return values


PER_CALL = {
    "name": "gen-and-values-apart",
    "calls": {
        "gen": {"devices": 1, "first_device": 1},
        "old_log_prob": {"devices": 1},
        "ref": {"devices": 1},
        "values": {"devices": 1, "first_device": 1},
        "update_critic": {"devices": 1},
        "update_actor": {"devices": 1},
    },
}


def test_a_per_call_plan_is_read_priced_and_read_back(tiny, tmp_path):
    run = planned(config(tiny, plan=PER_CALL))
    assert isinstance(run, build.CallRunPlan) and run.name == "gen-and-values-apart" and run.n_devices == 2
    assert run.estimated_iteration_s > 0 and str(run.plan.layouts["gen"][0]) == "d1"
    file = tmp_path / "plan.yaml"
    file.write_text(yaml.safe_dump(run.to_dict()))
    again = planned(config(tiny, plan=str(file)))
    assert again.plan == run.plan and again.estimated_iteration_s == pytest.approx(run.estimated_iteration_s)


def test_a_per_call_plan_may_put_a_copy_on_devices_its_home_shares(tiny):
    shared = planned(
        config(tiny, plan=edited_from(PER_CALL, lambda v: v["calls"]["gen"].update(devices=2, first_device=0, dp=2)))
    )
    assert str(shared.plan.layouts["gen"][0]) == "d0-1" and shared.n_devices == 2


@pytest.mark.parametrize(
    "change, where, words",
    [
        (lambda v: v["calls"].pop("values"), "placement.plan.calls", "each call of the run"),
        (lambda v: v["calls"]["old_log_prob"].update(first_device=1), "placement.plan.calls", "compute_log_prob"),
        (
            lambda v: [v["calls"][c].update(devices=2, first_device=2, tp=2) for c in ("values", "update_critic")],
            "placement.plan.calls.values",
            "3d",
        ),
    ],
)
def test_per_call_plan_refusals_name_the_field(tiny, change, where, words):
    with pytest.raises(ConfigError) as info:
        planned(config(tiny, plan=edited_from(PER_CALL, change)))
    assert info.value.where == where and words in info.value.fix, str(info.value)
