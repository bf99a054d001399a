"""Layouts: what a pool's memory holds, and where copy pages begin and end (docs/layouts.md).

A layout turns a number of pages into buffers and says, per buffer, the byte size of one copy page:
chunk boundaries are multiples of it, so no batched copy straddles two registrations. A dtype is a
torch.dtype or its name (:data:`DTYPE_SPELLINGS`), here and in ``--layout-file``.
"""

from ._families import MHA, MLA, Dense, Indexer, Mamba, PagedBytes, Raw
from ._spec import DTYPE_SPELLINGS, BufferSpec, Layout, check_layout

__all__ = ["DTYPE_SPELLINGS", "MHA", "MLA", "BufferSpec", "Dense", "Indexer", "Layout", "Mamba", "PagedBytes", "Raw",
           "check_layout"]  # fmt: skip

# Public names report this module (reprs and docs say pinpool.layouts.X).
for _public in (MHA, MLA, Dense, Indexer, Mamba, PagedBytes, Raw, BufferSpec, Layout, check_layout):
    _public.__module__ = __name__
del _public
