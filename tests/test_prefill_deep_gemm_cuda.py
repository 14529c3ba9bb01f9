"""On the GPU, DeepGEMM's ``fp8_mqa_logits`` as the backend of prefill's indexer scores
(custom_ops/backends/deep_gemm_prefill*.py): its scores against ``prefill_index_logits_ref``
(decode's DeepGEMM bound: 2^-10 of each score's term magnitude) with -inf exactly past each
position, ``echo::prefill_indexer_topk`` with it selecting the reference's set (exactly on
well-separated scores, up to near-ties on random ones), and a compiled engine whose prefill runs
it: offloading vs GPU-only bit for bit, the graph gates, no recompile after warm-up.

Skipped only when deep_gemm is not installed (the optional [kernels] extra, or the wheels carried
as the README says); it JIT-compiles on first use (``python -m benchmarks.bench_prefill`` warms
the same cache)."""

from __future__ import annotations

import pytest
import torch

from custom_ops import prefill as pf
from custom_ops import prefill_kernels as pk
from custom_ops.backends.deep_gemm_ops import prefill_logits_width
from custom_ops.kv_format import INDEX_DIM, INDEX_PAGE_BYTES, PAGE
from tests.test_backends_cuda import _tiny64, need
from tests.test_prefill_ops import check_selection_near_ties, magnitudes, make_prefill_inputs

pytestmark = pytest.mark.cuda
DEV = "cuda"
DG_REL = 2**-10  # decode's DeepGEMM bound (tests/test_backends_cuda.py)


@pytest.mark.parametrize(
    "P, heads, T, start, pad",
    [(64, 64, 512, 3000, 7), (33, 32, 300, 1800, 0), (4, 64, 37, 0, 5)],
)
def test_deep_gemm_prefill_logits_vs_reference(P, heads, T, start, pad):
    need("deep_gemm")
    gen = torch.Generator(device=DEV).manual_seed(P + heads)
    inp = make_prefill_inputs(P, heads, T, start, pad, gen)
    got = torch.ops.echo.dg_prefill_logits(*inp.values())
    L = P * PAGE
    assert got.shape == (T, prefill_logits_width(L)) and got.is_contiguous()
    ref = pf.prefill_index_logits_ref(**inp)
    dead = torch.isinf(ref)
    assert torch.equal(torch.isinf(got[:, :L]), dead)  # -inf exactly at t > p
    assert bool((got[:, :L][dead] == float("-inf")).all())
    assert bool((got[:, L:] == float("-inf")).all())
    err = ((got[:, :L] - ref).abs() / magnitudes(inp).clamp(min=1e-30))[~dead]
    assert err.numel() == int((inp["positions"] + 1).clamp(max=L).sum())
    assert float(err.max()) <= DG_REL
    again = torch.ops.echo.dg_prefill_logits(*inp.values())
    assert torch.equal(got, again)  # deterministic


def _separated_inputs(P: int, T: int, start: int, gen: torch.Generator) -> dict:
    """Every key 1.0 in every dimension, each token its own integer scale: score[q, t] is
    c_q * scale[t] with c_q > 0 the same for every token, so the order of a row is that of the
    scales (distinct integers up to 4288: gaps of 2^-12 relative, far above any rounding)."""
    n_pages = P + 3  # as make_prefill_inputs: its block table indexes pages 0 .. P + 2
    cache = torch.zeros(n_pages, INDEX_PAGE_BYTES, dtype=torch.uint8, device=DEV)
    one = torch.ones((), dtype=torch.float8_e4m3fn).view(torch.uint8).item()
    cache[:, : PAGE * INDEX_DIM] = one
    scales = torch.randperm(n_pages * PAGE, generator=gen, device=DEV).float() + 1
    cache[:, PAGE * INDEX_DIM :] = scales.view(n_pages, PAGE).contiguous().view(torch.uint8)
    inp = make_prefill_inputs(P, 64, T, start, 3, gen)
    # positive head weights: c_q > 0 whatever the rounding (a sign flip would reverse the order)
    return inp | {"index_cache": cache, "weights": inp["weights"].abs()}


def test_prefill_indexer_topk_with_deep_gemm_selects_the_reference_set():
    need("deep_gemm")
    gen = torch.Generator(device=DEV).manual_seed(3)
    cfg = pk.PrefillIndexerConfig(score_elems=128 * 4096)  # several query blocks
    sep = _separated_inputs(64, 512, 3000, gen)
    want = pf.prefill_indexer_topk_ref(**sep, topk=2048)
    for backend in ("deep_gemm", "triton"):
        got = pk.prefill_indexer_topk_cuda(**sep, topk=2048, cfg=cfg, logits_backend=backend)
        assert torch.equal(got, want), backend
    op = torch.ops.echo.prefill_indexer_topk(*sep.values(), 2048, logits_backend="deep_gemm")
    assert torch.equal(op, want)
    # random scores: the sets part only at near-ties of the k-th score (DeepGEMM's rounding)
    inp = make_prefill_inputs(64, 64, 512, 3000, 7, gen)
    got = pk.prefill_indexer_topk_cuda(**inp, topk=2048, cfg=cfg, logits_backend="deep_gemm")
    want = pf.prefill_indexer_topk_ref(**inp, topk=2048)
    ref = pf.prefill_index_logits_ref(**inp)
    check_selection_near_ties(got, want, ref, magnitudes(inp), DG_REL)


def test_compiled_prefill_with_deep_gemm_lossless_and_gates(monkeypatch):
    need("deep_gemm")
    import torch._dynamo
    import torch._inductor.config as ic
    from test_compile import drive, make_engine
    from torch._dynamo.utils import ReinplaceCounters, counters

    calls = []
    real = pk.prefill_scores
    monkeypatch.setattr(pk, "prefill_scores", lambda *a: calls.append(1) or real(*a))
    tiny = _tiny64()
    logs = {}
    old = ic.fx_graph_cache
    ic.fx_graph_cache = False  # ReinplaceCounters are only filled on a cache miss
    try:
        for offload in (True, False):
            torch._dynamo.reset()
            counters.clear()
            ReinplaceCounters.clear()
            eng = make_engine(tiny, offload, compiled=True, strict=True, compile_prefill=True,
                              kernel_backend="deep_gemm")  # fmt: skip
            assert [k for k, _, _ in eng.runner.compiled] == ["decode", "prefill"]
            assert all(p == ((1, "deep_gemm"),) for p in (x.prefill_plan for x in eng.cache.layers))
            eng.runner.warmup(calls=3, progress=False)
            assert calls  # the warm-up's prefill ran DeepGEMM's scores
            with torch.compiler.set_stance("fail_on_recompile"):
                logs[offload] = drive(eng)
            assert counters["inductor"]["cudagraph_skips"] == 0
            assert counters["inductor"].get("cudagraph_partitions", 0) == 0
            assert dict(counters["graph_break"]) == {}
            assert ReinplaceCounters.get_total_missed() == 0
            del eng
    finally:
        ic.fx_graph_cache = old
    on, off = logs[True], logs[False]
    assert len(on) == len(off) >= 12
    for a, b in zip(on, off):
        assert torch.equal(a, b)  # lossless with DeepGEMM's prefill scores
