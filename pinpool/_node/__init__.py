"""pinpool._node: node pacing. Tests import from here (see pinpool._types.lazy_exports)."""

from .._types import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "config": "NodePacing",
    "locks": "BudgetHold NodeHolder SlotHold holder_state",
    "pacing": "NodeAdmission",
})  # fmt: skip
