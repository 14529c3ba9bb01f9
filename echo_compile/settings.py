"""Every torch.compile / Dynamo / Inductor setting echo-compile uses, in one place.

Why each one (docs/graph_notes.md, settings, gives the background):
- ``recompile_limit``: one static graph per decode bucket and per prefill bucket; the default of 8
  would turn the 9th bucket into a hard failure under fullgraph=True.
- ``cudagraph_or_error`` (strict mode, tests): a cudagraph skip raises instead of silently running
  eagerly; ``graph_partition`` is left at its default, and tests assert zero partitions instead.
- ``fx_graph_cache`` off in strict mode: ReinplaceCounters are only filled on a cache miss.
- ``emulate_precision_casts``: Inductor rounds every intermediate to bf16 where eager does, instead
  of keeping fused intermediates in fp32. With it the compiled decode step equals eager bit for bit
  on most steps (an fp32 reduction-order ulp still flips a bf16 rounding now and then,
  docs/compile.md); without it the logits drift by ~1e-2, which flips near-ties at the indexer's
  top-k boundary.
- ``deterministic``: Inductor picks its reduction configs without timing them on the device. With
  timing, two compiles of the same step can pick differently split reductions (another summation
  order): on the H200 two compiled offloading engines run one after the other on the same fp8
  workload gave different logits in 88 of 130 steps from the first prefill chunk on
  (benchmarks/results/gpu_session4_h200.log), so neither offload-vs-GPU-only nor run-to-run results
  could be bit-identical. Inductor warns of a speed cost; it has not been measured here yet.
- ``deterministic_algorithms()`` around every compiled step call (and so around its compile, which
  happens in the first call): Inductor's ``deterministic`` flag alone did not make the compiled
  engine reproducible on the H200 (two fresh processes on the 8-prompt workload of
  tests/test_lossless_cuda.py: 15-24 of 130 steps differ, and 88 without CUDA graphs; eager runs
  identical), while with ``torch.use_deterministic_algorithms`` also on, Inductor filters its
  kernel choices further and empty buffers are filled: both runs identical, and bf16 offload ==
  GPU-only on all 130 steps (``python -m benchmarks.diag_repro``; benchmarks/results/
  gpu_session5_h200.log). It is process-global torch state, so it is switched on only for the
  duration of our own calls and restored after; ``warn_only`` so that an op without a
  deterministic kernel warns instead of failing a step.
- ``FILL_UNINITIALIZED`` (False): deterministic mode also fills every ``torch.empty`` with NaN /
  the integer maximum (``torch.utils.deterministic.fill_uninitialized_memory``), and inside a CUDA
  graph those fills replay every step (their cost: docs/quantization.md, "Where the FP8 step's
  time goes"). The bit-equality tests passed with the NaN fill on (a read of unwritten floats
  reaching the logits would have made them NaN, and NaN never equals) and pass with it off
  (docs/graph_notes.md, "Settings"), so it is off for our scope; True restores torch's default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.utils.deterministic

FILL_UNINITIALIZED = False


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` and
    ``fill_uninitialized_memory = FILL_UNINITIALIZED`` for the ``with`` body only."""
    was, warn = (
        torch.are_deterministic_algorithms_enabled(),
        (torch.is_deterministic_algorithms_warn_only_enabled()),
    )
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = FILL_UNINITIALIZED
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def compile_mode(device: torch.device) -> str | None:
    """reduce-overhead (CUDA graphs) on CUDA; Inductor's default on CPU (no graphs there)."""
    return "reduce-overhead" if device.type == "cuda" else None


def apply(num_graphs: int, strict: bool = False) -> None:
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, num_graphs + 4)
    dynamo_config.accumulated_recompile_limit = max(
        dynamo_config.accumulated_recompile_limit, 4 * (num_graphs + 4)
    )
    inductor_config.emulate_precision_casts = True
    inductor_config.deterministic = True
    if strict:
        inductor_config.triton.cudagraph_or_error = True
        inductor_config.fx_graph_cache = False
