import enum
from typing import Any

from .._missing import placeholder
from . import functional as functional
from . import v2 as v2


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    NEAREST_EXACT = "nearest-exact"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str) -> Any:
    return placeholder(__name__, name)
