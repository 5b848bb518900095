"""What a config names by reference: `path/to/file.py:name` or `package.module:name` (a reward
function, an environment's factory).

A file is imported under a private module name (two files called rewards.py stay apart) and is
sent to other processes by value, as is a module outside the installed packages: a scoring
process, a Ray worker or a tool jail that cannot import it by name still gets its functions and
classes. Installed packages and the workbench's own travel by name, as usual.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError

OWN_PACKAGES = ("workbench", "algorithms", "widgets")
"""Packages every process of a session imports itself: their objects travel by name."""


class NotFound(WorkbenchError, LookupError):
    """A reference names nothing that can be loaded; the message says what was missing and the fix."""


def find(reference: str) -> Any:
    """The object `reference` names."""
    target, colon, name = reference.rpartition(":")
    if not colon or not target or not name:
        raise NotFound(f"{reference!r} names no object: write `path/to/file.py:name` or `package.module:name`")
    module = _file_module(target) if target.endswith(".py") else _import(target)
    if not hasattr(module, name):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise NotFound(f"{target} has no function {name!r}; its functions: {found}")
    return getattr(module, name)


def _file_module(path: str):
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise NotFound(f"no such file {path!r} (relative paths start at {Path.cwd()})")
    name = f"workbench_user.{file.stem}_{hashlib.blake2b(str(file).encode(), digest_size=4).hexdigest()}"
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise NotFound(f"importing {path!r} raised {error!r}") from error
    _by_value(module)
    return module


def _import(name: str):
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        raise NotFound(
            f"cannot import {name!r} ({error}); give the file instead (`path/to/{name.replace('.', '/')}.py:name`), "
            f"or install the package"
        ) from error
    installed = any(str(module.__file__ or "").startswith(p) for p in {sys.prefix, sys.base_prefix})
    if not installed and name.partition(".")[0] not in OWN_PACKAGES:
        _by_value(module)
    return module


def _by_value(module) -> None:
    """Both picklers: cloudpickle's (scoring processes, jails) and Ray's (worker groups)."""
    import cloudpickle
    import ray.cloudpickle

    cloudpickle.register_pickle_by_value(module)
    ray.cloudpickle.register_pickle_by_value(module)
