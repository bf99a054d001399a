from typing import Any

from .._missing import placeholder


def __getattr__(name: str) -> Any:
    if name == "InterpolationMode":
        from . import InterpolationMode

        return InterpolationMode
    return placeholder(__name__, name)
