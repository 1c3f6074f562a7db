"""Package facades: each package's `__init__.py` names its public API, and a name's module is imported
on first use, not when the package is.

Why lazily: Python runs a package's `__init__` before any of its modules, so an eager facade would make
every import of a light module pay for its heaviest sibling — a Ray Data task that only reads a table
part (`pipeline.store.part_log`) would import torch for `pipeline.store.shards`, and the ingress replica
would load the model stack through `serve.kv`. A lazy facade keeps what each process imports exactly
what it uses, while callers still import from the package (`from pipeline.store import Store`).

The table is a literal dict, so tools that read the source (tests/project/test_import_graph.py) resolve a
facade name to its defining module without importing anything.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, modules: dict[str, list[str]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """`__getattr__`, `__dir__` and `__all__` of `package`, exporting each listed name from its module
    (relative to the package). A name listed twice is a mistake and fails here, at import."""
    where: dict[str, str] = {}
    for module, names in modules.items():
        for name in names:
            if name in where:
                raise ValueError(f"{package}: {name!r} is exported from both {where[name]} and {module}")
            where[name] = module
    # A submodule import binds the submodule's name on its package, over whatever the facade exported
    # under that name: such a name would resolve to the module or the function depending on import order.
    clashing = sorted(name for name in where if importlib.util.find_spec(f"{package}.{name}") is not None)
    if clashing:
        raise ValueError(f"{package}: exported {clashing} are also names of its submodules")

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f"{package}.{module}"), name)
        import_module(package).__dict__[name] = value  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(where) | set(import_module(package).__dict__))

    return __getattr__, __dir__, sorted(where)
