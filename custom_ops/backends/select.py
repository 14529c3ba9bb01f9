"""Which backend serves which half of the decode indexer, and the call that runs the choice.

``kernel_backend`` (an engine option): ``triton`` (the fused Triton op, the portable fallback),
``deep_gemm`` (DeepGEMM scores, Triton top-k), ``flashinfer`` (Triton scores, FlashInfer top-k +
the tie fix-up), ``auto`` (per half and batch size, from ``AUTO_TABLE``). A library that is not
installed, a device that is not CUDA, or a shape the library does not support (DeepGEMM: 32 or 64
index heads) falls back to Triton. Everything is decided from static shapes when the step is
traced, so each compiled bucket holds one fixed chain of ops.

Prefill's indexer (``echo::prefill_indexer_topk``, one request a chunk) has one library half,
the scores: ``prefill_plan`` gives DeepGEMM's ``fp8_mqa_logits`` (``deep_gemm``, or ``auto`` by
``PREFILL_AUTO_TABLE``) or Triton; its top-k stays our radix select. What stays Triton in every
mode: the fused indexer + prefetch kernel (it needs each score as it is produced).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from dataclasses import dataclass

import torch

from custom_ops.backends.deep_gemm_ops import HEADS, dg_paged_mqa_logits, logits_width
from custom_ops.backends.flashinfer_ops import fi_topk
from custom_ops.backends.split_ops import index_scores, topk_from_scores
from custom_ops.indexer import indexer_topk
from custom_ops.kv_format import PAGE

BACKENDS = ("auto", "triton", "deep_gemm", "flashinfer")
# the default of every engine option and CLI flag: measured fastest end to end on the H200
# (docs/backends.md); without the libraries, and on CPU, it is the Triton path
DEFAULT_BACKEND = "auto"
LIBRARY = {"deep_gemm": "deep_gemm", "flashinfer": "flashinfer"}  # backend -> import name

# ``auto``: per half, the backend for a decode batch of at least ``min_batch`` rows (the last row
# whose min_batch <= B wins). The rows are the ``auto_table`` that the H200 run of 2026-12-01
# 19:58 UTC suggested (benchmarks/results/backends_h200.json, by speed at 100K context; B = 1 /
# 16 / 64 measured, so each row holds from its batch up to the next): DeepGEMM scores at every
# batch (6.1 vs 8.7 us at B = 1, 216 vs 259 at B = 64); Triton top-k at B = 1 (28.1 vs 50.2 us
# with the tie fix-up), FlashInfer + fix-up from B = 16 (60.7 vs 66.6 us; at B = 64 77.3 vs
# 170.2). End to end ``auto`` measured faster than ``triton`` (benchmarks/results/
# e2e_backend_{triton,auto}_h200.json), hence DEFAULT_BACKEND. Refill from
#     python -m benchmarks.bench_backends --step-batches 64 --out $OUT/backends_h200.json
AUTO_TABLE: dict[str, tuple[tuple[int, str], ...]] = {
    "scores": ((1, "deep_gemm"), (16, "deep_gemm"), (64, "deep_gemm")),
    "topk": ((1, "triton"), (16, "flashinfer"), (64, "flashinfer")),
}


# ``auto`` for prefill's scores, by the chunk's query count T (the last row whose min_tokens <= T
# wins; T is a static shape of each compiled chunk bucket): DeepGEMM, as the H200 run of
# 2026-12-01 20:02 UTC measured (benchmarks/results/prefill_h200.json, ``dg_indexer``: a
# 2048-query chunk's whole ``prefill_indexer_topk`` 2.69 vs 2.72 ms at 32K, 8.68 vs 9.04 ms at
# 100K; its logits alone 1.07 vs 1.21 and 3.34 vs 3.73 ms), for chunks of at least the 2048
# tokens measured; shorter ones (an eager prefill's last chunk) keep Triton, not measured. Refill
# from ``python -m benchmarks.bench_prefill --out $OUT/prefill_h200.json`` (its
# ``dg_indexer.prefill_auto_table``).
PREFILL_AUTO_TABLE: tuple[tuple[int, str], ...] = ((1, "triton"), (2048, "deep_gemm"))


def check_backend(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {', '.join(BACKENDS)}; got {name!r}")


@functools.cache
def installed(backend: str) -> bool:
    """Whether the library behind ``backend`` is installed and imports (once per process, when a
    cache is built, never inside a traced step). A broken install warns and falls back."""
    name = LIBRARY[backend]
    if importlib.util.find_spec(name) is None:
        return False
    try:
        importlib.import_module(name)
    except Exception as e:  # an install that cannot load (no CUDA runtime, ABI mismatch, ...)
        msg = f"kernel_backend: {name} is installed but does not import ({e}); Triton runs"
        warnings.warn(msg, stacklevel=2)
        return False
    return True


@dataclass(frozen=True)
class Plan:
    scores: str  # "triton" | "deep_gemm"
    topk: str  # "triton" | "flashinfer"


def _auto(half: str, batch: int) -> str:
    out = "triton"
    for min_batch, name in AUTO_TABLE[half]:
        if batch >= min_batch:
            out = name
    return out


def plan(backend: str, batch: int, device: torch.device | str) -> Plan:
    """The backends of the two halves for a decode batch of ``batch`` rows (index heads are
    checked at the call: ``indexer_select``)."""
    check_backend(backend)
    scores = {"auto": _auto("scores", batch), "deep_gemm": "deep_gemm"}.get(backend, "triton")
    topk = {"auto": _auto("topk", batch), "flashinfer": "flashinfer"}.get(backend, "triton")
    cuda = torch.device(device).type == "cuda"
    if scores == "deep_gemm" and not (cuda and installed("deep_gemm")):
        scores = "triton"
    if topk == "flashinfer" and not (cuda and installed("flashinfer")):
        topk = "triton"
    return Plan(scores, topk)


def plans_for(backend: str, max_batch: int, device: torch.device | str) -> tuple[Plan, ...]:
    """``plan`` of every batch size 1..max_batch, decided once when the cache is built (the
    traced step then only picks from a tuple, plan_of: no import machinery under torch.compile)."""
    return tuple(plan(backend, b, device) for b in range(1, max_batch + 1))


def plan_runs(plans: tuple[Plan, ...]) -> tuple[tuple[int, Plan], ...]:
    """``plans_for``'s tuple as its runs of equal plans: (the run's first batch size, its plan),
    in order (one run on CPU or with ``triton``, two or three with ``auto``)."""
    return tuple((b, p) for b, p in enumerate(plans, 1) if b == 1 or p != plans[b - 2])


def plan_of(runs: tuple[tuple[int, Plan], ...], batch) -> Plan:
    """The plan of ``batch`` rows (``plans[min(batch, len(plans)) - 1]``) from ``plan_runs``,
    found by comparing ``batch`` with each run's first size, never by indexing with it.

    NOTE: the same plan for static shapes. Under a symbolic batch (a decode step compiled with a
    dynamic batch dimension, benchmarks/bench_dynamic_decode.py) an index guards the size itself,
    ``B == k``: a graph per size; a comparison guards a range, and plans that are all equal (CPU,
    ``triton``) guard nothing."""
    out = runs[0][1]
    for first, p in runs[1:]:
        if batch >= first:
            out = p
    return out


def indexer_select(
    p: Plan,
    q_fp8: torch.Tensor,  # [B, Hi, 128] uint8
    weights: torch.Tensor,  # [B, Hi] fp32
    index_cache: torch.Tensor,  # [pages, 8448] uint8
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    topk: int,
    schedule: torch.Tensor | None,  # DeepGEMM's schedule of this step (when p.scores uses it)
    row_states: torch.Tensor | None,  # FlashInfer's scratch (when p.topk uses it)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``echo::indexer_topk``'s result, (host slots [B, topk], kth [B]), by plan ``p``."""
    scores_by = p.scores
    if scores_by == "deep_gemm" and q_fp8.shape[1] not in HEADS:  # a static shape: no sync
        scores_by = "triton"
    if scores_by == "triton" and p.topk == "triton":
        return indexer_topk(q_fp8, weights, index_cache, block_table, seq_lens, topk)
    if scores_by == "deep_gemm":
        if schedule is None:
            raise ValueError("kernel_backend: DeepGEMM scores need the cache's schedule buffer")
        width = logits_width(block_table.shape[1] * PAGE)
        scores = dg_paged_mqa_logits(
            q_fp8, weights, index_cache, block_table, seq_lens, schedule, width
        )
    else:
        scores = index_scores(q_fp8, weights, index_cache, block_table, seq_lens)
    if p.topk == "flashinfer":
        if row_states is None:
            raise ValueError("kernel_backend: FlashInfer top-k needs the cache's row_states buffer")
        return fi_topk(scores, block_table, seq_lens, topk, row_states)
    return topk_from_scores(scores, block_table, seq_lens, topk)


def prefill_plan(
    backend: str, device: torch.device | str, index_heads: int | None
) -> tuple[tuple[int, str], ...]:
    """Prefill's scores backend as rows ``(min chunk tokens, "triton" | "deep_gemm")``, with every
    fallback applied (DeepGEMM missing, not CUDA, a head count it does not take), decided once
    when the cache is built; ``prefill_logits_backend`` reads it at trace time."""
    check_backend(backend)
    rows = {"auto": PREFILL_AUTO_TABLE, "deep_gemm": ((1, "deep_gemm"),)}.get(
        backend, ((1, "triton"),)
    )
    ok = (
        torch.device(device).type == "cuda"
        and (index_heads is None or index_heads in HEADS)
        and installed("deep_gemm")
    )
    return tuple((m, name if ok else "triton") for m, name in rows)


def prefill_logits_backend(rows: tuple[tuple[int, str], ...], tokens: int, heads: int) -> str:
    """The ``logits_backend`` of ``echo::prefill_indexer_topk`` for a chunk of ``tokens`` queries
    with ``heads`` index heads (static shapes: a constant of the traced chunk)."""
    out = "triton"
    for min_tokens, name in rows:
        if tokens >= min_tokens:
            out = name
    return "triton" if out == "deep_gemm" and heads not in HEADS else out
