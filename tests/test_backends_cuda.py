"""On the GPU, the kernel libraries behind ``kernel_backend`` (custom_ops/backends/): DeepGEMM's
decode indexer scores against the torch reference (and deterministic), FlashInfer's top-k plus
the tie fix-up selecting exactly the stable-sort set on many score distributions, and per backend
a compiled engine: offloading vs GPU-only bit for bit, with the graph gates (no cudagraph skip or
partition, no graph break, nothing left un-reinplaced, no recompile after warm-up).

Each test skips only when its library is not installed (``pip install -e '.[kernels]'``, or the
wheels carried as the README says). The libraries JIT-compile on first use (minutes on a fresh
machine): run ``python -m benchmarks.bench_backends`` first, it warms the same caches."""

from __future__ import annotations

import pytest
import torch

from custom_ops.backends import select as sel
from custom_ops.backends import ties, ties_kernels
from custom_ops.backends.deep_gemm_ops import logits_width, schedule_rows
from custom_ops.backends.flashinfer_ops import ROW_STATES_BYTES
from tests.test_decode_kernels import _gen, _tie_scores, make_indexer_inputs, scores_ref

pytestmark = pytest.mark.cuda
DEV = "cuda"


def need(lib: str) -> None:
    if not sel.installed(lib):
        pytest.skip(f"{lib} is not installed (the optional [kernels] extra; README: kernels)")


def _args(inp):
    return [inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]


def _dg_scores(inp):
    sched = torch.zeros(schedule_rows(torch.device(DEV)), 2, dtype=torch.int32, device=DEV)
    torch.ops.echo.dg_paged_mqa_schedule(inp["seq_lens"], sched)
    width = logits_width(inp["block_table"].shape[1] * 64)
    return torch.ops.echo.dg_paged_mqa_logits(*_args(inp), sched, width), sched


@pytest.mark.parametrize(
    "B, P, heads, lens",
    [(1, 40, 64, [2500]), (3, 33, 32, [0, 64, 2101]), (16, 20, 64, list(range(3, 1280, 80)))],
)
def test_deep_gemm_scores_vs_reference_and_exact_topk(B, P, heads, lens):
    need("deep_gemm")
    inp = make_indexer_inputs(B, P, heads, lens, _gen(21, DEV))
    s, sched = _dg_scores(inp)
    assert s.shape == (B, logits_width(P * 64)) and s.is_contiguous()
    import deep_gemm

    dg_lens = inp["seq_lens"].clamp(min=1).view(-1, 1)  # as the op gives them (deep_gemm_ops)
    meta = deep_gemm.get_paged_mqa_logits_metadata(dg_lens, 64, sched.shape[0] - 1)
    assert torch.equal(sched, meta)  # the op wrote this step's schedule into the static buffer
    ref, mag = scores_ref(inp)
    L = P * 64
    live = torch.isfinite(ref)
    err = ((s[:, :L] - ref).abs() / mag.clamp(min=1e-30))[live]
    assert err.numel() == sum(lens) and float(err.max()) <= 2**-10
    again, _ = _dg_scores(inp)
    assert torch.equal(again[:, :L][live], s[:, :L][live])  # deterministic: lossless needs it
    # through the engine's call: DeepGEMM scores, Triton top-k, the exact set of those scores
    plan = sel.Plan("deep_gemm", "triton")
    host, kth = sel.indexer_select(plan, *_args(inp), 48, sched, None)
    want = ties.stable_select_ref(s, inp["block_table"], inp["seq_lens"], 48)
    assert torch.equal(host, want[0]) and torch.equal(kth, want[1])


@pytest.mark.parametrize("kind", ["ties", "equal", "scores", "near", "spread"])
@pytest.mark.parametrize("B, P, topk", [(1, 1563, 2048), (8, 300, 2048), (5, 6, 32)])
def test_flashinfer_topk_selects_the_stable_sort_set(kind, B, P, topk):
    need("flashinfer")
    L = P * 64
    gen = _gen(31)
    bt = torch.randperm(B * P + 5, generator=gen)[: B * P].view(B, P).int().to(DEV)
    lens = [L, L - 5, 3 * topk // 2, 0, topk, topk - 1, 1, L // 2][:B]
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    if kind == "scores":
        inp = make_indexer_inputs(B, P, 64, lens, _gen(32, DEV))
        bt, s = inp["block_table"], scores_ref(inp)[0].relu()  # ReLU: many exact zeros
    else:
        s = _tie_scores(B, L, gen, kind).to(DEV)
    states = torch.zeros(ROW_STATES_BYTES, dtype=torch.uint8, device=DEV)
    host, kth = torch.ops.echo.fi_topk(s, bt, sl, topk, states)
    want = ties.stable_select_ref(s, bt, sl, topk)
    assert torch.equal(host, want[0]) and torch.equal(kth, want[1])
    again = torch.ops.echo.fi_topk(s, bt, sl, topk, states)  # the scratch is reusable, as
    assert torch.equal(again[0], host)  # every layer of a step reuses it


@pytest.mark.parametrize("B", [1, 64])  # at 100K: FlashInfer's multi-CTA path, its filtered one
def test_flashinfer_topk_replayed_from_a_cuda_graph(B):
    """``dsa_graph_safe`` is off (flashinfer_ops.OPTIONS): the library picks its path from static
    shapes at capture. Replays with new scores and new lengths must still give the exact set."""
    need("flashinfer")
    P, topk = 1563, 2048
    L = P * 64
    gen = _gen(35)
    bt = torch.randperm(B * P, generator=gen).view(B, P).int().to(DEV)
    s = torch.zeros(B, L, device=DEV)
    sl = torch.full((B,), L, dtype=torch.int32, device=DEV)
    states = torch.zeros(ROW_STATES_BYTES, dtype=torch.uint8, device=DEV)
    torch.ops.echo.fi_topk(s, bt, sl, topk, states)  # warm-up (JIT) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        host, kth = torch.ops.echo.fi_topk(s, bt, sl, topk, states)
    for rep, kind in enumerate(["scores", "ties", "near"]):
        new = _tie_scores(B, L, _gen(36 + rep), kind) if kind != "scores" else None
        s.copy_(torch.randn(B, L, generator=gen) if new is None else new)
        lens = torch.randint(1, L + 1, (B,), generator=gen, dtype=torch.int32)
        lens[0] = [L, topk - 1, 3 * topk][rep]
        sl.copy_(lens)
        graph.replay()
        want = ties.stable_select_ref(s, bt, sl, topk)
        assert torch.equal(host, want[0]) and torch.equal(kth, want[1]), (B, kind)


@pytest.mark.parametrize("kind", ["ties", "equal", "scores"])
def test_flashinfer_library_tie_break_is_ours(kind, monkeypatch):
    """The optional "library" ties mode (flashinfer_ops.OPTIONS["ties"]) trusts FlashInfer's
    tie_break=1 (smaller index first) instead of the fix-up: exact only if that is our rule. A
    failure here means: keep the default "fixup"."""
    need("flashinfer")
    from custom_ops.backends import flashinfer_ops as fio

    B, P, topk = 4, 1563, 2048
    L = P * 64
    bt = torch.arange(B * P, dtype=torch.int32, device=DEV).view(B, P)
    sl = torch.tensor([L, 3000, 2048, 0], dtype=torch.int32, device=DEV)
    if kind == "scores":
        inp = make_indexer_inputs(B, P, 64, sl.tolist(), _gen(33, DEV))
        bt, s = inp["block_table"], scores_ref(inp)[0].relu()
    else:
        s = _tie_scores(B, L, _gen(34), kind).to(DEV)
    monkeypatch.setitem(fio.OPTIONS, "ties", "library")
    states = torch.zeros(ROW_STATES_BYTES, dtype=torch.uint8, device=DEV)
    host, kth = torch.ops.echo.fi_topk(s, bt, sl, topk, states)
    want = ties.stable_select_ref(s, bt, sl, topk)
    assert torch.equal(host, want[0]) and torch.equal(kth, want[1])


def test_fixup_kernels_vs_reference_on_gpu():
    s = _tie_scores(4, 100_032, _gen(41), "ties").to(DEV)
    bt = torch.arange(4 * 1563, dtype=torch.int32, device=DEV).view(4, 1563)
    sl = torch.tensor([100_032, 5000, 0, 2047], dtype=torch.int32, device=DEV)
    kth = ties.stable_select_ref(s, bt, sl, 2048)[1]
    got = ties_kernels.threshold_select(s, bt, sl, kth, 2048)
    assert torch.equal(got, ties.threshold_select_ref(s, bt, sl, kth, 2048))


def _tiny64():
    """The tiny model with 64 index heads (DeepGEMM's SM90 kernel takes 32 or 64), on the GPU."""
    from model.checkpoint import resolve_model
    from model.config import ModelConfig
    from model.model import DeepseekV32ForCausalLM
    from model.presets import tiny_config_dict
    from runtime.tokenizer import Tokenizer

    cfg = ModelConfig.from_dict(tiny_config_dict() | {"index_n_heads": 64})
    with torch.device(DEV):
        model = DeepseekV32ForCausalLM(cfg)
    return model.random_init_(seed=0).eval(), Tokenizer.from_dir(resolve_model("tiny"))


@pytest.mark.parametrize("backend", ["deep_gemm", "flashinfer"])
def test_compiled_engine_lossless_and_gates_per_backend(backend):
    need(backend)
    import torch._dynamo
    import torch._inductor.config as ic
    from test_compile import drive, make_engine
    from torch._dynamo.utils import ReinplaceCounters, counters

    tiny = _tiny64()
    logs = {}
    old = ic.fx_graph_cache
    ic.fx_graph_cache = False  # ReinplaceCounters are only filled on a cache miss
    try:
        for name, offload in ((backend, True), (backend, False), ("triton", True)):
            torch._dynamo.reset()
            if name == backend:
                counters.clear()
                ReinplaceCounters.clear()
            eng = make_engine(tiny, offload, compiled=True, strict=True, kernel_backend=name)
            plan = eng.cache.layers[0].plans[3]  # the bucket of 4 rows
            if name == backend:
                assert plan != sel.Plan("triton", "triton"), plan  # the library really serves
            eng.runner.warmup(calls=3, progress=False)
            with torch.compiler.set_stance("fail_on_recompile"):
                logs[name, offload] = drive(eng)
            if name == backend:
                assert counters["inductor"]["cudagraph_skips"] == 0
                assert counters["inductor"].get("cudagraph_partitions", 0) == 0
                assert dict(counters["graph_break"]) == {}
                assert ReinplaceCounters.get_total_missed() == 0
            del eng
    finally:
        ic.fx_graph_cache = old
    on, off = logs[backend, True], logs[backend, False]
    assert len(on) == len(off) >= 12
    for a, b in zip(on, off):
        assert torch.equal(a, b)  # lossless with this backend
    if backend == "flashinfer":
        # same Triton scores, the same exact selection: the logits of the Triton path, bit for bit
        for a, b in zip(on, logs["triton", True]):
            assert torch.equal(a, b)
