"""A package's names, imported on first use (PEP 562 `__getattr__`).

Every process pays for what it imports: seconds for torch and the model stack. A package whose
`__init__` imported all of its modules would load them into every process that needs one: a
notebook's `import workbench`, a reward scorer's process, its scoring child. With `exports`, a
name's module loads when the name is first read, and the name is then kept in the package."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

Where = str | tuple[str, str | None]
"""A name's module (the attribute of the same name there), or (module, attribute); attribute
None: the name is the module itself."""


def exports(package: str, table: Mapping[str, Where]) -> Callable[[str], Any]:
    """The `__getattr__` of `package` over `table` (name -> Where)."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        where = table[name]
        module, attribute = (where, name) if isinstance(where, str) else where
        value = importlib.import_module(module)
        if attribute is not None:
            value = getattr(value, attribute)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
