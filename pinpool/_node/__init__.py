"""pinpool._node: node pacing. Tests import from here (see pinpool._types.lazy_exports)."""

from .._types import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "config": "NodePacing",
    "pacing": "BudgetHold NodeAdmission NodeHolder SlotHold holder_state",
})  # fmt: skip
