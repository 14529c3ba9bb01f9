"""The cache layout (cache_layout.py, kv_format.py) as Triton constexprs, for the cache kernels
(cache_pool_kernels.py, cache_list_kernels.py, cache_release_kernels.py, cache_sync.py)."""

from __future__ import annotations

import triton.language as tl

from custom_ops import cache_layout as C
from custom_ops.kv_format import INDEX_PAGE_BYTES, INDEX_ROW_BYTES, PAGE
from custom_ops.prefetch_layout import EPOCH_SHIFT, PF_PROMOTED

# Globals read inside kernels must be constexpr.
M_CLOCK = tl.constexpr(C.CLOCK)
M_NFREE = tl.constexpr(C.NFREE)
M_OVERFLOW = tl.constexpr(C.OVERFLOW)
M_IDX_HW = tl.constexpr(C.IDX_HW)
M_NMISS = tl.constexpr(C.NMISS)
M_ALLOC_CTR = tl.constexpr(C.ALLOC_CTR)
M_VICT_CTR = tl.constexpr(C.VICT_CTR)
M_EQ_CTR = tl.constexpr(C.EQ_CTR)
M_DONE = tl.constexpr(C.DONE)
M_LAST_ALLOC = tl.constexpr(C.LAST_ALLOC)
M_LAST_EVICT = tl.constexpr(C.LAST_EVICT)
M_LAST_MISS = tl.constexpr(C.LAST_MISS)
M_HEAD = tl.constexpr(C.HEAD)
M_LOOKED = tl.constexpr(C.LOOKED)
M_HISTED = tl.constexpr(C.HISTED)
M_PLACED = tl.constexpr(C.PLACED)
M_COPIED = tl.constexpr(C.COPIED)
M_FREE0 = tl.constexpr(C.FREE0)
S_SELECTED = tl.constexpr(C.SELECTED)
S_RECALLED = tl.constexpr(C.RECALLED)
S_STEPS = tl.constexpr(C.STEPS)
S_EVICTED = tl.constexpr(C.EVICTED)
CLOCK_MASK = tl.constexpr(C.CLOCK_MASK)
AGE_EXACT = tl.constexpr(C.AGE_EXACT)
AGE_SHIFT = tl.constexpr(C.AGE_SHIFT)
NBINS = tl.constexpr(C.NBINS)
PENDING = tl.constexpr(C.PENDING)
PAGE_C = tl.constexpr(PAGE)
IDX_PAGE_W = tl.constexpr(INDEX_PAGE_BYTES // 4)  # int32 words per indexer-cache page (2112)
IDX_ROW_W = tl.constexpr(INDEX_ROW_BYTES // 4)  # 33 words: 32 of fp8 values, 1 fp32 scale
# echo::recall_staged's copy: the staging tags (prefetch_layout) and the promoted-rows count
STAGE_SHIFT = tl.constexpr(EPOCH_SHIFT)
PF_PROMOTED_C = tl.constexpr(PF_PROMOTED)
