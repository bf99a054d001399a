"""pinpool._plan: pure planning. Tests import from here (see pinpool._lazy)."""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "calls": "MAX_GROWTH MAX_REST MIN_DUTY PROBE_BYTES CallSizer Pacer RetryGrid RetrySplitter duty_cycle",
    "chunks": "Chunk ChunkPlan ChunkTable Order Span SpanTable",
    "elastic": "Action Decision ElasticPolicy ElasticState decide",
    "facts": "CpuQuota HostFacts cgroup_room cpu_budget effective_available",
    "declared": "DEFAULT_REGISTRY OPTIONS Option pool_options",
    "options": "BACKGROUND_MAX_CALL_SECONDS BACKGROUND_PIN_NICE MAX_NICE CHUNK_ENV DEFAULT_CHUNK_GIB "
               "MAX_CALL_SECONDS MAX_WORKERS PoolOptions chunk_limit_from_env",
    "plan": "LOOKAHEAD_CHUNKS PoolPlan Schedule plan_chunks plan_pool "
            "retry_splitter",
    "prefix": "PageRun PrefixTracker page_runs pin_order",
    "preflight": "check_engine_pins check_host place resident_fit",
    "reservation": "plan_reservation pool_reservation reservation_grids segment_schedule",
    "segments": "Reservation RunGrid Segment",
    "segment_book": "SegmentBook SegmentState Shrink merged",
    "transfers": "TransferPlan bound_by_registrars plan_transfer split_at_registrations",
})  # fmt: skip
