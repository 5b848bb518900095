"""PlacementExplorer: move sliders, see how a placement of models on devices would run.

    explorer = PlacementExplorer(algorithm="PPO", machines=2, devices_per_machine=8, device="H100",
                                 actor="llama2-7b", critic="llama2-7b", reward="llama2-7b")
    explorer            # in a notebook: controls, the estimate and its figure
    explorer.data()     # what the figure shows, as plain Python

The estimate is the planner's (`widgets.planning.estimate`): a lane per colocated set of
devices, a bar per model call coloured by role (the actor's switch from training to
generation layout hatched at the start of its generation; hover a bar for its breakdown:
layout, devices, compute and switch seconds, share of the iteration), the iteration time,
throughput, and memory per device against capacity on a log scale (so a tiny model's sliver
shows beside an 80 GiB device; hover for weights, optimizer and activations). "compare with"
plans a second placement of the same scenario, drawn below on the same time axis. Placement
"custom" asks which device group each model runs in. When nothing fits it says why.

Placement "async split" is asynchronous RL's: generation on a rollout group of its own, the
other models on the rest, the "max staleness" slider bounding how far generation runs ahead (0:
the same split, synchronous). Its figure is one steady-state iteration (generation of the next
batch beside this batch's training, then the weight push on both lanes); the summary gives the
synchronous and the asynchronous estimate and whether the split with overlap beats colocation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from matplotlib.figure import Figure

from widgets import plots
from widgets.planning import ALGORITHMS, DEVICE_TYPES, GIB, PLACEMENTS, Estimate, Scenario, dataflow_for, estimate
from widgets.ui import Control, FigureParts, View, escape, role_colour
from workbench import checks
from workbench.planner import MODEL_PRESETS

SIZES = tuple(MODEL_PRESETS)
TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
BATCHES = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
MODELS = ("actor", "reference", "critic", "reward", "cost", "cost_critic")
GROUPS = {f"group {k + 1}": k for k in range(len(MODELS))}
PLACEMENT_HELP = {
    "auto": "the planner searches every placement and keeps the fastest (HybridFlow's auto-mapping)",
    "colocate": "every model on all devices, taking turns",
    "split": "the actor and its reference on some devices, the other models on the rest",
    "standalone": "each model on devices of its own",
    "custom": "you choose which device group each model runs in",
    "async split": "generation on devices of its own (a rollout group), the other models on the rest; "
    "with max staleness >= 1 generation overlaps training (asynchronous RL)",
}
STALENESS = (0, 4, 1)
BAR_COLUMNS = ("lane", "call", "role", "kind", "start", "end", "seconds", "share", "reshard", "compute", "layout")
MEMORY_COLUMNS = ("set", "models", "used", "floor", "capacity", "share", "weights", "training_state", "dynamic")


class PlacementExplorer(View):
    """Sliders and selectors over a `Scenario`, and the planner's estimate for it."""

    width, height = 9.0, 3.6
    margins = {"left": 0.14, "right": 0.98, "top": 0.9, "bottom": 0.15, "wspace": 0.25, "hspace": 0.6}

    def __init__(self, compare: str = "none", **scenario):
        super().__init__()
        custom = scenario.pop("custom", {})
        unknown = set(scenario) - {f.name for f in dataclasses.fields(Scenario)}
        if unknown:
            raise ValueError(
                f"PlacementExplorer: unknown settings {sorted(unknown)}; "
                f"a Scenario has {[f.name for f in dataclasses.fields(Scenario)]}"
            )
        self.scenario = Scenario(**scenario)
        self._check(dataclasses.asdict(self.scenario))
        checks.one_of("PlacementExplorer", "compare", compare, ("none", *PLACEMENTS))
        self.custom = dict(custom)  # model -> group number, for placement "custom"
        self.compare = compare
        self.estimate: Estimate = self._estimate()
        self.other: Estimate | None = self._estimate(compare) if compare != "none" else None

    def controls(self) -> list[Control]:
        s = self.scenario
        models = dataflow_for(s.algorithm).models if s.algorithm in ALGORITHMS else MODELS
        controls = [
            Control(
                "algorithm",
                "algorithm",
                "choice",
                list(ALGORITHMS),
                s.algorithm,
                "the RL algorithm: which models it has (PPO: actor, reference, critic, reward) and its calls",
            ),
            Control(
                "placement",
                "placement",
                "choice",
                list(PLACEMENTS),
                s.placement,
                "how models share devices: " + "; ".join(f"{k}: {v}" for k, v in PLACEMENT_HELP.items()),
            ),
            Control(
                "compare",
                "compare with",
                "choice",
                ["none", *PLACEMENTS],
                self.compare,
                "a second placement of the same scenario, drawn below on the same time axis",
            ),
            Control(
                "device",
                "device type",
                "choice",
                list(DEVICE_TYPES),
                s.device,
                "the accelerator: its memory and speed ('this machine': CPU slots, calibrated by bench/calibration.py)",
            ),
            Control("machines", "machines", "int", (1, 16, 1), s.machines, "machines in the cluster"),
            Control(
                "devices_per_machine",
                "devices per machine",
                "steps",
                (1, 2, 4, 8),
                s.devices_per_machine,
                "accelerators in each machine; devices of one machine talk faster than across machines",
            ),
            Control("actor", "actor model", "choice", SIZES, s.actor, "size of the policy (and its frozen reference)"),
            Control("critic", "critic model", "choice", SIZES, s.critic, "size of the value model (PPO, Safe-RLHF)"),
            Control("reward", "reward model", "choice", SIZES, s.reward, "size of the reward (and cost) model"),
            Control(
                "batch_size",
                "prompts per iteration",
                "steps",
                BATCHES,
                s.batch_size,
                "prompts sampled each iteration",
            ),
            Control("n", "samples per prompt", "int", (1, 16, 1), s.n, "responses generated per prompt"),
            Control("prompt_len", "prompt tokens", "steps", TOKENS, s.prompt_len, "tokens in each prompt"),
            Control(
                "max_new_tokens", "response tokens", "steps", TOKENS, s.max_new_tokens, "tokens generated per response"
            ),
            Control(
                "max_staleness",
                "max staleness",
                "int",
                STALENESS,
                s.max_staleness,
                "asynchronous RL: how many updates old the weights generating a batch may be (0: synchronous). "
                "'async split' runs with it; 'auto' with >= 1 also weighs asynchronous split plans",
                visible=s.placement in ("auto", "async split"),
            ),
        ]
        for model in MODELS:
            controls.append(
                Control(
                    f"set_{model}",
                    f"{model} runs in",
                    "choice",
                    GROUPS,
                    self.custom.get(model, 0),
                    f"custom placement: the device group of the {model}. Models in one group share its devices "
                    "(taking turns); each group gets devices of its own",
                    visible=s.placement == "custom" and model in models,
                )
            )
        return controls

    def set(self, **values) -> None:
        """Change settings: Scenario fields, "compare", or "set_<model>" (custom placement group)."""
        for name in [k for k in values if k.startswith("set_")]:
            model = name.removeprefix("set_")
            checks.one_of("PlacementExplorer", "model", model, MODELS, f"use set_<model> with a model of {MODELS}")
            group = values.pop(name)
            checks.one_of("PlacementExplorer", name, group, GROUPS.values(), f"use a group number 0-{len(MODELS) - 1}")
            self.custom[model] = int(group)
        if "compare" in values:
            self.compare = values.pop("compare")
            checks.one_of("PlacementExplorer", "compare", self.compare, ("none", *PLACEMENTS))
        fields = {f.name for f in dataclasses.fields(Scenario)} - {"custom"}
        unknown = set(values) - fields
        if unknown:
            raise ValueError(f"PlacementExplorer.set: unknown settings {sorted(unknown)}; use {sorted(fields)}")
        self._check(values)
        self.scenario = dataclasses.replace(self.scenario, **values)
        self.estimate = self._estimate()
        self.other = self._estimate(self.compare) if self.compare != "none" else None
        self.changed()

    @staticmethod
    def _check(values: dict) -> None:
        owner = "PlacementExplorer"
        for name, choices in (("algorithm", ALGORITHMS), ("placement", PLACEMENTS), ("device", DEVICE_TYPES)):
            if name in values:
                checks.one_of(owner, name, values[name], choices)
        for name in ("actor", "critic", "reward"):
            if name in values:
                checks.one_of(owner, name, values[name], SIZES)
        for name in ("machines", "devices_per_machine", "batch_size", "n", "prompt_len", "max_new_tokens"):
            if name in values:
                checks.whole(owner, name, values[name], 1)
        if "max_staleness" in values:
            checks.whole(owner, "max_staleness", values["max_staleness"], 0, "use 0 (synchronous), 1, 2, ...")

    def _estimate(self, placement: str | None = None) -> Estimate:
        s = dataclasses.replace(self.scenario, placement=placement or self.scenario.placement)
        if s.placement == "custom":
            s = dataclasses.replace(s, custom=tuple((m, self.custom.get(m, 0)) for m in MODELS))
            if placement is None:
                self.scenario = s
        return estimate(s)

    # ---- what the figure shows -----------------------------------------------------------------
    def data(self) -> dict:
        """bars (lane, call, role, start, end, reshard, and the hover's breakdown), lanes, memory
        per set, layouts, totals; "compare": the same for the placement compared with, or None."""
        return {
            **plan_data(self.estimate),
            "scenario": dataclasses.asdict(self.scenario),
            "compare": plan_data(self.other) if self.other is not None else None,
        }

    def _asynchronous_line(self) -> str:
        """The summary's line on an asynchronous plan: synchronous and asynchronous estimates,
        and the verdict against colocation ("" for a synchronous plan)."""
        a = self.data()["asynchronous"]
        if a is None:
            return ""
        text = (
            f"<br>split with a rollout group of its own: synchronous <b>{a['synchronous_s']:.3g} s</b>, "
            f"asynchronous (max staleness {a['max_staleness']}) <b>{a['asynchronous_s']:.3g} s</b> per iteration "
            f"(generation {a['generation_s']:.3g} s | trainer {a['trainer_s']:.3g} s | push {a['push_s']:.3g} s; "
            f"{a['bottleneck']}-bound)"
        )
        if a["colocated_s"] is None:
            return text + "; colocated does not fit"
        verdict = "beats" if a["beats_colocation"] else "does not beat"
        return text + (
            f"<br><b>{verdict} colocation</b>: colocated {a['colocated_s']:.3g} s per iteration, "
            f"the asynchronous split {a['colocated_s'] / a['asynchronous_s']:.2f}x its speed"
        )

    def summary(self) -> str:
        d, s = self.data(), self.scenario
        where = f"{s.algorithm}, {s.placement} placement on {s.n_devices} x {s.device}"
        if self.estimate.plan is not None and not self.estimate.plan.cluster.calibrated:
            where += " (uncalibrated figures: run bench/calibration.py)"
        if d["error"]:
            text = f"<b>{escape(where)}: does not fit.</b> {escape(d['error'])}"
        else:
            layouts = ", ".join(
                f"{m} {v['train']}" + (f" (gen {v['generate']})" if v["generate"] else "")
                for m, v in d["layouts"].items()
            )
            peak = max(m["used_gib"] / m["capacity_gib"] for m in d["memory"])
            text = (
                f"<b>{escape(where)}</b>: estimated iteration <b>{d['iteration_s']:.3g} s</b>, "
                f"throughput <b>{d['throughput']:,.0f} tokens/s</b>, peak memory {_percent(peak)} of a device"
                f"<br>layouts (pipeline/tensor/data): {escape(layouts)}"
            ) + self._asynchronous_line()
        other = d["compare"]
        if other is not None:
            name = f"{self.compare} placement"
            if other["error"]:
                text += f"<br>compared with the {escape(name)}: does not fit. {escape(other['error'])}"
            elif d["iteration_s"]:
                ratio = other["iteration_s"] / d["iteration_s"]
                text += (
                    f"<br>compared with the {escape(name)}: <b>{other['iteration_s']:.3g} s</b> per iteration "
                    f"({ratio:.2f}x this one's time), {other['throughput']:,.0f} tokens/s"
                )
            else:
                text += f"<br>compared with the {escape(name)}: {other['iteration_s']:.3g} s per iteration"
        return text

    # ---- the live figure ---------------------------------------------------------------------------
    def figure(self) -> FigureParts:
        from bokeh.layouts import column, row

        time_axis = _range("explorer_time")
        this = _PlanFigure("explorer", time_axis)
        other = _PlanFigure("explorer_compare", time_axis)

        def update() -> None:
            d = self.data()
            this.show(d, f"{self.scenario.placement} placement")
            compare = d["compare"]
            other.set_visible(compare is not None)
            if compare is not None:
                other.show(compare, f"compared with: {self.compare} placement")
            ends = [x["iteration_s"] for x in (d, compare) if x is not None and x["iteration_s"]]
            time_axis.start, time_axis.end = 0.0, max(ends, default=1.0) * 1.02

        update()
        memory = row(this.memory, other.memory)
        return column(this.gantt, other.gantt, memory, sizing_mode="stretch_width"), update

    # ---- the static picture ------------------------------------------------------------------------
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
        gantt.set_yticks(range(len(d["lanes"])), [lane.replace("+", "+\n") for lane in d["lanes"]], fontsize=7)
        gantt.invert_yaxis()
        gantt.set_xlabel("seconds (estimated)")
        gantt.set_title(f"one iteration: {d['iteration_s']:.3g} s", fontsize=9)
        used = [m["used_gib"] for m in d["memory"]]
        memory.barh(range(len(used)), used, color="#4c72b0")
        memory.axvline(d["memory"][0]["capacity_gib"], color="red", linestyle="--")
        memory.set_xscale("log")  # a tiny model's few MiB and an 80 GiB device on one axis
        memory.set_xlim(min(used) / 3, d["memory"][0]["capacity_gib"] * 2)
        memory.set_yticks(range(len(used)), [f"set {i}" for i in range(len(used))], fontsize=7)
        memory.invert_yaxis()
        memory.set_xlabel("GiB / device (log)", fontsize=8)
        memory.set_title("memory vs capacity (red)", fontsize=9)
        fig.subplots_adjust(**self.margins)


def plan_data(e: Estimate) -> dict:
    """What the figure shows of one estimate (see PlacementExplorer.data)."""
    out: dict[str, Any] = {
        "error": e.error,
        "bars": [],
        "lanes": [],
        "memory": [],
        "layouts": {},
        "iteration_s": None,
        "throughput": None,
        "asynchronous": None,
    }
    if e.plan is None:
        return out
    plan = e.plan
    lane_of = {}
    for cs in plan.sets:
        d = cs.devices
        lane_of[(d.start, d.stop)] = len(out["lanes"])
        out["lanes"].append(f"{cs.name} (d{d.start}-{d.stop - 1})" if len(d) > 1 else f"{cs.name} (d{d.start})")
        static = [a.memory for a in cs.assignments.values()]
        weights = sum(m.params for m in static)
        training_state = sum(m.grads + m.optimizer for m in static)
        out["memory"].append(
            {
                "set": cs.name,
                "used_gib": cs.peak_memory / GIB,
                "capacity_gib": plan.cluster.device_memory / GIB,
                "weights_gib": weights / GIB,
                "training_state_gib": training_state / GIB,
                "dynamic_gib": max(cs.peak_memory - weights - training_state, 0.0) / GIB,
            }
        )
        for m, a in cs.assignments.items():
            out["layouts"][m] = {
                "train": a.strategy.short(),
                "generate": a.generation.short() if a.generation else None,
                "devices": len(d),
            }
    for bar in plan.gantt():
        call = plan.dataflow.call(bar.call) if bar.call else None  # None: the weight push
        reshard = e.reshard.get(bar.call, 0.0) if bar.call else 0.0
        out["bars"].append(
            {
                "lane": lane_of[bar.devices],
                "call": bar.call or bar.label,
                "role": call.model if call else "push",
                "kind": call.kind if call else bar.kind,
                "start": bar.start,
                "end": bar.end,
                "reshard": reshard,
                "compute": bar.end - bar.start - reshard,
                "layout": plan.strategy_of(bar.call).short() if bar.call else "-",
                "share": (bar.end - bar.start) / plan.iteration_time if plan.iteration_time else 0.0,
            }
        )
    out["iteration_s"] = plan.iteration_time
    out["throughput"] = plan.throughput
    split = e.asynchronous
    if split is not None:
        overlapped = split.with_staleness(max(1, split.max_staleness))  # the asynchronous figure, even at 0
        out["asynchronous"] = {
            "max_staleness": overlapped.max_staleness,
            "synchronous_s": split.synchronous_time,
            "asynchronous_s": overlapped.iteration_time,
            "colocated_s": e.colocated_time,
            "beats_colocation": e.colocated_time is not None and overlapped.iteration_time < e.colocated_time,
            "generation_s": split.generation_time,
            "trainer_s": split.trainer_time,
            "push_s": split.push_time,
            **{k: getattr(overlapped.iteration_model(), k) for k in ("bottleneck", "idle_rollout", "idle_trainer")},
        }
    return out


class _PlanFigure:
    """A plan's Gantt chart and memory bars (Bokeh), refilled in place when the plan changes."""

    def __init__(self, name: str, time_axis):
        from bokeh.models import ColumnDataSource, FactorRange, LabelSet, PrintfTickFormatter, Range1d

        self.bars = ColumnDataSource(
            {c: [] for c in (*BAR_COLUMNS, "colour", "label", "switch_end")}, name=name + "_bars"
        )
        self.sets = ColumnDataSource({c: [] for c in MEMORY_COLUMNS}, name=name + "_memory")
        self.lanes = FactorRange(factors=["-"])
        self.gantt = plots.new_figure(
            "",
            x_range=time_axis,
            y_range=self.lanes,
            height=200,
            tools="xpan,xwheel_zoom,xbox_zoom,reset,save",
            active_scroll=None,
            x_axis_label="seconds (estimated)",
            name=name,
        )
        bars = self.gantt.hbar(
            y="lane", left="start", right="end", height=0.7, color="colour", line_color="white", source=self.bars
        )
        self.gantt.hbar(  # the actor's switch to its generation layout (3D-HybridEngine)
            y="lane",
            left="start",
            right="switch_end",
            height=0.7,
            fill_alpha=0,
            hatch_pattern="/",
            hatch_color="black",
            line_alpha=0,
            source=self.bars,
        )
        self.gantt.add_layout(
            LabelSet(
                x="start",
                y="lane",
                text="label",
                source=self.bars,
                text_color="white",
                text_font_size="9pt",
                x_offset=4,
                y_offset=-6,
            )
        )
        plots.hover(
            self.gantt,
            [bars],
            [
                ("call", "@call (@kind, @role)"),
                ("devices", "@lane"),
                ("layout", "@layout (pipeline-tensor-data)"),
                ("seconds", "@seconds{0.000} (@share{0%} of the iteration)"),
                ("compute", "@compute{0.000} s"),
                ("switch to generation layout", "@reshard{0.000} s"),
            ],
        )
        self.memory = plots.new_figure(
            "memory per device",
            y_range=FactorRange(factors=["-"]),
            x_range=Range1d(1e-3, 1.0),
            x_axis_type="log",
            height=110 + 30 * 2,
            width=600,
            sizing_mode="fixed",
            tools="hover,save",
            x_axis_label="GiB per device (log scale)",
            name=name + "_memory_plot",
        )
        self.memory.xaxis.formatter = PrintfTickFormatter(format="%g")
        self.memory.hbar(y="set", left="floor", right="used", height=0.6, color="#4c72b0", source=self.sets)
        self.memory.scatter(x="capacity", y="set", marker="dash", size=28, line_width=3, color="red", source=self.sets)
        self.memory.hover.tooltips = [
            ("set", "@set (@models)"),
            ("peak per device", "@used{0.000} GiB (@share of capacity)"),
            ("capacity", "@capacity{0.0} GiB (red mark)"),
            ("weights", "@weights{0.000} GiB"),
            ("gradients + optimizer", "@training_state{0.000} GiB"),
            ("activations, KV cache, copies", "@dynamic{0.000} GiB"),
        ]

    def set_visible(self, visible: bool) -> None:
        self.gantt.visible = self.memory.visible = visible

    def show(self, d: dict, what: str) -> None:
        lanes = d["lanes"]
        bars = d["bars"]
        if d["error"]:
            self.gantt.title.text = f"{what}: does not fit: {d['error'][:160]}"
        else:
            self.gantt.title.text = f"{what}: one iteration {d['iteration_s']:.3g} s (hover a bar for its breakdown)"
        self.lanes.factors = list(reversed(lanes)) or ["does not fit"]
        self.gantt.height = 110 + 45 * max(len(lanes), 1)
        iteration = d["iteration_s"] or 1.0
        self.bars.data = {
            "lane": [lanes[b["lane"]] for b in bars],
            "call": [b["call"] for b in bars],
            "role": [b["role"] for b in bars],
            "kind": [b["kind"] for b in bars],
            "start": [b["start"] for b in bars],
            "end": [b["end"] for b in bars],
            "seconds": [b["end"] - b["start"] for b in bars],
            "share": [b["share"] for b in bars],
            "reshard": [b["reshard"] for b in bars],
            "compute": [b["compute"] for b in bars],
            "layout": [b["layout"] for b in bars],
            "colour": [role_colour(b["role"]) for b in bars],
            "label": [b["call"] if b["end"] - b["start"] > 0.12 * iteration else "" for b in bars],
            "switch_end": [b["start"] + b["reshard"] for b in bars],
        }
        memory = d["memory"]
        used = [m["used_gib"] for m in memory]
        floor = min(used, default=1.0) / 4
        self.memory.y_range.factors = [m["set"] for m in reversed(memory)] or ["does not fit"]
        self.memory.height = 110 + 30 * max(len(memory), 1)
        self.memory.title.text = f"{what.removeprefix('compared with: ')}: memory per device (red: capacity)"
        self.sets.data = {
            "set": [m["set"] for m in memory],
            "models": [m["set"].replace("+", ", ") for m in memory],
            "used": used,
            "floor": [floor] * len(memory),
            "capacity": [m["capacity_gib"] for m in memory],
            "share": [_percent(m["used_gib"] / m["capacity_gib"]) for m in memory],
            "weights": [m["weights_gib"] for m in memory],
            "training_state": [m["training_state_gib"] for m in memory],
            "dynamic": [m["dynamic_gib"] for m in memory],
        }
        if memory:
            self.memory.x_range.start = floor
            self.memory.x_range.end = memory[0]["capacity_gib"] * 2


def _range(name: str):
    from bokeh.models import Range1d

    return Range1d(0, 1, name=name)


def _percent(share: float) -> str:
    """A share readable at every size: 0.0012% as well as 85%."""
    if share >= 0.01:
        return f"{share:.0%}"
    return f"{share * 100:.2g}%" if share > 0 else "0%"
