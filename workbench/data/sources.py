"""Where prompt rows come from: files and Hugging Face datasets, read as plain dicts, and the
mapping of a source's own columns onto the two the workbench needs, `prompt` and `ground_truth`.

Sources: `.jsonl` / `.json` (one object per line), `.parquet`, a directory written by
`Dataset.save_to_disk` / `DatasetDict.save_to_disk`, and any other local data file or
directory `datasets.load_dataset` reads (a folder of Parquet or CSV files, a `.csv`). Only
local paths are read: nothing asks the Hugging Face Hub.

verl's Parquet loads with no mapping: its `prompt` is already a chat, and its ground truth sits
at `reward_model.ground_truth`, which is where it is looked for when a row has no top-level
`ground_truth`. A mapping names other places, dotted into nested columns:
`{"prompt": "question", "ground_truth": "reward_model.ground_truth"}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError

COLUMNS = ("prompt", "ground_truth")
"""The fields every prompt row has (what a mapping may name)."""
VERL_GROUND_TRUTH = "reward_model.ground_truth"
PARQUET_HINT = "reading Parquet needs pyarrow (pip install pyarrow==26.0.1), or convert the file to JSONL"
DATASETS_HINT = "reading this source needs Hugging Face datasets (pip install datasets==5.2.0)"
FORMATS = (
    ".jsonl or .parquet, another data file Hugging Face datasets reads (.csv, .arrow, ...), "
    "or a directory written by save_to_disk"
)


class PromptDataError(WorkbenchError, ValueError):
    """A prompt file or row cannot be used; the message names the file, row and remedy."""


# ---- reading -----------------------------------------------------------------------------------
def read_rows(path: Path, split: str | None = None) -> list[dict[str, Any]]:
    """The rows of a source as dicts of plain Python values (lists, dicts, str, numbers: they
    survive numpy object arrays and pickling). `split` picks one of a dataset's splits
    (default "train"); a source with one table ignores it."""
    if not path.exists():
        raise PromptDataError(f"prompt file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if path.is_file() and suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    if path.is_file() and suffix == ".parquet":
        return _read_parquet(path)
    return _read_dataset(path, split)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise PromptDataError(f"{str(path)!r} line {line_no}: not valid JSON ({error})") from error
            if not isinstance(row, dict):
                kind = type(row).__name__
                raise PromptDataError(f"{str(path)!r} line {line_no}: expected a JSON object, got {kind}")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise PromptDataError(f"{str(path)!r}: {PARQUET_HINT}") from error
    return pq.read_table(path).to_pylist()


def _read_dataset(path: Path, split: str | None) -> list[dict]:
    try:
        import datasets
    except ImportError as error:
        raise PromptDataError(f"{str(path)!r}: {DATASETS_HINT}, or convert it to JSONL") from error
    loaded: Any
    local = datasets.DownloadConfig(local_files_only=True)  # never the Hub, even for a name it does not find
    try:
        if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
            loaded = datasets.load_from_disk(str(path))
        elif path.is_file():  # one data file: its format from its extension
            loaded = datasets.load_dataset(str(path.parent), data_files=path.name, download_config=local)
            loaded = next(iter(loaded.values()))
        else:
            loaded = datasets.load_dataset(str(path), download_config=local)
    except FileNotFoundError as error:  # no data files, or none of a format datasets knows
        kind = f"unknown format {path.suffix.lower()!r}" if path.is_file() else "no data files datasets reads"
        raise PromptDataError(f"prompt file {str(path)!r}: {kind}; use {FORMATS}") from error
    if isinstance(loaded, datasets.DatasetDict):
        name = split or "train"
        if name not in loaded:
            raise PromptDataError(
                f"{str(path)!r} has no split {name!r}; its splits are {list(loaded)}. Choose one with split=... "
                "(data.train_split or data.eval_split in a run config)"
            )
        loaded = loaded[name]
    return loaded.to_list()


# ---- mapping columns ---------------------------------------------------------------------------
def map_columns(rows: list[dict[str, Any]], columns: Mapping[str, str], where: str) -> list[dict[str, Any]]:
    """Rows with `prompt` and `ground_truth` (as text) taken from the source columns `columns`
    names (dotted paths reach into nested columns), every other column kept as it is, and the
    same keys in every row (None where a row lacks one), prompt and ground_truth first.

    A renamed top-level column is dropped (it is now `prompt` or `ground_truth`); a nested one
    stays with the column that holds it (verl's `reward_model`)."""
    unknown = sorted(set(columns) - set(COLUMNS))
    if unknown:
        raise PromptDataError(
            f"column mapping for {where}: unknown key(s) {unknown}; the keys are {list(COLUMNS)} "
            "(the workbench's names), each mapped to the source's column, e.g. "
            '{"prompt": "question", "ground_truth": "reward_model.ground_truth"}'
        )
    mapped = []
    for i, row in enumerate(rows):
        out: dict[str, Any] = {}
        renamed = set()
        for name in COLUMNS:
            source = columns.get(name) or _default_source(name, row)
            out[name] = _lookup(row, source, name, f"{where} row {i}")
            if source in row:
                renamed.add(source)
        out["ground_truth"] = str(out["ground_truth"])
        out.update((k, v) for k, v in row.items() if k not in renamed and k not in COLUMNS)
        mapped.append(out)
    return same_keys(mapped)


def same_keys(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with the same keys in the same order (first seen first), None where a row lacked
    one: a Batch's columns need the same fields in every piece of it."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    if all(list(row) == keys for row in rows):
        return rows
    return [{k: row.get(k) for k in keys} for row in rows]


def _default_source(name: str, row: dict[str, Any]) -> str:
    if name == "ground_truth" and name not in row:
        try:
            _get(row, VERL_GROUND_TRUTH)
            return VERL_GROUND_TRUTH
        except _Missing:
            pass
    return name


class _Missing(Exception):
    """A dotted path stops at `depth` (its first `depth` parts were found), at `value`."""

    def __init__(self, depth: int, value: Any):
        self.depth, self.value = depth, value


def _get(row: dict[str, Any], source: str) -> Any:
    """The value at `source`: a column, or a dotted path into nested ones."""
    if source in row:  # a column whose own name has dots
        return row[source]
    value: Any = row
    for depth, part in enumerate(source.split(".")):
        if not isinstance(value, dict) or part not in value:
            raise _Missing(depth, value)
        value = value[part]
    return value


def _lookup(row: dict[str, Any], source: str, name: str, where: str) -> Any:
    """`_get`, with an error naming what was found where the path stopped, and the fix."""
    try:
        return _get(row, source)
    except _Missing as missing:
        if missing.depth == 0:
            found = f"columns found: {sorted(map(str, row))}"
        else:
            parent = ".".join(source.split(".")[: missing.depth])
            found = (
                f"keys found in {parent!r}: {sorted(map(str, missing.value))}"
                if isinstance(missing.value, dict)
                else f"{parent!r} is {type(missing.value).__name__}, not a mapping of columns"
            )
        verl = f" (nor verl's {VERL_GROUND_TRUTH!r})" if source == "ground_truth" else ""
        raise PromptDataError(
            f"{where}: missing column {source!r}{verl}; {found}. Name the source's column with "
            f"data.columns.{name}=... in a run config, or load_prompts(path, columns={{{name!r}: ...}})"
        ) from None
