"""One layout of every family pinpool has, and every layout of the KV families, for tests that must hold for
each (the real engines' pieces, an elastic pool's segments)."""

from __future__ import annotations

import torch

from pinpool import layouts

KiB = 1 << 10

# One of every family, and every layout of the KV families (layer-first ones keep several page runs per
# buffer; page_first with v_head_dim and Mamba keep several buffers, so one page run is several spans).
LAYOUTS = [
    layouts.Raw(),
    layouts.Raw(granularity_bytes=12 * KiB),
    layouts.Dense((3, 1000), torch.float32),
    layouts.MHA("layer_first", 2, 16, 4, 32, torch.bfloat16),
    layouts.MHA("page_first", 2, 16, 4, 32, torch.bfloat16),
    layouts.MHA("page_first_direct", 2, 16, 4, 32, torch.bfloat16),
    layouts.MHA("page_head", 2, 16, 4, 32, torch.bfloat16),
    layouts.MHA("page_unified", 2, 16, 4, 32, torch.bfloat16, head_group_num=2),
    layouts.MHA("page_first", 2, 4, 2, 64, torch.float16, v_head_dim=32),
    layouts.MHA("layer_first", 3, 5, 3, 7, torch.float8_e4m3fn, k_only=True),
    layouts.MLA("layer_first", 3, 16, 72, torch.bfloat16),
    layouts.MLA("page_first", 3, 16, 72, torch.bfloat16),
    layouts.MLA("page_first_direct", 3, 16, 72, torch.bfloat16),
    layouts.MLA("page_unified", 3, 16, 72, torch.bfloat16),
    layouts.Mamba(2, (3, 5), ((0, 2), (7,)), torch.float32),
    layouts.Indexer("layer_first", 2, 3, 48, 16),
    layouts.Indexer("page_first", 2, 3, 48, 16),
    layouts.PagedBytes("layer_first", 3, 1001),
    layouts.PagedBytes.state("page_first", 2, 3, 77),
]


def layout_id(layout: layouts.Layout) -> str:
    extra = "-k" if getattr(layout, "k_only", False) else "-v" if getattr(layout, "v_head_dim", None) else ""
    extra += "-granular" if getattr(layout, "granularity_bytes", None) else ""
    return f"{layout.name}{extra}"
