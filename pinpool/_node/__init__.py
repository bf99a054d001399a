"""pinpool._node: node pacing. Tests import from here (see pinpool._lazy)."""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "config": "NodePacing default_directory mem_total_bytes",
    "pacing": "BudgetHold NodeAdmission NodeHolder SlotHold holder_state",
})  # fmt: skip
