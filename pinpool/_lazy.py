"""The folders' faces: each ``__init__`` lends the names tests use, loaded on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], object], list[str]]:
    """A folder ``__init__``'s ``__getattr__`` and ``__all__``: ``homes`` maps each of its modules to the
    names it lends, space-separated. Tests import from the folder (a file can move without touching
    them); a name loads on first use, so the folder imports nothing (no cycle, no torch for ``--help``)."""
    where = {name: module for module, names in homes.items() for name in names.split()}

    def get(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return get, sorted(where)
