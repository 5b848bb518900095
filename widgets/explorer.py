"""PlacementExplorer: move sliders, see how a placement of models on devices would run.

    explorer = PlacementExplorer(algorithm="PPO", machines=2, devices_per_machine=8, device="H100",
                                 actor="llama2-7b", critic="llama2-7b", reward="llama2-7b")
    explorer            # in a notebook: controls, the estimate and a Gantt chart
    explorer.data()     # what the figure shows, as plain Python

The estimate is the planner's (`widgets.planning.estimate`): a lane per colocated set of
devices, a bar per model call coloured by role (the actor's switch from training to
generation layout hatched at the start of its generation), the iteration time, throughput,
memory per device against capacity, and each model's layout. When nothing fits it says why.
"""

from __future__ import annotations

import dataclasses

from matplotlib.figure import Figure

from widgets.planning import ALGORITHMS, DEVICE_TYPES, GIB, PLACEMENTS, Estimate, Scenario, estimate
from widgets.ui import Control, View, escape, role_colour
from workbench.planner import MODEL_PRESETS

SIZES = tuple(MODEL_PRESETS)
TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
BATCHES = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class PlacementExplorer(View):
    """Sliders and selectors over a `Scenario`, and the planner's estimate for it."""

    width, height = 9.0, 3.6
    margins = {"left": 0.14, "right": 0.98, "top": 0.9, "bottom": 0.15, "wspace": 0.25}

    def __init__(self, **scenario):
        super().__init__()
        custom = scenario.pop("custom", {})
        self.scenario = Scenario(**scenario)
        self.custom = dict(custom)  # model -> set number, for placement "custom"
        self.estimate: Estimate = self._estimate()

    def controls(self) -> list[Control]:
        s = self.scenario
        controls = [
            Control("algorithm", "algorithm", "choice", list(ALGORITHMS), s.algorithm),
            Control("placement", "placement", "choice", list(PLACEMENTS), s.placement),
            Control("device", "device type", "choice", list(DEVICE_TYPES), s.device),
            Control("machines", "machines", "int", (1, 16, 1), s.machines),
            Control("devices_per_machine", "devices per machine", "steps", (1, 2, 4, 8), s.devices_per_machine),
            Control("actor", "actor model", "choice", SIZES, s.actor),
            Control("critic", "critic model", "choice", SIZES, s.critic),
            Control("reward", "reward model", "choice", SIZES, s.reward),
            Control("global_batch", "prompts per iteration", "steps", BATCHES, s.global_batch),
            Control("n_samples", "samples per prompt", "int", (1, 16, 1), s.n_samples),
            Control("prompt_len", "prompt tokens", "steps", TOKENS, s.prompt_len),
            Control("response_len", "response tokens", "steps", TOKENS, s.response_len),
        ]
        for model in ("actor", "reference", "critic", "reward", "cost", "cost_critic"):
            controls.append(
                Control(f"set_{model}", f"custom set: {model}", "int", (0, 5, 1), self.custom.get(model, 0))
            )
        return controls

    def set(self, **values) -> None:
        for name in [k for k in values if k.startswith("set_")]:
            self.custom[name.removeprefix("set_")] = int(values.pop(name))
        self.scenario = dataclasses.replace(self.scenario, **values)
        self.estimate = self._estimate()
        self.changed()

    def _estimate(self) -> Estimate:
        s = self.scenario
        if s.placement == "custom":
            models = [m for m in ("actor", "reference", "critic", "reward", "cost", "cost_critic")]
            s = dataclasses.replace(s, custom=tuple((m, self.custom.get(m, 0)) for m in models))
            self.scenario = s
        return estimate(s)

    # ---- what the figure shows -----------------------------------------------------------------
    def data(self) -> dict:
        """bars (lane, call, role, start, end, reshard), lanes, memory per set, layouts, totals."""
        e, s = self.estimate, self.scenario
        out = {
            "scenario": dataclasses.asdict(s),
            "error": e.error,
            "bars": [],
            "lanes": [],
            "memory": [],
            "layouts": {},
            "iteration_s": None,
            "throughput": None,
        }
        if e.plan is None:
            return out
        plan = e.plan
        lane_of = {}
        for cs in plan.sets:
            d = cs.devices
            lane_of[(d.start, d.stop)] = len(out["lanes"])
            out["lanes"].append(f"{cs.name} (d{d.start}-{d.stop - 1})" if len(d) > 1 else f"{cs.name} (d{d.start})")
            out["memory"].append(
                {"set": cs.name, "used_gib": cs.peak_memory / GIB, "capacity_gib": plan.cluster.device_memory / GIB}
            )
            for m, a in cs.assignments.items():
                out["layouts"][m] = {
                    "train": a.strategy.short(),
                    "generate": a.generation.short() if a.generation else None,
                    "devices": len(d),
                }
        for bar in plan.gantt():
            call = plan.dataflow.call(bar.call)
            out["bars"].append(
                {
                    "lane": lane_of[bar.devices],
                    "call": bar.call,
                    "role": call.model,
                    "start": bar.start,
                    "end": bar.end,
                    "reshard": e.reshard.get(bar.call, 0.0),
                }
            )
        out["iteration_s"] = plan.iteration_time
        out["throughput"] = plan.throughput
        return out

    def summary(self) -> str:
        d, s = self.data(), self.scenario
        where = f"{s.algorithm}, {s.placement} placement on {s.n_devices} x {s.device}"
        if self.estimate.plan is not None and not self.estimate.plan.cluster.calibrated:
            where += " (uncalibrated figures: run bench/calibration.py)"
        if d["error"]:
            return f"<b>{escape(where)}: does not fit.</b> {escape(d['error'])}"
        layouts = ", ".join(
            f"{m} {v['train']}" + (f" (gen {v['generate']})" if v["generate"] else "") for m, v in d["layouts"].items()
        )
        peak = max(m["used_gib"] / m["capacity_gib"] for m in d["memory"])
        return (
            f"<b>{escape(where)}</b>: estimated iteration <b>{d['iteration_s']:.3g} s</b>, "
            f"throughput <b>{d['throughput']:,.0f} tokens/s</b>, peak memory {peak:.0%} of a device"
            f"<br>layouts (pipeline/tensor/data): {escape(layouts)}"
        )

    def draw(self, fig: Figure) -> None:
        d = self.data()
        gantt, memory = fig.subplots(1, 2, gridspec_kw={"width_ratios": [4, 1]})
        if d["error"]:
            gantt.text(0.5, 0.5, "does not fit:\n" + d["error"][:120], ha="center", va="center", wrap=True, fontsize=8)
            gantt.set_axis_off()
            memory.set_axis_off()
            return
        for b in d["bars"]:
            y = b["lane"]
            gantt.barh(y, b["end"] - b["start"], left=b["start"], color=role_colour(b["role"]), edgecolor="white")
            if b["reshard"] > 0:  # the hybrid engine's switch to its generation layout
                gantt.barh(y, b["reshard"], left=b["start"], color="none", edgecolor="black", hatch="///")
            if b["end"] - b["start"] > 0.1 * (d["iteration_s"] or 1):
                gantt.text(
                    (b["start"] + b["end"]) / 2, y, b["call"], ha="center", va="center", fontsize=7, color="white"
                )
        gantt.set_yticks(range(len(d["lanes"])), [lane.replace("+", "+\n") for lane in d["lanes"]], fontsize=6)
        gantt.invert_yaxis()
        gantt.set_xlabel("seconds (estimated)")
        gantt.set_title(f"one iteration: {d['iteration_s']:.3g} s", fontsize=9)
        used = [m["used_gib"] for m in d["memory"]]
        memory.barh(range(len(used)), used, color="#4c72b0")
        memory.axvline(d["memory"][0]["capacity_gib"], color="red", linestyle="--")
        memory.set_yticks(range(len(used)), [f"set {i}" for i in range(len(used))], fontsize=6)
        memory.invert_yaxis()
        memory.set_xlabel("GiB / device", fontsize=7)
        memory.set_title("memory vs capacity", fontsize=9)
        fig.subplots_adjust(**self.margins)
