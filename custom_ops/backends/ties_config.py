"""The tie fix-up's kernel variants, by name (no Triton import: the benchmark and the op read it).

``FIXUP_VARIANTS[DEFAULT_FIXUP]`` is what ``echo::fi_topk`` runs (``flashinfer_ops.OPTIONS
["fixup"]`` names it); ``benchmarks/bench_topk_fixup.py`` checks and times every entry side by
side, so switching the default after a GPU run is one line here. Every variant selects exactly
``ties.threshold_select_ref``'s set; they differ only in how the work is cut:

- ``v1``: the first kernels (``ties_kernels``): a kth launch, a count pass and an output pass with
  about 4 programs per SM looping over 2048-score blocks, two ``tl.cumsum`` per block. Measured
  ~43 us at B = 64, 100K on the H200: a few long serial chains per SM (load, two scans, a page
  gather that waits on them, store), so latency bound, not bandwidth bound (two reads of 25.6 MB
  are ~11 us).
- ``v2`` (``ties_fast_kernels``): many short programs (``progs_per_sm``, default 16: one or two
  blocks each, so loads of many programs are in flight at once), one scan of a packed int32
  (gt count in the low 16 bits, tie count in the high 16) instead of two, one packed reduction
  in the count pass, the block table read together with the scores (not after the scans), score
  loads masked by the row width, not the live length (so they compile to vector loads), and no
  scan at all for a block that selects nothing. ``fold_kth``: the count pass finds kth itself
  (topk gathers per program) instead of a launch of its own; ``reverse``: the output pass walks
  the chunks in the opposite order to the count pass, so it starts where that pass ended (those
  scores are the likeliest still in L2); ``tile``: the output pass sees a block as a
  [block / 64, 64] tile, one page a row, so the block table is read once per page, not once per
  score, and a thread holds fewer live values (ptxas for sm_90 gives it clearly fewer registers
  than the 1-D block, so more programs fit on an SM).
- ``v3`` (``ties_compact_kernels``): the scores read about once instead of twice. The first pass
  counts (as v2's count pass) and also lists each chunk's scores above kth in position order;
  the second copies those lists to the output for every chunk that takes no ties (all but the
  chunk of the k-th value on scores with few ties, all but the first few with many) and runs
  v2's output pass only over the chunks that do. It pays a scan per block that holds a score
  above kth in the first pass, and the tie-taking chunks' second read sits on its critical path.
  Uses v2's chunking, kth and skip options; always tiled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class FixupConfig:
    variant: str = "v2"  # "v1" | "v2" | "v3" (see the module docstring)
    block: int = 2048  # scores per loop iteration (power of two; v2: <= 16384, the packed counts)
    chunk: int | None = None  # tokens per program (a multiple of block); None: from progs_per_sm
    warps: int = 4
    progs_per_sm: int = 16  # v2 with chunk None: about this many programs per SM (v1: 4)
    packed: bool = True  # v2: one scan of gt | eq << 16 instead of two scans
    skip: bool = True  # v2: no scan for a block that selects nothing
    # v2: kth found in the count pass, each program gathering the k scores itself, instead of a
    # launch of its own; None: where that is at most one program per SM (small B: a launch saved,
    # few gathers; at B = 64 it would be ~3M gathers, a launch is cheaper)
    fold_kth: bool | None = None
    reverse: bool = True  # v2: the output pass walks the chunks backwards
    tile: bool = True  # v2: the output pass sees a block as [block / 64, 64] (one page a row)

    def check(self) -> None:
        if self.variant not in ("v1", "v2", "v3"):
            raise ValueError(f"FixupConfig: variant must be v1, v2 or v3, got {self.variant!r}")
        b = self.block
        if b < 16 or b & (b - 1) or (self.variant != "v1" and b > 16384):
            raise ValueError(f"FixupConfig: block must be a power of two in [16, 16384], got {b}")
        tiled = self.variant == "v3" or (self.variant == "v2" and self.tile)
        if tiled and b < 64:
            raise ValueError(f"FixupConfig: a tiled block holds whole pages (>= 64), got {b}")
        if self.chunk is not None and (self.chunk <= 0 or self.chunk % b):
            raise ValueError(f"FixupConfig: chunk {self.chunk} must be a multiple of block {b}")
        if self.warps not in (1, 2, 4, 8, 16) or self.progs_per_sm < 1:
            raise ValueError(f"FixupConfig: bad warps {self.warps} / progs_per_sm")


_V2 = FixupConfig()
FIXUP_VARIANTS: dict[str, FixupConfig] = {
    "v1": FixupConfig(variant="v1"),
    "v2": _V2,  # 29.7 us at B = 64, 100K on the H200 (v3: 26.2)
    "v2_kth_kernel": replace(_V2, fold_kth=False),
    "v2_fold": replace(_V2, fold_kth=True),
    "v2_fold_pps4": replace(_V2, fold_kth=True, progs_per_sm=4),  # fewer programs, fewer gathers
    "v2_1d": replace(_V2, tile=False),
    "v2_pps4": replace(_V2, progs_per_sm=4),
    "v2_pps32_b1024": replace(_V2, block=1024, progs_per_sm=32),
    "v2_w8": replace(_V2, warps=8),
    "v2_b4096_w8": replace(_V2, block=4096, warps=8),
    "v2_noskip_forward": replace(_V2, skip=False, reverse=False),
    "v3": replace(_V2, variant="v3"),
    "v3_pps4": replace(_V2, variant="v3", progs_per_sm=4),
}
# v3: the fastest measured at B = 16 and 64 (100K), where auto serves the top-k through FlashInfer
# (benchmarks/results/topk_fixup_h200.json: 26.2 us vs v2 29.7 and v1 44.5 at B = 64, 100K)
DEFAULT_FIXUP = "v3"


def fixup_config(name: str) -> FixupConfig:
    if name not in FIXUP_VARIANTS:
        raise ValueError(f"unknown fix-up variant {name!r}; known: {sorted(FIXUP_VARIANTS)}")
    return FIXUP_VARIANTS[name]
