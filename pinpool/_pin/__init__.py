"""pinpool._pin: pinning. Tests import from here (see pinpool._lazy)."""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "drivers": "finalize_lifecycle run_async run_sync",
    "engine": "PinSession",
    "flag": "Flag",
    "lifecycle": "Lifecycle",
    "memory_source": "PoolMemory",
    "ledger": "ChunkState Ledger Phase RegistrationBook StopCause",
    "outcome": "TRANSITIONS Detach Outcome Ran RunThreads Step TransitionError check_move decide",
    "pipeline": "WAIT Batch Landing Pipeline",
    "sigint": "guard_state",
    "teardown": "ABANDON_AFTER_CTRL_C TEARDOWN_TRIES",
    "threads": "Threads",
    "transfer_calls": "call_registrar",
    "transfer_ledger": "RunState TransferLedger",
    "untrusted": "untrusted_call",
})  # fmt: skip
