"""Kernel-library backends (custom_ops/backends/) on CPU: the DeepGEMM layout arithmetic, the tie
fix-up against the stable-sort definition with many ties, the fix-up's Triton kernels under the
interpreter, the backend choice and its fallbacks, and the engine driving every backend's op chain
(their reference kernels) to the same logits as the Triton path. The libraries themselves run
only on the GPU: tests/test_backends_cuda.py."""

from __future__ import annotations

import pytest
import torch

from custom_ops.backends import select as sel
from custom_ops.backends import ties, ties_kernels
from custom_ops.backends.deep_gemm_ops import fused_kv_view, logits_width, scores_ref
from custom_ops.backends.flashinfer_ops import ROW_STATES_BYTES
from custom_ops.indexer import indexer_topk_ref
from custom_ops.kv_format import INDEX_DIM, INDEX_PAGE_BYTES, PAGE, index_cache_gather
from tests.test_decode_kernels import _gen, _tie_scores, make_indexer_inputs


@pytest.fixture(scope="module")
def tiny():
    from model.checkpoint import resolve_model
    from model.loader import load_model
    from runtime.tokenizer import Tokenizer

    path = resolve_model("tiny")
    return load_model(path)[0], Tokenizer.from_dir(path)


def test_index_cache_page_is_deep_gemm_fused_layout():
    """Our page (64 x 128 e4m3 values, then 64 fp32 scales = 8448 B) viewed as DeepGEMM's fused
    [blocks, 64, 1, 132]: no copy, the strides DeepGEMM asserts (stride(1) = 132, stride(3) = 1,
    block stride a multiple of 4), and DeepGEMM's derivation of its value and scale tensors
    (values: [blocks, 64, 128] strides (block, 128, 1) from the start; scales: [blocks, 64] fp32
    from byte 64 x 128 of each block) reads exactly our keys and scales."""
    assert INDEX_PAGE_BYTES == PAGE * (INDEX_DIM + 4) == 8448
    cache = make_indexer_inputs(2, 3, 4, [100, 150], _gen(1))["index_cache"]  # [9, 8448]
    fused = fused_kv_view(cache)
    assert fused.shape == (cache.shape[0], 64, 1, 132)
    assert fused.data_ptr() == cache.data_ptr()  # a view: nothing copied
    assert fused.stride() == (8448, 132, 132, 1) and fused.stride(0) % 4 == 0
    block_bytes = fused.stride(0)
    flat = cache.view(-1)
    values = flat.as_strided((cache.shape[0], 64, 128), (block_bytes, 128, 1))
    scales = flat[64 * 128 :].view(torch.float32)  # from the first block's scale bytes on
    scales = scales.as_strided((cache.shape[0], 64), (block_bytes // 4, 1))
    slots = torch.arange(cache.shape[0] * PAGE)
    k, k_scale = index_cache_gather(cache, slots)
    assert torch.equal(values.reshape(-1, 128).view(torch.float8_e4m3fn).float(), k)
    assert torch.equal(scales.reshape(-1), k_scale)


def test_logits_width_is_aligned_and_covers():
    for L in (64, 1024, 1088, 100_032):
        w = logits_width(L)
        assert w >= L and w % 1024 == 0 and w - L < 1024


def _kth_from_any_topk(s: torch.Tensor, seq_lens: torch.Tensor, topk: int, seed: int):
    """kth as a library with arbitrary tie-breaking would give it: a top-k of a random
    permutation of each row's live scores, its lowest value."""
    g = torch.Generator().manual_seed(seed)
    B, W = s.shape
    live = torch.arange(W)[None, :] < seq_lens[:, None].long()
    s = torch.where(live, s, float("-inf"))
    perm = torch.stack([torch.randperm(W, generator=g) for _ in range(B)])
    raw = perm.gather(1, torch.topk(s.gather(1, perm), min(topk, W), dim=1).indices)
    raw = torch.where(torch.arange(raw.shape[1])[None, :] < seq_lens[:, None].long(), raw, -1)
    return ties.kth_from_indices_ref(s, raw.int()), raw.int()


@pytest.mark.parametrize("kind", ["ties", "equal", "scores", "near"])
def test_threshold_fixup_selects_the_stable_sort_set(kind):
    """Whatever ties a library breaks, its k-th value plus the fix-up gives the stable-sort set."""
    B, P, topk = 5, 4, 48
    W = P * PAGE + 64  # wider than the block table, as DeepGEMM's padded rows
    lens = torch.tensor([0, 30, 48, 200, P * PAGE], dtype=torch.int32)
    bt = torch.randperm(40, generator=_gen(2))[: B * P].view(B, P).int()
    if kind == "scores":
        inp = make_indexer_inputs(B, P, 8, lens.tolist(), _gen(3))
        bt = inp["block_table"]
        s = scores_ref(*(inp[k] for k in ("q_fp8", "weights", "index_cache")), bt, lens, W)
        s = s.relu()  # many exact zeros, as after the ReLU of a layer with positive weights
    else:
        s = _tie_scores(B, W, _gen(4), kind)
    want_host, want_kth = ties.stable_select_ref(s, bt, lens, topk)
    assert (want_host[3] >= 0).sum() == topk and (want_host[0] == -1).all()
    kth, _ = _kth_from_any_topk(s, lens, topk, seed=5)
    assert torch.equal(kth, want_kth)
    assert torch.equal(ties.threshold_select_ref(s, bt, lens, kth, topk), want_host)
    # the Triton fix-up (interpreter on CPU), with small blocks: a row spans several chunks
    cfg = ties_kernels.FixupConfig(block=64, chunk=128)
    got = ties_kernels.threshold_select(s.contiguous(), bt, lens, kth, topk, cfg)
    assert torch.equal(got, want_host)


def test_fixup_kernels_vs_reference_with_a_wrong_tie_choice():
    """kth_from_indices on positions with -1 padding and an empty row; and a library set that took
    the LATER ties is corrected to the earlier ones."""
    s = torch.tensor([[1.0, 0.0, 0.0, 2.0, 0.0, 0.0] + [-1.0] * 58, [0.5] * 64, [3.0] * 64])
    lens = torch.tensor([6, 64, 0], dtype=torch.int32)
    bt = torch.tensor([[2], [0], [1]], dtype=torch.int32)
    raw = torch.tensor([[3, 0, 5], [63, 62, 61], [-1, -1, -1]], dtype=torch.int32)  # late ties
    kth = ties_kernels.kth_from_indices(s, raw)
    assert torch.equal(kth, ties.kth_from_indices_ref(s, raw))
    assert kth.tolist() == [0.0, 0.5, float("-inf")]
    host = ties_kernels.threshold_select(s, bt, lens, kth, 3, ties_kernels.FixupConfig(block=64))
    assert host.tolist() == [[128, 129, 131], [0, 1, 2], [-1, -1, -1]]  # earliest ties, ascending
    assert torch.equal(host, ties.stable_select_ref(s, bt, lens, 3)[0])


def test_fixup_pads_with_minus_one_when_kth_is_not_a_live_score():
    """A k-th value that is not among the live scores (a NaN among a library's k positions):
    fewer than k are selected, and every other entry is -1, as the reference's (deterministic
    mode fills fresh memory, so an unwritten entry would show)."""
    from echo_compile import settings

    s = torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0] + [-1.0] * 59, [0.5] * 64])
    lens = torch.tensor([5, 64], dtype=torch.int32)
    bt = torch.tensor([[1], [0]], dtype=torch.int32)
    kth = torch.tensor([3.5, 0.5])  # row 0: 2 scores above it, none equal; row 1: a real k-th
    want = ties.threshold_select_ref(s, bt, lens, kth, 4)
    assert want.tolist() == [[64, 66, -1, -1], [0, 1, 2, 3]]
    with settings.deterministic_algorithms():
        got = ties_kernels.threshold_select(s, bt, lens, kth, 4, ties_kernels.FixupConfig(block=64))
    assert torch.equal(got, want)


def test_split_references_equal_the_fused_reference():
    inp = make_indexer_inputs(3, 4, 8, [0, 90, 256], _gen(6))
    want = indexer_topk_ref(**inp, topk=40)
    args = [inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]
    s = torch.ops.echo.index_scores(*args)
    assert torch.equal(torch.ops.echo.topk_from_scores(s, args[3], args[4], 40)[0], want[0])
    sched = torch.zeros(133, 2, dtype=torch.int32)
    wide = torch.ops.echo.dg_paged_mqa_logits(*args, sched, logits_width(256))
    states = torch.zeros(ROW_STATES_BYTES, dtype=torch.uint8)
    host, kth = torch.ops.echo.fi_topk(wide, args[3], args[4], 40, states)
    assert torch.equal(host, want[0]) and torch.equal(kth, want[1])
    with pytest.raises(ValueError, match="width"):
        torch.ops.echo.dg_paged_mqa_logits(*args, sched, 100)
    with pytest.raises(ValueError, match="row_states"):
        torch.ops.echo.fi_topk(wide, args[3], args[4], 40, states[:10])


def test_ops_opcheck():
    inp = make_indexer_inputs(2, 2, 4, [70, 128], _gen(7))
    args = [inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]
    sched = torch.zeros(133, 2, dtype=torch.int32)
    scores = torch.ops.echo.index_scores(*args)
    states = torch.zeros(ROW_STATES_BYTES, dtype=torch.uint8)
    for op, a in (
        (torch.ops.echo.index_scores.default, tuple(args)),
        (torch.ops.echo.topk_from_scores.default, (scores, args[3], args[4], 16)),
        (torch.ops.echo.dg_paged_mqa_logits.default, (*args, sched, 1024)),
        (torch.ops.echo.dg_paged_mqa_schedule.default, (args[4], sched)),
        (torch.ops.echo.fi_topk.default, (scores, args[3], args[4], 16, states)),
    ):
        torch.library.opcheck(op, a, test_utils=("test_schema", "test_faketensor"))


def test_backend_choice_and_fallbacks(monkeypatch):
    with pytest.raises(ValueError, match="kernel_backend must be one of"):
        sel.plan("cudnn", 4, "cpu")
    for b in sel.BACKENDS:  # CPU: always the Triton op (its reference)
        assert sel.plan(b, 64, "cpu") == sel.Plan("triton", "triton")
    monkeypatch.setattr(sel, "installed", lambda lib: False)
    assert sel.plan("deep_gemm", 64, "cuda") == sel.Plan("triton", "triton")  # not installed
    assert sel.plan("flashinfer", 64, "cuda") == sel.Plan("triton", "triton")
    monkeypatch.setattr(sel, "installed", lambda lib: True)
    assert sel.plan("deep_gemm", 1, "cuda") == sel.Plan("deep_gemm", "triton")
    assert sel.plan("flashinfer", 1, "cuda") == sel.Plan("triton", "flashinfer")
    assert sel.plan("triton", 64, "cuda") == sel.Plan("triton", "triton")
    monkeypatch.setattr(
        sel, "AUTO_TABLE", {"scores": ((1, "deep_gemm"),), "topk": ((8, "flashinfer"),)}
    )
    plans = sel.plans_for("auto", 9, "cuda")
    assert plans[0] == sel.Plan("deep_gemm", "triton") and plans[7] == sel.Plan(
        "deep_gemm", "flashinfer"
    )


def test_engine_config_validates_kernel_backend():
    from custom_ops.cache.config import CacheConfig
    from runtime.engine_config import EngineConfig

    with pytest.raises(ValueError, match="kernel_backend"):
        EngineConfig(kernel_backend="DeepGEMM")
    with pytest.raises(ValueError, match="kernel_backend"):
        CacheConfig(num_layers=1, host_tokens=64, gpu_tokens=64, topk=8, kernel_backend="x")
    cfg = EngineConfig(kernel_backend="auto")
    assert cfg.kernel_backend == "auto"


@pytest.mark.parametrize(
    "plan",
    [
        sel.Plan("deep_gemm", "triton"),
        sel.Plan("triton", "flashinfer"),
        sel.Plan("deep_gemm", "flashinfer"),
    ],
)
def test_engine_runs_each_backend_chain_to_the_same_logits(tiny, monkeypatch, plan):
    """The plumbing: an engine whose cache is forced to a library plan (its ops' CPU kernels are
    the references) decodes the same logits, bit for bit, as the Triton path; DeepGEMM's schedule
    is filled once per step."""
    from test_compile import drive, make_engine

    base = drive(make_engine(tiny, offload=True, kernel_backend="triton"), steps=4)
    monkeypatch.setattr(sel, "plans_for", lambda backend, n, device: (plan,) * n)
    monkeypatch.setattr(sel, "HEADS", (tiny[0].config.index_n_heads,))  # tiny has 4 index heads
    calls = {"schedule": 0, "dg_paged_mqa_logits": 0, "fi_topk": 0}

    def counted(name, fn):
        def call(*a):
            calls[name] += 1
            return fn(*a)

        return call

    monkeypatch.setattr(
        "custom_ops.cache.kv_cache.dg_paged_mqa_schedule",
        counted("schedule", torch.ops.echo.dg_paged_mqa_schedule),
    )
    for name in ("dg_paged_mqa_logits", "fi_topk"):
        monkeypatch.setattr(sel, name, counted(name, getattr(sel, name)))
    eng = make_engine(tiny, offload=True, kernel_backend="auto")
    # the library buffers exist exactly where a plan needs them
    assert (eng.cache.layers[0].fi_row_states is not None) == (plan.topk == "flashinfer")
    assert (eng.cache.layers[0].dg_schedule is not None) == (plan.scores == "deep_gemm")
    got = drive(eng, steps=4)
    assert len(got) == len(base) >= 4
    for a, b in zip(got, base):
        assert torch.equal(a, b)
    n_layers = len(eng.cache.layers)
    dg = plan.scores == "deep_gemm"
    assert calls["schedule"] == (len(got) if dg else 0)  # once per decode step
    assert calls["dg_paged_mqa_logits"] == (len(got) * n_layers if dg else 0)
    assert calls["fi_topk"] == (len(got) * n_layers if plan.topk == "flashinfer" else 0)


def test_compiled_decode_with_library_ops_is_graph_safe(tiny, monkeypatch):
    """The decode step with DeepGEMM scores and FlashInfer top-k (their ops' CPU kernels) compiles
    fullgraph with no node that disables CUDA graphs, every mutated input static (the shared
    schedule and top-k scratch buffers included), no graph break, and Inductor reinplaces every
    mutation (no clone of the shared buffers)."""
    import torch._inductor.config as ic
    from test_compile import drive, make_engine
    from torch._dynamo.utils import ReinplaceCounters, counters

    from echo_compile.graph_lint import LintReport, lint_backend

    plan = sel.Plan("deep_gemm", "flashinfer")
    monkeypatch.setattr(sel, "plans_for", lambda backend, n, device: (plan,) * n)
    monkeypatch.setattr(sel, "HEADS", (tiny[0].config.index_n_heads,))
    eng = make_engine(tiny, offload=True, kernel_backend="auto")
    report = LintReport()
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(eng.runner.decode_step, backend=lint_backend(report), fullgraph=True)
    with torch.no_grad():
        step(*eng.runner.padding_inputs(True, 4))
    assert report.ok, report
    assert dict(counters["graph_break"]) == {}
    torch._dynamo.reset()
    ReinplaceCounters.clear()
    monkeypatch.setattr(ic, "fx_graph_cache", False)  # the counters fill on a cache miss only
    logs = drive(make_engine(tiny, offload=True, compiled=True, kernel_backend="auto"), steps=3)
    assert len(logs) >= 3
    assert dict(counters["graph_break"]) == {}
    assert ReinplaceCounters.get_total_missed() == 0


def test_bench_backends_dry_run(tmp_path):
    """The benchmark's code path at toy sizes on CPU (interpreter, the ops' reference kernels):
    every correctness check recorded and passing, a suggested auto table, the JSON written."""
    import json
    import subprocess
    import sys

    out = tmp_path / "b.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_backends", "--dry-run", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 4 and res["all_pass"] is True
    assert all(r["deep_gemm_scores_ok"] and r["flashinfer_topk_ties_ok"] for r in res["rows"])
    assert set(res["auto_table"]) == {"scores", "topk"}


def test_sort_positions_kernel_vs_reference():
    """The "library ties" mode's one kernel: a library's positions (any order, -1 pad) sorted
    ascending as host slots, and their lowest score; equal to the stable-sort selection when the
    library picked the stable-sort set."""
    B, P, topk = 3, 4, 40
    s = _tie_scores(B, P * PAGE, _gen(8), "ties")
    lens = torch.tensor([P * PAGE, 25, 0], dtype=torch.int32)
    bt = torch.randperm(20, generator=_gen(9))[: B * P].view(B, P).int()
    want = ties.stable_select_ref(s, bt, lens, topk)
    # the stable-sort set's positions, shuffled, as a library could return them
    slot_pos = {
        int(bt[b, p]) * PAGE + o: p * PAGE + o
        for b in range(B)
        for p in range(P)
        for o in range(PAGE)
    }
    raw = torch.tensor([[slot_pos[int(h)] if h >= 0 else -1 for h in row] for row in want[0]])
    raw = raw[:, torch.randperm(topk, generator=_gen(10))].int().contiguous()
    ref = ties.sort_positions_ref(s, bt, raw)
    assert torch.equal(ref[0], want[0]) and torch.equal(ref[1], want[1])
    got = ties_kernels.sort_positions(s.contiguous(), bt, raw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_prefetch_plans_ask_no_library(monkeypatch):
    """With prefetch every layer runs the fused Triton indexer: the cache asks for Triton plans
    whatever kernel_backend says (so begin_decode launches no DeepGEMM schedule nobody reads)."""
    from custom_ops.cache import kv_cache
    from custom_ops.cache.config import CacheConfig

    asked = []
    monkeypatch.setattr(sel, "plans_for", lambda backend, b, d: asked.append(backend) or ())
    base = dict(num_layers=1, host_tokens=64 * 4, gpu_tokens=96, topk=32, max_batch=2)
    for prefetch, want in (("off", "deep_gemm"), ("request", "triton")):
        cfg = CacheConfig(**base, kernel_backend="deep_gemm", prefetch=prefetch)
        kv_cache.indexer_plans(cfg, torch.device("cpu"))
        assert asked.pop() == want


def test_bench_records_the_resolved_plans_as_runs():
    from echo_compile.bench.result import plan_labels

    T, D, F = (
        sel.Plan("triton", "triton"),
        sel.Plan("deep_gemm", "triton"),
        sel.Plan("deep_gemm", "flashinfer"),
    )
    assert plan_labels((D,) * 63 + (F,)) == {
        "1-63": "deep_gemm/triton", "64": "deep_gemm/flashinfer"
    }  # fmt: skip
    assert plan_labels((T, D, D, F)) == {
        "1": "triton/triton", "2-3": "deep_gemm/triton", "4": "deep_gemm/flashinfer"
    }  # fmt: skip


def test_plan_of_is_the_batch_index_and_guards_ranges_not_sizes():
    """``plan_of`` is ``plans[min(B, len) - 1]`` for every size, and a step traced with a
    symbolic batch (benchmarks/bench_dynamic_decode.py) compiles once per run of equal plans:
    indexing the tuple by the batch guarded ``B == k``, a graph per size."""
    from custom_ops.cache.config import CacheConfig
    from custom_ops.cache.kv_cache import KVCache

    T, D, F = (
        sel.Plan("triton", "triton"),
        sel.Plan("deep_gemm", "triton"),
        sel.Plan("deep_gemm", "flashinfer"),
    )
    for plans in ((T,) * 4, (T, D, D, F), (D,) * 3 + (F,), (T,)):
        for b in range(1, 9):
            assert sel.plan_of(sel.plan_runs(plans), b) == plans[min(b, len(plans)) - 1]

    def traced(fn, sizes):
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        step = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
        for n in sizes:
            x = torch.zeros(n, dtype=torch.int32)
            torch._dynamo.mark_dynamic(x, 0)
            step(x)
        return len(graphs)

    plans = (T, D, D, F)
    runs = sel.plan_runs(plans)
    assert traced(lambda x: x + len(sel.plan_of(runs, x.shape[0]).topk), (2, 3, 4, 5)) == 2
    # the cache's call (begin_decode, as LayerKV.select): CPU plans are all Triton, one graph
    cfg = CacheConfig(num_layers=1, host_tokens=64 * 4, gpu_tokens=128, topk=32, max_batch=4)
    cache = KVCache(cfg, "cpu")

    def decode(x):
        cache.begin_decode(x)
        return x + 1

    assert traced(decode, (2, 3, 4)) == 1
