"""pinpool._plan: pure planning. Tests import from here (see pinpool._types.lazy_exports)."""

from .._types import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "chunks": "Chunk ChunkPlan ChunkTable Order Span SpanTable",
    "cutter": "RetryGrid RetrySplitter retry_splitter",
    "declared": "DEFAULT_REGISTRY OPTIONS Option pool_options",
    "duty": "MAX_REST MIN_DUTY Pacer duty_cycle",
    "options": "BACKGROUND_PIN_NICE CHUNK_ENV DEFAULT_CHUNK_GIB MAX_CALL_SECONDS MAX_WORKERS PoolOptions "
               "chunk_limit_from_env resolve_chunk_limit",
    "placement": "place",
    "plan": "LOOKAHEAD_CHUNKS PoolPlan _aligned_boundary _no_aligned_boundary plan_chunks plan_pool",
    "prefix": "PageRun PrefixTracker page_runs pin_order",
    "preflight": "check_host",
    "stall": "MAX_GROWTH PROBE_BYTES CallSizer",
})  # fmt: skip
