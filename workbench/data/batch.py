"""Batch: the unit of data that flows between worker groups.

A Batch is a tensordict.TensorDict of per-row tensors (B x ...) plus per-row non-tensor
columns (prompt text, ground truth, uid: numpy object arrays) and batch-wide `info`
(sampling settings, step number). Row operations (slice, chunk, concat, repeat) act on
tensors and columns together so they never drift apart.

Padding for data parallelism is explicit: `pad_to_multiple(k)` appends copies of the first
rows and marks them in the boolean column `PAD_KEY`; every row operation carries that mark
along (even `repeat`, for n samples per prompt), so `unpad()` removes exactly the padding
whatever happened to the rows in between.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.compiler


@contextlib.contextmanager
def _compile_marks_deferred() -> Iterator[None]:
    """tensordict marks some of its functions for torch.compile as it loads (`allow_in_graph`,
    `assume_constant_result`), and marking imports torch._dynamo: over a second in every process
    that imports a Batch (each Ray worker), most of which never compile. The marks matter only to
    torch.compile tracing tensordict's own code, which nothing here does: they are left off."""
    marks = ("allow_in_graph", "assume_constant_result")
    if "torch._dynamo" in sys.modules or "tensordict" in sys.modules:
        yield
        return
    saved = {name: getattr(torch.compiler, name) for name in marks}
    for name in marks:
        setattr(torch.compiler, name, lambda fn: fn)
    try:
        yield
    finally:
        for name, mark in saved.items():
            setattr(torch.compiler, name, mark)


with _compile_marks_deferred():
    from tensordict import TensorDict

PAD_KEY = "is_padding"


def _as_column(values: Any, name: str) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.ndim == 1:
        return values
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


class Batch:
    """Rows of tensors and non-tensor columns, with batch-wide `info`."""

    def __init__(
        self,
        tensors: TensorDict | dict[str, torch.Tensor] | None = None,
        columns: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        info: dict[str, Any] | None = None,
    ):
        arrays = {k: _as_column(v, k) for k, v in (columns or {}).items()}
        if tensors is None or not isinstance(tensors, TensorDict):
            tensors = dict(tensors or {})
            lengths = {len(v) for v in tensors.values()} | {len(v) for v in arrays.values()}
            if len(lengths) > 1:
                sizes = {k: len(v) for k, v in [*tensors.items(), *arrays.items()]}
                raise ValueError(f"Batch fields have different row counts: {sizes}")
            rows = lengths.pop() if lengths else 0
            tensors = TensorDict(tensors, batch_size=[rows])
        self.tensors: TensorDict = tensors
        self.columns: dict[str, np.ndarray] = arrays
        self.info: dict[str, Any] = dict(info or {})
        for name, column in arrays.items():
            if len(column) != len(self):
                raise ValueError(f"Batch column {name!r} has {len(column)} rows but the tensors have {len(self)}")

    # ---- shape and access -------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.tensors.batch_size[0]) if self.tensors.batch_dims else 0

    def keys(self) -> list[str]:
        return [*self.tensors.keys(), *self.columns.keys()]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors.keys() or key in self.columns

    def __getitem__(self, index):
        if isinstance(index, str):
            if index in self.columns:
                return self.columns[index]
            if index in self.tensors.keys():
                return self.tensors[index]
            raise KeyError(f"Batch has no field {index!r}; fields: {self.keys()}")
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        if isinstance(index, torch.Tensor):
            index = index.cpu().numpy()
        return Batch(
            self.tensors[torch.as_tensor(index) if isinstance(index, np.ndarray) else index],
            {k: v[index] for k, v in self.columns.items()},
            self.info,
        )

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            column = _as_column(value, key)
            if len(column) != len(self):
                raise ValueError(f"column {key!r} has {len(column)} rows, Batch has {len(self)}")
            self.columns[key] = column

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (what a transfer of this batch moves, columns aside)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values(True, True))

    # ---- row operations -----------------------------------------------------------------
    def chunk(self, n: int) -> list[Batch]:
        """Split into n equal parts; the row count must divide (pad first if it does not)."""
        if n <= 0 or len(self) % n:
            raise ValueError(
                f"cannot chunk a Batch of {len(self)} rows into {n} equal parts; call pad_to_multiple({n}) first"
            )
        size = len(self) // n
        return [self[i * size : (i + 1) * size] for i in range(n)]

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        batches = list(batches)
        if not batches:
            raise ValueError("Batch.concat needs at least one Batch")
        first = batches[0]
        for b in batches[1:]:
            if set(b.keys()) != set(first.keys()):
                raise ValueError(f"cannot concat Batches with fields {first.keys()} and {b.keys()}")
        tensors = (
            torch.cat([b.tensors for b in batches])
            if first.tensors.keys()
            else TensorDict({}, batch_size=[sum(len(b) for b in batches)])
        )
        columns = {k: np.concatenate([b.columns[k] for b in batches]) for k in first.columns}
        return Batch(tensors, columns, first.info)

    def select(self, *keys: str) -> Batch:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no field(s) {missing}; fields: {self.keys()}")
        tensor_keys = [k for k in keys if k in self.tensors.keys()]
        if PAD_KEY in self.tensors.keys() and PAD_KEY not in tensor_keys:
            tensor_keys.append(PAD_KEY)  # padding marks follow the rows they mark
        return Batch(
            self.tensors.select(*tensor_keys),
            {k: self.columns[k] for k in keys if k in self.columns},
            self.info,
        )

    def union(self, other: Batch) -> Batch:
        """Fields of both (same rows); a field present in both must hold equal values."""
        if len(other) != len(self):
            raise ValueError(f"cannot union Batches of {len(self)} and {len(other)} rows")
        tensors = self.tensors.clone(recurse=False)
        for key, value in other.tensors.items():
            if key in tensors.keys() and not torch.equal(tensors[key], value):
                raise ValueError(f"union: field {key!r} differs between the two Batches")
            tensors[key] = value
        columns = dict(self.columns)
        for key, value in other.columns.items():
            if key in columns and not np.array_equal(columns[key], value):
                raise ValueError(f"union: column {key!r} differs between the two Batches")
            columns[key] = value
        return Batch(tensors, columns, {**self.info, **other.info})

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """n copies of every row: [a, a, b, b] when interleaved, [a, b, a, b] otherwise."""
        order = np.arange(len(self))
        order = np.repeat(order, n) if interleave else np.tile(order, n)
        return self[order]

    def pad_to_multiple(self, k: int) -> Batch:
        """Append copies of the first rows, marked in PAD_KEY, until len is a multiple of k."""
        missing = -len(self) % k
        marked = self if PAD_KEY in self.tensors.keys() else self._with_pad_mark()
        if not missing:
            return marked
        if len(self) == 0:
            raise ValueError(f"cannot pad an empty Batch to a multiple of {k}")
        filler = marked[np.arange(missing) % len(self)]
        filler.tensors[PAD_KEY] = torch.ones(missing, dtype=torch.bool)
        return Batch.concat([marked, filler])

    def unpad(self) -> Batch:
        """Drop rows marked as padding, and the mark itself."""
        if PAD_KEY not in self.tensors.keys():
            return self
        keep = ~self.tensors[PAD_KEY]
        out = self[keep.numpy()] if not bool(keep.all()) else self[:]
        del out.tensors[PAD_KEY]
        return out

    @property
    def num_valid(self) -> int:
        """Rows that are not padding."""
        if PAD_KEY not in self.tensors.keys():
            return len(self)
        return len(self) - int(self.tensors[PAD_KEY].sum())

    def _with_pad_mark(self) -> Batch:
        tensors = self.tensors.clone(recurse=False)
        tensors[PAD_KEY] = torch.zeros(len(self), dtype=torch.bool)
        return Batch(tensors, self.columns, self.info)

    def to(self, device: str | torch.device) -> Batch:
        return Batch(self.tensors.to(device), self.columns, self.info)

    # ---- comparison, pickling, display ----------------------------------------------------
    def equals(self, other: Batch) -> bool:
        return (
            set(self.keys()) == set(other.keys())
            and len(self) == len(other)
            and all(torch.equal(v, other.tensors[k]) for k, v in self.tensors.items())
            and all(np.array_equal(v, other.columns[k]) for k, v in self.columns.items())
        )

    def __reduce__(self):
        # Plain tensors and numpy arrays let Ray's serializer move buffers out of band
        # instead of pickling a TensorDict object graph.
        tensors = {k: v for k, v in self.tensors.items()}
        return _rebuild, (tensors, len(self), self.columns, self.info)

    def __repr__(self) -> str:
        fields = ", ".join(
            [f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in self.tensors.items()]
            + [f"{k}: column" for k in self.columns]
        )
        return f"Batch(rows={len(self)}, {fields}, info={sorted(self.info)})"

    def table(self, max_rows: int = 8, max_chars: int = 40):
        """A compact pandas-free view: list of dicts (one per row) for printing in notebooks."""
        rows = []
        for i in range(min(len(self), max_rows)):
            row = {}
            for k, v in self.columns.items():
                row[k] = str(v[i])[:max_chars]
            for k, v in self.tensors.items():
                value = v[i]
                row[k] = value.item() if value.numel() == 1 else f"{tuple(value.shape)}"
            rows.append(row)
        return rows


def _rebuild(tensors: dict, rows: int, columns: dict, info: dict) -> Batch:
    return Batch(TensorDict(tensors, batch_size=[rows]), columns, info)
