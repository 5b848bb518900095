"""The 3D-HybridEngine's two layouts drawn rank by rank (a picture like HybridFlow's Figure 8).

    draw_shard_map({"hybridflow": mesh_a, "vanilla": mesh_b})   # one row of ranks per mesh

Each rank is a column of the model's p·t training shards (pipeline stage, tensor piece; stage
major, top to bottom). Dark: the shard the rank trains, generated with in place (zero
redundancy). Hatched: a training shard (or its ZeRO partition) kept beside the generation
weights (Table 2's redundancy). Mid: the rest of the shard it generates with. Light: weights it
gathers in the switch but does not generate with (the whole model under deepspeed_chat and
vanilla). The strip under a column is coloured by the rank's gather group: ranks of one colour
all-gather together. Everything is read from `workbench.layouts`.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from workbench import layouts
from workbench.mesh import Mesh

TRAIN, GENERATE, GATHERED, EMPTY = "#1f4e79", "#6fa8dc", "#dde7f0", "white"
COLOURS = {"train": TRAIN, "kept": TRAIN, "generate": GENERATE, "gathered": GATHERED, "": EMPTY}
LEGEND = {
    "train": "trains; generates with it in place",
    "kept": "trains; kept beside the generation weights (redundant)",
    "generate": "rest of the shard it generates with",
    "gathered": "gathered in the switch, then dropped",
}
GROUP_COLOURS = ("#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#f0e442", "#0072b2", "#999999")


def cell_kinds(mesh: Mesh) -> list[list[str]]:
    """What the drawing colours, as data: per rank, per training shard (stage-major), one of
    "train" (trained; generated with in place), "kept" (trained; a copy kept beside the
    generation weights: Table 2's redundancy), "generate", "gathered" (gathered in the switch,
    not generated with) or "" (never held)."""
    redundant = [t.redundant > 0 for t in layouts.transition_bytes(mesh, 1)]
    every_shard = layouts.Shard((0, mesh.pp), (0, mesh.tp)).pieces
    kinds = []
    for row in layouts.rank_map(mesh):
        train, generate = row["train_shard"].pieces, row["gen_shard"].pieces
        gathered = layouts.gathered_shard(mesh, row["rank"]).pieces

        def kind(piece):
            if piece in train:
                return "kept" if redundant[row["rank"]] else "train"
            return "generate" if piece in generate else "gathered" if piece in gathered else ""

        kinds.append([kind(piece) for piece in every_shard])
    return kinds


def _label(mesh: Mesh) -> str:
    gen_pp, gen_tp = layouts.gen_sizes(mesh)
    return (
        f"{mesh.transition}: train {mesh.pp}-{mesh.tp}-{mesh.dp} -> generate "
        f"{gen_pp}-{gen_tp}-{mesh.micro_dp}-{mesh.dp}"
    )


def draw_shard_map(meshes: Mesh | dict[str, Mesh], fig: Figure | None = None) -> Figure:
    """One row of rank columns per mesh (a dict's keys are shown as row titles with the layout)."""
    if isinstance(meshes, Mesh):
        meshes = {meshes.transition: meshes}
    if not isinstance(meshes, dict) or not meshes or not all(isinstance(m, Mesh) for m in meshes.values()):
        raise TypeError("draw_shard_map: pass a workbench Mesh or a non-empty dict of name -> Mesh")
    width = max(m.world_size for m in meshes.values())
    fig = fig or Figure(figsize=(max(7.0, 0.6 * width + 1.5), 0.9 + 1.5 * len(meshes)))
    axes = fig.subplots(len(meshes), 1, squeeze=False)[:, 0]
    for ax, (name, mesh) in zip(axes, meshes.items()):
        shards = mesh.pp * mesh.tp
        cell = 1.0 / shards  # every rank's column has the same height, whatever p·t is
        group_index = {r: i for i, g in enumerate(layouts.gather_groups(mesh)) for r in g}
        for rank, kinds in enumerate(cell_kinds(mesh)):
            x = rank * 1.25
            for k, kind in enumerate(kinds):
                ax.add_patch(
                    Rectangle(
                        (x, 1 - (k + 1) * cell),
                        1,
                        cell,
                        facecolor=COLOURS[kind],
                        edgecolor="white" if kind == "kept" else "#444",
                        lw=0.6,
                        hatch="xxx" if kind == "kept" else None,
                    )
                )
            group_colour = GROUP_COLOURS[group_index[rank] % len(GROUP_COLOURS)]
            ax.add_patch(Rectangle((x, -0.16), 1, 0.1, facecolor=group_colour, lw=0))
            ax.text(x + 0.5, -0.22, f"r{rank}", ha="center", va="top", fontsize=8)
        ax.set_xlim(-0.1, max(width * 1.25, 10))
        ax.set_ylim(-0.45, 1.02)
        ax.axis("off")
        title = _label(mesh) if name == mesh.transition else f"{name} — {_label(mesh)}"
        ax.set_title(title, fontsize=9, loc="left")
    handles = [
        Rectangle(
            (0, 0),
            1,
            1,
            facecolor=COLOURS[k],
            edgecolor="white" if k == "kept" else "#444",
            hatch="xxx" if k == "kept" else None,
        )
        for k in LEGEND
    ]
    fig.legend(handles=handles, labels=list(LEGEND.values()), loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.02, right=0.98, top=0.93, bottom=0.16, hspace=0.5)
    return fig
