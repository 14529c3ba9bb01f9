"""DeepGEMM as the backend of prefill's indexer scores (custom_ops/backends/deep_gemm_prefill*.py),
on CPU: the op's reference, fake and opcheck; the gather into DeepGEMM's layout and the causal
clean-up (Triton kernels under the interpreter); the DeepGEMM path of ``echo::prefill_indexer_topk``
against the reference with a stand-in library that keeps the contract read in the wheel; the
backend choice and its fallbacks; the model passing the choice to the op, traced fullgraph.
The library itself on the GPU: tests/test_prefill_deep_gemm_cuda.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from custom_ops import prefill as pf
from custom_ops import prefill_kernels as pk
from custom_ops.backends import deep_gemm_prefill as dgp
from custom_ops.backends import deep_gemm_prefill_kernels as dpk
from custom_ops.backends import select as sel
from custom_ops.kv_format import PAGE, index_cache_gather
from tests.test_prefill_ops import SMALL, make_prefill_inputs


@pytest.fixture(scope="module")
def tiny():
    from model.checkpoint import resolve_model
    from model.loader import load_model
    from runtime.tokenizer import Tokenizer

    path = resolve_model("tiny")
    return load_model(path)[0], Tokenizer.from_dir(path)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_width_and_reference_and_opcheck():
    widths = [dgp.prefill_logits_width(n) for n in (64, 256, 320, 100_032)]
    assert widths == [256, 256, 512, 100_096]
    inp = make_prefill_inputs(5, 32, 24, 150, 3, _gen(1))
    out = torch.ops.echo.dg_prefill_logits(*inp.values())
    ref = pf.prefill_index_logits_ref(**inp)
    L = 5 * PAGE
    assert out.shape == (24, 512) and torch.equal(out[:, :L], ref)
    assert bool((out[:, L:] == float("-inf")).all())
    torch.library.opcheck(torch.ops.echo.dg_prefill_logits, tuple(inp.values()))
    bad = dict(inp, positions=inp["positions"].int())
    with pytest.raises(ValueError, match="positions"):
        torch.ops.echo.dg_prefill_logits(*bad.values())


def test_gather_index_keys_equals_index_cache_gather():
    inp = make_prefill_inputs(7, 4, 2, 0, 0, _gen(2))
    cache, bt = inp["index_cache"], inp["block_table"]
    t = torch.arange(7 * PAGE)
    k, s = index_cache_gather(cache, bt[0, t // PAGE].long() * PAGE + t % PAGE)
    for vals, scales in (dgp.gather_index_keys_ref(cache, bt), dpk.gather_index_keys(cache, bt)):
        assert vals.shape == (7 * PAGE, 128) and vals.dtype == torch.uint8 and vals.is_contiguous()
        assert torch.equal(vals.view(torch.float8_e4m3fn).float(), k)
        assert scales.is_contiguous() and torch.equal(scales, s)


def test_query_rows_fill_whole_waves():
    budget = 1 << 25
    # at 100K, 64 heads, 132 SMs: 264 rows (one wave of 2-query blocks), not score_rows' 320
    assert dpk.query_rows(100_096, 2048, budget, 64, 132) == 264
    assert pk.score_rows(100_096, 2048, budget) == 320
    assert dpk.query_rows(32_768, 2048, budget, 64, 132) == 1024 - 1024 % 264  # 792: 3 waves
    assert dpk.query_rows(32_768, 100, budget, 32, 132) == 100  # a short chunk: all of it
    # one wave over the budget (a 200K context): the Triton path's rule
    assert dpk.query_rows(200_192, 2048, budget, 64, 132) == pk.score_rows(200_192, 2048, budget)


def test_causal_clean_kernel():
    Q, W = 5, 2304  # three clean-up blocks per row
    s = torch.randn(Q, W, generator=_gen(3))
    pos = torch.tensor([0, 1023, 1024, 2303, 1500])
    want = torch.where(torch.arange(W)[None] > pos[:, None], float("-inf"), s)
    assert torch.equal(dpk.causal_clean(s.clone(), pos), want)


class FakeDeepGemm:
    """``fp8_mqa_logits`` as read in the 0.1.5.post1 wheel, in torch: its asserts on the inputs,
    the compressed output (row stride ``max_seqlen_k``, rows padded to the query block), and only
    [ks, ke) of each row written (NaN elsewhere, where the library leaves memory unwritten)."""

    calls = 0

    def get_num_sms(self) -> int:
        return 2

    def fp8_mqa_logits(self, q, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0):
        kv_data, kv_sf = kv
        Q, H, D = q.shape
        assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and H in (32, 64)
        assert kv_data.dtype == torch.float8_e4m3fn and kv_data.is_contiguous()
        assert kv_data.shape[1] == D and kv_sf.shape == (kv_data.shape[0],)
        assert kv_sf.dtype == torch.float32 and kv_sf.is_contiguous()
        assert weights.shape == (Q, H) and weights.stride(1) == 1
        for x in (ks, ke):
            assert x.dtype == torch.int32 and x.shape == (Q,) and x.is_contiguous()
        assert max_seqlen_k % 256 == 0 and max_seqlen_k > 0 and not clean_logits
        FakeDeepGemm.calls += 1
        logits = torch.einsum("qhd,td->qht", q.float(), kv_data.float()).relu()
        score = (logits * weights[:, :, None]).sum(1) * kv_sf  # [Q, L]
        block_q = 128 // H
        base = torch.full((-(-Q // block_q) * block_q, max_seqlen_k), float("nan"))
        t = torch.arange(kv_data.shape[0])
        live = (t[None] >= ks[:, None]) & (t[None] < ke[:, None])
        base[:Q, : kv_data.shape[0]] = torch.where(live, score, float("nan"))
        return base[:Q, :max_seqlen_k]


def test_deep_gemm_path_with_a_stand_in_library(monkeypatch):
    """The op's CUDA path run on CPU tensors (interpreter) against a stand-in library: scores
    equal to the reference (fp32 rounding aside) with -inf past p, and the whole indexer selecting
    the reference's set, in query blocks, from unclean scores."""
    monkeypatch.setattr(dpk, "_lib", lambda: FakeDeepGemm())
    inp = make_prefill_inputs(5, 32, 40, 150, 7, _gen(4))
    kv, sf = dpk.gather_index_keys(inp["index_cache"], inp["block_table"])
    got = dpk.prefill_scores(inp["q_fp8"], inp["weights"], kv, sf, inp["positions"], 512, True)
    want = dgp.dg_prefill_logits_ref(**inp)
    assert got.shape == (40, 512) and got.is_contiguous()
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # -inf exactly past each position
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    FakeDeepGemm.calls = 0
    topk = 32
    # query blocks that fill whole waves: 2 SMs x 128 / 32 = 8 rows, 16 within the budget
    assert dpk.query_rows(512, 32, 16 * 512, 32, 2) == 16
    two = dataclasses.replace(SMALL, score_elems=16 * 512)  # two query blocks of 16 rows
    sub = {k: v[:32] if k in ("q_fp8", "weights", "positions") else v for k, v in inp.items()}
    out = pk.prefill_indexer_topk_cuda(**sub, topk=topk, cfg=two, logits_backend="deep_gemm")
    assert FakeDeepGemm.calls == 2
    assert torch.equal(out, pf.prefill_indexer_topk_ref(**sub, topk=topk))
    # 4 index heads: DeepGEMM does not take them, the Triton logits run (the library never asked)
    small = make_prefill_inputs(2, 4, 16, 60, 2, _gen(5))
    FakeDeepGemm.calls = 0
    out = pk.prefill_indexer_topk_cuda(**small, topk=topk, cfg=SMALL, logits_backend="deep_gemm")
    assert FakeDeepGemm.calls == 0
    assert torch.equal(out, pf.prefill_indexer_topk_ref(**small, topk=topk))


def test_prefill_indexer_topk_backend_argument():
    inp = make_prefill_inputs(3, 32, 10, 100, 2, _gen(6))
    want = pf.prefill_indexer_topk_ref(**inp, topk=16)
    for b in pf.LOGITS_BACKENDS:  # the CPU kernel is the reference for either
        assert torch.equal(
            torch.ops.echo.prefill_indexer_topk(*inp.values(), 16, logits_backend=b), want
        )
    torch.library.opcheck(
        torch.ops.echo.prefill_indexer_topk, (*inp.values(), 16), {"logits_backend": "deep_gemm"}
    )
    with pytest.raises(ValueError, match="logits_backend"):
        torch.ops.echo.prefill_indexer_topk(*inp.values(), 16, logits_backend="flashinfer")


def test_prefill_plan_choice_and_fallbacks(monkeypatch):
    cuda = torch.device("cuda")
    # on CPU, or with DeepGEMM missing, every backend gives Triton scores
    for b in sel.BACKENDS:
        assert {name for _, name in sel.prefill_plan(b, "cpu", 64)} == {"triton"}, b
    monkeypatch.setattr(sel, "installed", lambda lib: False)
    assert sel.prefill_plan("deep_gemm", cuda, 64) == ((1, "triton"),)
    monkeypatch.setattr(sel, "installed", lambda lib: True)
    assert sel.prefill_plan("deep_gemm", cuda, 64) == ((1, "deep_gemm"),)
    assert sel.prefill_plan("deep_gemm", cuda, 4) == ((1, "triton"),)  # the tiny model's heads
    for b in ("triton", "flashinfer"):
        assert sel.prefill_plan(b, cuda, 64) == ((1, "triton"),)
    # heads unknown when the cache is built: the plan says DeepGEMM, the call's shape decides
    rows = sel.prefill_plan("deep_gemm", cuda, None)
    assert sel.prefill_logits_backend(rows, 2048, 64) == "deep_gemm"
    assert sel.prefill_logits_backend(rows, 2048, 4) == "triton"
    # auto reads its table by chunk tokens
    assert sel.prefill_plan("auto", cuda, 64) == sel.PREFILL_AUTO_TABLE
    monkeypatch.setattr(sel, "PREFILL_AUTO_TABLE", ((1, "triton"), (1024, "deep_gemm")))
    rows = sel.prefill_plan("auto", cuda, 64)
    assert [sel.prefill_logits_backend(rows, t, 64) for t in (64, 1023, 1024, 2048)] == [
        "triton", "triton", "deep_gemm", "deep_gemm"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="kernel_backend"):
        sel.prefill_plan("cublas", cuda, 64)


def test_tiny_engine_cache_plans_triton_prefill(tiny):
    from test_compile import make_engine

    eng = make_engine(tiny, offload=True, kernel_backend="deep_gemm")
    assert eng.cache.config.index_heads == 4
    assert all(layer.prefill_plan == ((1, "triton"),) for layer in eng.cache.layers)


def test_model_passes_the_backend_and_traces_fullgraph(tiny, monkeypatch):
    """A cache whose plan says DeepGEMM: every layer's prefill asks its plan with the chunk's
    shape, and the prefill step traces fullgraph with ``logits_backend="deep_gemm"`` in the op
    (the assertion with teeth on CPU). The logits equal the Triton plan's, which on CPU only
    shows the argument changes nothing else: both plans run the reference kernel here."""
    from test_compile import drive, make_engine

    base = drive(make_engine(tiny, offload=True, kernel_backend="triton"), steps=3)
    monkeypatch.setattr(sel, "prefill_plan", lambda b, d, h: ((1, "deep_gemm"),))
    monkeypatch.setattr(sel, "HEADS", (tiny[0].config.index_n_heads,))
    asked = []
    real = sel.prefill_logits_backend
    monkeypatch.setattr(
        sel, "prefill_logits_backend", lambda r, t, h: asked.append((t, h)) or real(r, t, h)
    )
    eng = make_engine(tiny, offload=True, kernel_backend="deep_gemm")
    got = drive(eng, steps=3)
    assert len(got) == len(base) >= 3
    assert all(torch.equal(a, b) for a, b in zip(got, base))
    n_layers = len(eng.cache.layers)
    assert asked and len(asked) % n_layers == 0 and all(h == 4 for _, h in asked)

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(eng.runner.prefill_step, backend=record, fullgraph=True)
    with torch.no_grad():
        step(*eng.runner.padding_inputs(False, 64))
    torch._dynamo.reset()
    op = torch.ops.echo.prefill_indexer_topk
    calls = [n for g in graphs for n in g.graph.nodes if n.target in (op, op.default)]
    assert len(calls) == n_layers
    assert all(n.kwargs.get("logits_backend") == "deep_gemm" for n in calls), calls


def test_bench_prefill_deep_gemm_timings_code_path(monkeypatch):
    """bench_prefill's DeepGEMM side-by-side at a toy size on CPU (the stand-in library, one
    untimed call instead of CUDA-graph replays): every column filled, the selections compared."""
    import argparse

    from benchmarks import bench_prefill as bp
    from benchmarks.cuda_timer import GraphTiming

    def once(calls, **kw):
        calls[0]()
        return GraphTiming([1.0], 1)

    monkeypatch.setattr(dpk, "_lib", lambda: FakeDeepGemm())
    monkeypatch.setattr(bp, "graph_time", once)
    a = argparse.Namespace(chunk=16, index_topk=8, dg_reps=1)
    row: dict = {}
    cfg = pk.PrefillIndexerConfig(block_q=16, block_t=64, select=SMALL.select)  # one query block
    faster = bp._dg_times(row, a, 128, cfg, "cpu")
    assert faster is False  # equal stand-in times: not faster
    for name in ("logits_triton", "logits_deep_gemm", "logits_deep_gemm_clean",
                 "indexer_topk_triton", "indexer_topk_deep_gemm"):  # fmt: skip
        assert row[name + "_ms"] == 1e-3 and row[name + "_tflop_s"] > 0
    assert row["width"] == 256 and row["rows_identical_triton_vs_deep_gemm"] == 1.0
