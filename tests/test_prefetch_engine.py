"""Prefetch end to end on the tiny checkpoint: decoding with lossless prefetch gives logits
bit-identical (torch.equal) to prefetch off and to GPU-only, with a pool that evicts every step,
also while finished requests' host slots go to new requests; its per-layer metrics reach the step
stats and /metrics."""

from __future__ import annotations

import random

import prometheus_client as prom
import pytest
import torch

from custom_ops.prefetch_layout import PF_PROMOTED, PF_STAGED
from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine, EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.server_metrics import ServerMetrics
from runtime.tokenizer import Tokenizer
from tests import test_lossless as tl


def _run(model, tok, fmt, lens, steps, device, **kw):
    # test_lossless.run_engine with prefetch options: its EngineConfig gets them through a shim
    orig = tl.EngineConfig

    def config(**args):
        return orig(**args, **kw)

    tl.EngineConfig = config
    try:
        return tl.run_engine(model, tok, True, fmt, lens, steps, device)
    finally:
        tl.EngineConfig = orig


def check(device: str, fmt: str, mode: str, cap: int, lens: list[int], steps: int) -> dict:
    path = resolve_model("tiny")
    model, _ = load_model(path, device=device)
    tok = Tokenizer.from_dir(path)
    eng, log_on = _run(
        model, tok, fmt, lens, steps, device, prefetch=mode, prefetch_cap=cap, prefetch_ratio=0.05
    )
    _, log_gpu = tl.run_engine(model, tok, False, fmt, lens, steps, device)
    assert len(log_on) == len(log_gpu) and sum(d for d, _, _ in log_on) >= steps
    for (d1, ids1, a), (d2, ids2, b) in zip(log_on, log_gpu):
        assert (d1, ids1) == (d2, ids2)
        assert torch.equal(a, b), f"logits differ at a {'decode' if d1 else 'prefill'} step"
    m = eng.metrics()
    n_layers = model.config.num_hidden_layers
    assert len(m["prefetch_precision"]) == len(m["prefetch_coverage"]) == n_layers
    assert sum(m["prefetched_per_step"]) > 0 and max(m["prefetch_coverage"]) > 0
    assert all(0.0 <= x <= 1.0 for x in m["prefetch_precision"] + m["prefetch_coverage"])
    return m


@pytest.mark.parametrize("fmt,mode,cap", [("bf16", "request", 16), ("fp8", "global", 64)])
def test_prefetch_equals_gpu_only_bit_for_bit(fmt, mode, cap):
    check("cpu", fmt, mode, cap, lens=[97, 150, 211], steps=12)


# (prompt length, max_tokens, step it is added at): lengths and budgets differ, so requests finish
# at different steps, and the later ones take the host pages the finished ones released
CHURN = [(150, 6, 0), (97, 20, 0), (211, 9, 0), (120, 12, 0), (180, 7, 8), (90, 14, 16)]


def _run_churn(model, tok, offload: bool, device: str = "cpu", **kw):
    """CHURN on a 2-row engine whose host pool holds two requests (8 pages) and whose GPU pool
    one selection per row; returns the engine, its forward log (test_lossless._record_logits),
    each request's tokens and every page list the host slot allocator handed out."""
    topk = model.config.index_topk
    eng = Engine(model, model.config, tok, EngineConfig(
        max_batch=2, host_tokens=64 * 8, gpu_tokens=2 * topk, offload=offload,
        max_model_len=320, prefill_chunk=64, device=device, **kw))  # fmt: skip
    log = tl._record_logits(eng)
    handed: list[list[int]] = []
    alloc = eng.scheduler.pages.alloc

    def logged_alloc(n):
        pages = alloc(n)
        handed.append(list(pages or []))
        return pages

    eng.scheduler.pages.alloc = logged_alloc
    rng = random.Random(3)
    prompts = [[rng.randrange(2, model.config.vocab_size) for _ in range(n)] for n, _, _ in CHURN]
    tokens: dict[str, list[int]] = {}
    step = 0
    while step == 0 or eng.has_unfinished():
        for i, (_, max_tokens, at) in enumerate(CHURN):
            if at == step:
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                eng.add_request(f"r{i}", prompts[i], params)
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    assert step > max(at for _, _, at in CHURN), "a request was never added"
    return eng, log, tokens, handed


def test_prefetch_lossless_under_request_churn():
    """Requests finish at different steps and new ones are admitted into their released host
    slots while prefetch stages rows every step: the staging maps keep entries of the earlier
    owners' rows (docs/prefetch.md, "Staging epochs"), which the recall must never read for the
    new owner. Tokens and every step's logits equal prefetch off's and GPU-only's. (On the CPU
    the reference ops; the Triton kernels: the cuda variant below.)"""
    check_churn("cpu")


@pytest.mark.cuda
def test_prefetch_lossless_under_request_churn_cuda():
    check_churn("cuda")


def check_churn(device: str) -> None:
    path = resolve_model("tiny")
    model, _ = load_model(path, device=device)
    tok = Tokenizer.from_dir(path)
    runs = {  # margin 0 (ECHO's threshold) stages the most rows: stale entries abound
        "request": _run_churn(model, tok, True, device, prefetch="request", prefetch_cap=16,
                              prefetch_margin=0),  # fmt: skip
        "off": _run_churn(model, tok, True, device),
        "gpu": _run_churn(model, tok, False, device),
    }
    eng, log_on, tokens_on, handed = runs["request"]
    # not vacuous: host pages were handed out again, and the pool evicted while rows were staged
    # and read from staging
    pages = [p for lst in handed for p in lst]
    assert len(pages) > len(set(pages)), handed
    assert [len(tokens_on[f"r{i}"]) for i in range(len(CHURN))] == [mt for _, mt, _ in CHURN]
    stats = eng.cache.stats()
    assert all(h < 1.0 for h in stats["hit_rate"]) and stats["recalled_rows_per_step"] >= 1.0
    totals = sum(layer.staging.totals for layer in eng.cache.layers if layer.staging is not None)
    assert totals[PF_STAGED] > 0 and totals[PF_PROMOTED] > 0, totals
    for name in ("off", "gpu"):
        _, log, tokens, other = runs[name]
        assert other == handed and len(log) == len(log_on) > 30, name
        for (d1, ids1, a), (d2, ids2, b) in zip(log_on, log):
            assert (d1, ids1) == (d2, ids2)
            assert torch.equal(a, b), f"{name}: logits differ at a step of {ids1}"
        assert tokens == tokens_on, name


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["request", "global"])
def test_prefetch_equals_gpu_only_bit_for_bit_cuda(fmt, mode):
    check("cuda", fmt, mode, 64, lens=[97, 150, 211, 300, 400], steps=40)


def test_prefetch_metrics_exported():
    met = ServerMetrics("tiny", 512)
    snap = {"hit_rate": [0.5], "prefetched_per_step": [3.0, 4.0], "prefetch_precision": [0.25],
            "prefetch_coverage": [0.75]}  # fmt: skip
    met.update(snap, 0)
    text = prom.generate_latest(met.registry).decode()
    assert 'echo_prefetched_per_step{layer="1"} 4.0' in text
    assert 'echo_prefetch_precision{layer="0"} 0.25' in text
    assert 'echo_prefetch_coverage{layer="0"} 0.75' in text


def test_engine_config_prefetch_checks():
    with pytest.raises(ValueError, match="prefetch"):
        EngineConfig(prefetch="yes")
    with pytest.raises(ValueError, match="prefetch_ratio"):
        EngineConfig(prefetch="global", prefetch_ratio=0)
    for bad in (-1.0, float("inf"), float("nan"), "2", True):
        with pytest.raises(ValueError, match="prefetch_margin"):
            EngineConfig(offload=True, prefetch="request", prefetch_margin=bad)
    assert EngineConfig(offload=True, prefetch="request", prefetch_margin=0).prefetch_margin == 0


def test_compiled_decode_with_prefetch_lossless_and_graph_safe():
    """The decode step with prefetch compiles fullgraph with no graph break, no node that would
    disable CUDA graphs, every cache op reinplaced (no clone of staging or pool state), and its
    logits equal those of the compiled step with prefetch off."""
    import torch._inductor.config as ic
    from torch._dynamo.utils import ReinplaceCounters, counters

    from echo_compile.graph_lint import LintReport, lint_backend
    from tests import test_compile as tc

    path = resolve_model("tiny")
    model, _ = load_model(path)
    tiny = (model, Tokenizer.from_dir(path))
    eng = tc.make_engine(tiny, offload=True, prefetch="request", prefetch_cap=16)
    report = LintReport()
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(eng.runner.decode_step, backend=lint_backend(report), fullgraph=True)
    with torch.no_grad():
        step(*eng.runner.padding_inputs(True, 4))
    assert report.ok, report
    torch._dynamo.reset()
    counters.clear()
    ReinplaceCounters.clear()
    old = ic.fx_graph_cache
    ic.fx_graph_cache = False  # ReinplaceCounters are only filled on a cache miss
    try:
        on = tc.drive(tc.make_engine(tiny, True, compiled=True, prefetch="request",
                                     prefetch_cap=16))  # fmt: skip
        off = tc.drive(tc.make_engine(tiny, True, compiled=True))
    finally:
        ic.fx_graph_cache = old
    assert dict(counters["graph_break"]) == {}
    assert ReinplaceCounters.get_total_missed() == 0
    assert len(on) == len(off) >= 12
    assert all(torch.equal(a, b) for a, b in zip(on, off))


def test_bench_system_with_prefetch_reports_it_and_the_overlap():
    """echo-compile bench's System: prefetch metrics and pool rows per request in the result; the
    breakdown measures the consecutive-step top-k overlap from the indexer's own selections."""
    from echo_compile.bench import harness as bench
    from echo_compile.bench.model_builder import build_model
    from echo_compile.bench.workload import Workload

    model = build_model("tiny", 4, 16, "cpu")
    wl = Workload(requests=2, min_ctx=300, max_ctx=300, output_len=6, temperature=1.0)
    sut = bench.System(model, "offload-eager", 96, 4096, "fp8", 512, 2, (), "cpu", 1.0, seed=0,
                       prefetch="request")  # fmt: skip
    r = sut.run(wl)
    assert r.prefetch == "request" and len(r.prefetch_precision) == 4
    assert r.pool_rows_per_request == pytest.approx(96 / r.effective_batch)
    assert r.indexer_plans == {"1-2": "triton/triton"}  # prefetch: the fused Triton indexer
    assert sum(r.prefetched_per_step) > 0
    bd = sut.breakdown(wl, warm_steps=1, steps=1)
    ov = bd["topk_overlap"]
    assert len(ov) == 4 and all(0.0 <= x <= 1.0 for x in ov)
    # --repeat 1.0 feeds the same token: layer 0's query changes only by RoPE, its selection
    # overlaps heavily from step to step
    assert ov[0] > 0.5, ov
    sut.close()


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["request", "global"])
def test_prefetch_decode_graphs_gates_and_lossless_cuda(mode):
    """On the GPU: the decode step with prefetch in CUDA graphs (reduce-overhead, strict): zero
    cudagraph skips and partitions, no graph break, no missed reinplacing, no recompile after
    warm-up, and logits torch.equal to prefetch off's under compilation."""
    import torch._dynamo
    import torch._inductor.config as ic
    from torch._dynamo.utils import ReinplaceCounters, counters

    from tests import test_compile as tc

    path = resolve_model("tiny")
    model, _ = load_model(path, device="cuda")
    tiny = (model, Tokenizer.from_dir(path))
    torch._dynamo.reset()
    counters.clear()
    ReinplaceCounters.clear()
    ic.fx_graph_cache = False
    logs = {}
    for pf in (mode, "off"):
        eng = tc.make_engine(tiny, True, compiled=True, strict=True, prefetch=pf,
                             prefetch_cap=16, prefetch_ratio=0.05)  # fmt: skip
        eng.runner.warmup(calls=3, progress=False)
        with torch.compiler.set_stance("fail_on_recompile"):
            logs[pf] = tc.drive(eng)
        if pf != "off":
            m = eng.metrics()
            assert sum(m["prefetched_per_step"]) > 0 and max(m["prefetch_coverage"]) > 0
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["inductor"].get("cudagraph_partitions", 0) == 0
    assert dict(counters["graph_break"]) == {}
    assert ReinplaceCounters.get_total_missed() == 0
    assert len(logs[mode]) >= 12
    for a, b in zip(logs[mode], logs["off"]):
        assert torch.equal(a, b)


def test_prefetch_without_offloading_is_refused():
    """prefetch with the KV on the device would be silently ignored: refused, naming why."""
    with pytest.raises(ValueError, match="needs offloading"):
        EngineConfig(prefetch="request", offload=False)
    EngineConfig(prefetch="off", offload=False)  # the default stays valid
