"""A stand-in for torchvision, which SGLang's ``srt`` package imports at module level (its
multimodal processors); the host pools never call it. Every name imports, and raises
NotImplementedError when called, so a test that reached real torchvision code fails loudly."""

from typing import Any

from . import transforms as transforms
from ._missing import placeholder


def __getattr__(name: str) -> Any:
    return placeholder(__name__, name)
