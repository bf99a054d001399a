"""The lines an adopter deletes (the released functions the drop-ins replace) and adds (the drop-ins).

Run by ``./dev peers`` (test_line_counts.py checks docs/integrations.md against it) or alone:
``.peers-venv/bin/python examples/integrations/peers/line_counts.py``. A line counts when it holds
code: not blank, not only a comment, not part of a docstring (``inspect.getsource`` for the released
objects, the whole file for a drop-in: every line of it is pasted)."""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import sys
import textwrap
import tokenize
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "stand_ins"))  # torchvision's import surface, for SGLang's srt package

# server -> (module, the names the adopter replaces), and the drop-in that replaces them
RELEASED = {
    "SGLang register/unregister": [
        ("sglang.srt.mem_cache.pool_host.common", "_cuda_host_register"),
        ("sglang.srt.mem_cache.pool_host.common", "_cuda_host_unregister_ranges"),
        ("sglang.srt.mem_cache.pool_host.common", "_cuda_host_unregister"),
    ],
    "SGLang allocation": [("sglang.srt.mem_cache.pool_host.common", "alloc_with_host_register")],
    "SGLang readiness gate": [],
    "SGLang HiCache NIXL": [
        ("sglang.srt.mem_cache.storage.nixl.hicache_nixl", "HiCacheNixl._pre_register_host"),
        ("sglang.srt.mem_cache.storage.nixl.hicache_nixl", "HiCacheNixl._alloc_registered"),
        ("sglang.srt.mem_cache.storage.nixl.hicache_nixl", "HiCacheNixl.close"),
    ],
    "SGLang HiCache Mooncake store": [
        ("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store", "MooncakeBaseStore.register_buffer"),
        ("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store", "MooncakeStore.close"),
    ],
    "vLLM": [("vllm.v1.kv_offload.cpu.gpu_worker", "pin_mmap_region")],
    "LMCache": [
        ("lmcache.v1.memory_management", "PinnedAllocFree"),
        ("lmcache.v1.memory_management", "_resolve_pinned_alloc_free"),
        ("lmcache.v1.memory_management", "_read_hugepage_info"),
        ("lmcache.v1.memory_management", "_allocate_cpu_memory"),
        ("lmcache.v1.memory_management", "_free_cpu_memory"),
    ],
    "LMCache NIXL L2 store": [
        ("lmcache.v1.distributed.l2_adapters.nixl_store_l2_adapter", "NixlStorageAgent.init_mem_handlers"),
        ("lmcache.v1.distributed.l2_adapters.nixl_store_l2_adapter", "NixlStorageAgent.close"),
    ],
    "LMCache lazy": [
        ("lmcache.v1.memory_allocators.lazy_memory_allocator", "LazyMemoryAllocator.__init__"),
        ("lmcache.v1.memory_allocators.lazy_memory_allocator", "LazyMemoryAllocator.close"),
        ("lmcache.v1.memory_allocators.lazy_memory_allocator", "LazyMemoryAllocator._pin_memory_chunk"),
        ("lmcache.v1.memory_allocators.lazy_memory_allocator", "LazyMemoryAllocator._expand_worker"),
    ],
}
DROP_INS = {
    "SGLang register/unregister": (
        "sglang_host_register.py",
        "_chunk_limit _open _record _cuda_host_register _cuda_host_unregister",
    ),
    "SGLang allocation": ("sglang_host_register.py", "alloc_with_host_register"),
    "SGLang readiness gate": ("sglang_host_register.py", "host_pool_ready GatedAlloc"),
    "SGLang HiCache NIXL": (
        "sglang_hicache_nixl.py",
        "_registrar _page_bytes _options _keep _pre_register_host _alloc_registered close",
    ),
    "SGLang HiCache Mooncake store": ("sglang_mooncake_store.py", "StoreRegistrar _page_bytes register_buffer close"),
    "vLLM": ("vllm_pin_mmap_region.py", "pin_mmap_region region_ready unpin_mmap_region"),
    "LMCache": ("lmcache_pinned_memory.py", "_allocate_cpu_memory _free_cpu_memory _numa_node"),
    "LMCache lazy": ("lmcache_pinned_memory.py", "lazy_allocator"),
    "LMCache NIXL L2 store": ("lmcache_nixl_store.py", "init_mem_handlers close"),
}


def code_lines(source: str) -> int:
    """Lines with a token that is not a comment and not inside a docstring."""
    source = textwrap.dedent(source)
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(value.lineno, (value.end_lineno or value.lineno) + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docstrings)
    return len(lines)


def _released(module: str, qualname: str) -> int:
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return code_lines(inspect.getsource(obj))  # type: ignore[arg-type]


def _drop_in(file: str, names: str | None) -> int:
    source = (HERE.parent / file).read_text()
    if names is None:
        return code_lines(source)
    tree = ast.parse(source)
    picked = [n for n in tree.body if getattr(n, "name", None) in names.split()]
    return sum(code_lines(ast.get_source_segment(source, n, padded=True) or "") for n in picked)


def counts() -> dict[str, tuple[int, int]]:
    """What is replaced -> (lines deleted, lines added); then each drop-in file whole -> (0, lines)."""
    rows = {
        what: (sum(_released(m, q) for m, q in names), _drop_in(*DROP_INS[what])) for what, names in RELEASED.items()
    }
    for file in sorted({file for file, _ in DROP_INS.values()}):
        rows[f"{file} (whole file)"] = (0, _drop_in(file, None))
    return rows


if __name__ == "__main__":
    for what, (deleted, added) in counts().items():
        print(f"{what}: {deleted} -> {added}")
