"""Placeholders for names imported at module level: importable, and raising when used."""

from typing import Any


def placeholder(module: str, name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{module}.{name}: the peers suite's torchvision stand-in has only the import surface"
        )

    missing.__name__ = name
    return missing
