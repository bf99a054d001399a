"""How far the repeated and randomized tests search: a sample in ``./dev test``, all of it in CI.

``./dev test`` must stay within its 4 minutes on a 2-CPU machine, so a test that repeats a race,
kills children at random moments or draws many examples runs a sample there; CI runs the tests
marked ``depth`` once more with ``PINPOOL_TESTS=deep``, at their full count (``.ci/run``). A test's
own environment knob (``PINPOOL_KILLS`` ...) still wins over both.
"""

from __future__ import annotations

import os

import pytest

DEEP = os.environ.get("PINPOOL_TESTS") == "deep"

depth = pytest.mark.depth  # CI's deep step selects these (-m depth)
deep_only = pytest.mark.skipif(not DEEP, reason="a case of a deep search: CI's deep step runs it (PINPOOL_TESTS=deep)")


def runs(quick: int, deep: int, knob: str | None = None) -> int:
    """``quick`` in ./dev test, ``deep`` in CI's deep step, or what the test's own ``knob`` says."""
    if knob is not None and knob in os.environ:
        return int(os.environ[knob])
    return deep if DEEP else quick
