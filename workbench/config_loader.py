"""One typed loader for every config dataclass: mappings (YAML files, notebook dicts) and
`dotted.name=value` overrides into nested dataclasses, checked against the fields' type hints.

    config = load(PPOConfig, "ppo.yaml", ["sampling.n=4"], root="PPOConfig")
    sampling = build(SamplingConfig, {"n": 4, "temperature": 0.7})

Types understood: nested dataclasses (a mapping updates the field's default, so untouched
nested fields keep theirs), Optional and other unions, Literal, tuples (fixed or `...`), lists,
dicts, bool, int, float (ints widen; YAML 1.1's "3e-5" text is read as a number), str, and
callables (passed through). Overrides are read as YAML scalars (`4`, `3e-5`, `null`, `[+, -]`).

Every error is a ConfigError naming the full dotted field: an unknown field also names the
nearest valid one, a wrong type names the type expected, and the class's own checks
(`__post_init__`, raising `Owner.field` errors through workbench.checks) are renamed to the
dotted field they came from. Configs with rules of their own (the run config's algorithm
section, chosen by name) subclass `Loader`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import numbers
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from workbench import checks
from workbench.errors import ConfigError


class Loader:
    """Builds dataclasses from mappings. Subclasses may choose the class of a section from its
    values (`choose`) and keep fields out of a section (`hidden`)."""

    def choose(self, cls: type, values: dict, path: str, base: Any) -> tuple[type, Any]:
        """The class to build at `path`, and the instance to build on (None: the class's
        defaults). `values` is the section's own copy: a hook may take keys out of it."""
        return cls, base

    def hidden(self, cls: type) -> Mapping[str, str]:
        """Fields of `cls` a mapping may not set here, each with the fix to give."""
        return {}

    def build(self, cls: type, values: Any, path: str = "", base: Any = None) -> Any:
        """An instance of dataclass `cls` from a mapping, on top of `base` (default: cls's
        defaults): nested sections recurse, values are checked against the fields' types, and
        the class's own checks (__post_init__) run with their errors placed at `path`."""
        if isinstance(values, cls) and dataclasses.is_dataclass(values):
            return values
        if not isinstance(values, Mapping):
            raise ConfigError(path or "config", values, f"expected a mapping of {cls.__name__}'s fields")
        values = dict(values)
        cls, base = self.choose(cls, values, path, base)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        hints = typing.get_type_hints(cls)
        hidden = self.hidden(cls)
        changes = {}
        for key, value in values.items():
            where = join(path, str(key))
            if key in hidden:
                raise ConfigError(where, value, hidden[key])
            if key not in fields:
                raise unknown_field(where, value, list(fields), path)
            current = getattr(base, key) if base is not None else _default(fields[key])
            changes[key] = self.convert(value, hints[key], where, current)
        if base is None:
            missing = [name for name, f in fields.items() if name not in changes and _required(f)]
            if missing:
                raise ConfigError(
                    path or cls.__name__,
                    values,
                    "required field(s) missing: set " + ", ".join(join(path, name) for name in missing),
                )
        try:
            return dataclasses.replace(base, **changes) if base is not None else cls(**changes)
        except ConfigError as error:  # the class's own check: name the field by its dotted path
            raise ConfigError(_placed(error.where, cls, path), error.value, error.fix) from None
        except (TypeError, ValueError) as error:
            raise ConfigError(path or cls.__name__, values, str(error)) from None

    def convert(self, value: Any, hint: Any, where: str, current: Any = None) -> Any:
        """`value` checked against the type `hint` (ints widen to floats, lists to tuples)."""
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if hint is Any or hint is object:
            return value
        if origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            arms = [a for a in args if a is not type(None)]
            sections = [a for a in arms if dataclasses.is_dataclass(a)]
            if isinstance(value, Mapping) and len(sections) == 1:
                # A mapping for an optional section (`lora: {rank: 8}`): its own error, with its field.
                return self.convert(value, sections[0], where, current)
            for arm in arms:
                try:
                    return self.convert(value, arm, where, current)
                except ConfigError:
                    pass
            raise ConfigError(where, value, f"expected {_name(hint)}")
        if origin is Literal:
            checks.one_of("", where, value, args)
            return value
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            return self.build(hint, value, where, current if isinstance(current, hint) else None)
        if origin in (tuple, list) or hint in (tuple, list):
            return self._sequence(value, hint, where)
        if origin is dict or hint is dict:
            if not isinstance(value, Mapping):
                raise ConfigError(where, value, "expected a mapping")
            if len(args) != 2:
                return dict(value)
            return {
                self.convert(k, args[0], f"{where} key {k!r}"): self.convert(v, args[1], join(where, str(k)))
                for k, v in value.items()
            }
        if origin is collections.abc.Callable or hint is collections.abc.Callable:
            if callable(value):
                return value
            raise ConfigError(where, value, "expected a function")
        return _scalar(value, hint, where)

    def _sequence(self, value: Any, hint: Any, where: str) -> tuple | list:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(where, value, f"expected a list ({_name(hint)})")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(where, value, f"expected {len(args)} values ({_name(hint)})")
            items = [self.convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            item = args[0] if args else Any
            items = [self.convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or hint) is tuple else items


LOADER = Loader()
"""The plain loader: every config class without rules of its own."""


def build(cls: type, values: Any, path: str = "", base: Any = None) -> Any:
    """`LOADER.build`: an instance of dataclass `cls` from a mapping (see Loader.build)."""
    return LOADER.build(cls, values, path, base)


def convert(value: Any, hint: Any, where: str, current: Any = None) -> Any:
    """`LOADER.convert`: `value` checked against the type `hint`."""
    return LOADER.convert(value, hint, where, current)


def load(
    cls: type,
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    root: str = "",
    loader: Loader = LOADER,
) -> Any:
    """An instance of `cls` from a YAML file (or its defaults) with `dotted.name=value`
    overrides applied; errors name fields under `root` (e.g. the class name, or "" for none)."""
    return loader.build(cls, read(path, overrides), root)


def read(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), what: str = "fields"
) -> dict[str, Any]:
    """The mapping in a YAML file (empty without one) with the overrides applied, unchecked."""
    values = read_yaml(path, what) if path is not None else {}
    for override in overrides:
        apply_override(values, override)
    return values


def read_yaml(path: str | Path, what: str = "fields") -> dict[str, Any]:
    """The mapping a YAML file holds (an empty file: none); `what` says what it should map."""
    path = Path(path)
    if not path.exists():
        raise ConfigError("config file", str(path), "no such file")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", error)
        raise ConfigError("config file", str(path), f"not valid YAML ({problem}{at})") from None
    if not isinstance(values, dict):
        raise ConfigError("config file", str(path), f"the YAML must be a mapping of {what}")
    return values


def apply_override(values: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in nested dicts (value parsed as a YAML scalar)."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError("override", override, "write overrides as dotted.field=value, e.g. sampling.n=4")
    parts = key.strip().split(".")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(key, text, f"not a YAML value ({getattr(error, 'problem', error)})") from None
    node = values
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), child, f"is a value, not a section; cannot set {key}")
        node = child
    node[parts[-1]] = value


def unknown_field(where: str, value: Any, valid: list[str], section: str, what: str = "field") -> ConfigError:
    """The error for a name that is not one of `valid` in `section`, with the nearest valid one."""
    last = where.rsplit(".", 1)[-1]
    near = difflib.get_close_matches(str(last) if what == "field" else str(value), valid, n=1, cutoff=0.5)
    prefix = f"{section}." if section and what == "field" else ""
    hint = f"did you mean {prefix + near[0]!r}? " if near else ""
    listing = ", ".join(sorted(valid))
    inside = f" in {section!r}" if section else ""
    return ConfigError(where, value, f"no such {what}{inside}; {hint}valid: {listing}")


def to_plain(value: Any) -> Any:
    """Plain values (YAML- and JSON-writable) that `build` turns back into the same config;
    functions are written by their qualified name."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    return value


def join(path: str, name: str) -> str:
    """`path.name`, or `name` at the top."""
    return f"{path}.{name}" if path else name


# ---- helpers ----------------------------------------------------------------------------------
def _scalar(value: Any, hint: Any, where: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(where, value, "expected true or false")
    if hint is int:
        if checks.is_whole(value):
            return value
        raise ConfigError(where, value, "expected a whole number")
    if hint is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-5 (no dot) as text
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(where, value, "expected a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(where, value, "expected text (quote it in YAML)")
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ConfigError(where, value, f"expected {_name(hint)}")
    return value


def _placed(where: str, cls: type, path: str) -> str:
    """A class check's `Owner.field` as the dotted field under `path`."""
    if not path:
        return where
    head, _, rest = where.partition(".")
    return join(path, rest) if rest and head == cls.__name__ else f"{path} ({where})"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
