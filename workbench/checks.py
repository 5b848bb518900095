"""Small checks shared by the config dataclasses: each raises ConfigError naming the field
(`Owner.field`), the value and the fix, on the driver, before any remote work."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Iterable

from workbench.errors import ConfigError


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def whole(owner: str, field: str, value: Any, low: int = 1, fix: str = "") -> None:
    """A whole number >= low."""
    if not _is_int(value) or value < low:
        raise ConfigError(f"{owner}.{field}", value, fix or f"use a whole number >= {low}")


def real(owner: str, field: str, value: Any, low: float | None = None, high: float | None = None,
         low_open: bool = False, high_open: bool = False, fix: str = "", none_ok: bool = False) -> None:
    """A finite number in [low, high] (bounds open where asked); None when none_ok."""
    if value is None and none_ok:
        return
    ok = _is_real(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        bounds = " and ".join(b for b in (lo, hi) if b) or "finite"
        raise ConfigError(f"{owner}.{field}", value, fix or f"use a number {bounds}")


def one_of(owner: str, field: str, value: Any, choices: Iterable, fix: str = "") -> None:
    choices = list(choices)
    if value not in choices:
        raise ConfigError(f"{owner}.{field}", value, fix or f"use one of {choices}")


def of_type(owner: str, field: str, value: Any, kind: type | tuple, fix: str) -> None:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool) and bool not in _types(kind)):
        raise ConfigError(f"{owner}.{field}", value, fix)


def _types(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def data_parallel_only(owner: str, mesh, role: str) -> None:
    """Workers that shard with FSDP/ZeRO over data-parallel ranks implement no tp/pp: a tp or
    pp mesh would silently run full replicas."""
    gen = [x for x in (mesh.gen_tp, mesh.gen_pp) if x not in (None, 1)]
    if mesh.tp != 1 or mesh.pp != 1 or gen:
        raise ConfigError(
            f"{role} mesh", str(mesh),
            f"{owner} runs data parallelism only (FSDP/ZeRO shards over the ranks); use "
            f"Mesh(dp={mesh.world_size}) or leave mesh=None",
        )


def tensor_parallel_layout(owner: str, mesh, role: str, model_path, trust_remote_code: bool = False,
                           rollout: str | None = None) -> None:
    """backend="3d": tensor and data parallelism (pp = 1), a generation layout that only shrinks
    tensor parallelism, a model whose heads and widths split evenly, an HF rollout when the
    generation layout is cut."""
    if mesh.pp != 1 or mesh.gen_pp not in (None, 1):
        raise ConfigError(f"{role} mesh", str(mesh), f"{owner} with backend='3d' has no pipeline parallelism yet; use pp=1")
    gen_tp = mesh.gen_tp or mesh.tp
    if gen_tp > 1 and rollout not in ("hf", None):
        raise ConfigError(f"{owner}.rollout", rollout, f"a tensor-parallel generation layout (gen_tp={gen_tp}) runs the "
                          f"HF rollout; use rollout='hf', or gen_tp=1 for vLLM")
    from workbench.engines.tensor_parallel import check_tensor_parallel
    from workbench.models.load import load_config

    config = load_config(model_path, trust_remote_code)
    for size in {mesh.tp, gen_tp}:
        check_tensor_parallel(config, size, f"{owner}.model_path ({model_path})")


def mini_batch_splits(owner: str, mini_batch_size: int, dp: int, role: str) -> None:
    if mini_batch_size % dp:
        raise ConfigError(
            f"{owner}.mini_batch_size", mini_batch_size,
            f"it is split over the {role} group's {dp} data-parallel ranks; use a multiple of {dp}",
        )


def rows_split(owner: str, mini_batch_size: int, rows: int, role: str) -> None:
    """An update over `rows` rows takes mini-batches of mini_batch_size rows: all equal (a
    mini_batch_size above the rows is one step over all of them)."""
    if rows > mini_batch_size and rows % mini_batch_size:
        steps = [mini_batch_size] * (rows // mini_batch_size) + [rows % mini_batch_size]
        raise ConfigError(
            f"{owner}.mini_batch_size", mini_batch_size,
            f"the {role} update gets {rows} rows, which would make uneven optimizer steps of "
            f"{steps} rows; use a mini_batch_size that divides {rows} (rebuild the {role} group), "
            f"or change the number of prompts / samples",
        )


def training_fields(owner: str, config) -> None:
    """The settings every trained model's config shares (ActorConfig, CriticConfig)."""
    from workbench.engines.contract import OptimConfig# late: fsdp's own config uses these checks

    if not isinstance(config.model_path, (str, os.PathLike)) or not str(config.model_path):
        raise ConfigError(f"{owner}.model_path", config.model_path, "give a local Hugging Face checkpoint directory")
    whole(owner, "mini_batch_size", config.mini_batch_size,
          fix="use a whole number of rows >= 1 per optimizer step (summed over data-parallel ranks)")
    whole(owner, "micro_batch_size", config.micro_batch_size,
          fix="use a whole number of rows >= 1 per forward/backward on one rank")
    whole(owner, "epochs", config.epochs, fix="use a whole number of passes >= 1 over each batch")
    whole(owner, "seed", config.seed, low=0, fix="use a whole number >= 0")
    of_type(owner, "optim", config.optim, OptimConfig, "pass a workbench.OptimConfig(lr=...)")

