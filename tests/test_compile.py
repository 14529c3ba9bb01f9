"""torch.compile of the whole decode step, cache management included (CPU: Inductor's C++ backend,
no CUDA graphs; the lint checks what CUDA graphs would need)."""

from __future__ import annotations

import difflib
import random

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import ReinplaceCounters, counters

from echo_compile.compiled import StepCompiler
from echo_compile.graph_lint import LintReport, lint_backend
from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine, EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny():
    path = resolve_model("tiny")
    model, _ = load_model(path)
    return model, Tokenizer.from_dir(path)


def make_engine(tiny, offload: bool, compiled: bool = False, strict: bool = False, **kw) -> Engine:
    """A small engine; ``compiled``: its decode step compiled (prefill too with
    ``compile_prefill=True``)."""
    model, tok = tiny
    device = str(next(model.parameters()).device)
    opts = dict(
        max_batch=4,
        host_tokens=4096,
        gpu_tokens=4 * model.config.index_topk,
        offload=offload,
        max_model_len=512,
        decode_buckets=(4,),
        prefill_chunk=64,
        device=device,
        compile_prefill=False,
    )
    compiler = StepCompiler(device, strict=strict) if compiled else None
    return Engine(model, model.config, tok, EngineConfig(**opts | kw), compiler=compiler)


def drive(engine: Engine, steps: int = 12) -> list[torch.Tensor]:
    """Runs 3 requests (prefill eager, decode through engine.runner.decode_fn); returns logits."""
    logs: list[torch.Tensor] = []
    fwd = engine.runner.forward

    def rec(batch, *ahead):  # (next_ids, next_rows: a step run ahead, async_scheduling)
        out = fwd(batch, *ahead)
        if batch.is_decode:
            logs.append(out.clone())
        return out

    engine.runner.forward = rec
    rng = random.Random(3)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((70, 90, 130)):
        engine.add_request(f"r{i}", [rng.randrange(2, 512) for _ in range(n)], params)
    while engine.has_unfinished():
        engine.step()
    return logs


def test_decode_step_lint_cudagraph_safe(tiny):
    """No node that disables CUDA graphs, every mutated input static, one graph, no breaks."""
    eng = make_engine(tiny, offload=True)
    report = LintReport()
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(eng.runner.decode_step, backend=lint_backend(report), fullgraph=True)
    args = eng.runner.padding_inputs(True, 4)
    with torch.no_grad():
        step(*args)
    assert report.ok, report
    # the cache ops mutate: host pool, indexer cache, GPU pool state of every layer
    assert report.mutated_inputs >= 4 * len(eng.cache.layers), report
    assert dict(counters["graph_break"]) == {}


def test_compiled_decode_lossless_reinplaced_and_close_to_eager(tiny):
    """Compiled decode steps (cache ops included): offloading on and off stay bit-identical over a
    whole greedy generation (lossless under compilation); Inductor reinplaces every cache op (no
    clone of any cache buffer); and the compiled step matches eager, mostly bit for bit. Prefill
    runs eagerly here, so the runs decode from the same cache state."""
    torch._dynamo.reset()
    counters.clear()
    ReinplaceCounters.clear()
    import torch._inductor.config as ic

    old = ic.fx_graph_cache
    ic.fx_graph_cache = False  # ReinplaceCounters are only filled on a cache miss
    try:
        compiled = {}
        for offload in (True, False):
            compiled[offload] = drive(make_engine(tiny, offload, compiled=True))
    finally:
        ic.fx_graph_cache = old
    assert dict(counters["graph_break"]) == {}
    assert ReinplaceCounters.get_total_missed() == 0
    assert ReinplaceCounters.get_total_missed_bytes() == 0
    assert len(compiled[True]) == len(compiled[False]) >= 12
    for c_on, c_off in zip(compiled[True], compiled[False]):
        assert torch.equal(c_on, c_off)  # lossless under compilation
    eager = drive(make_engine(tiny, offload=True))
    exact = 0
    for c, e in zip(compiled[True], eager):
        err = (c - e).abs().amax(dim=-1) / e.abs().amax(dim=-1)
        assert float(err.max()) <= 2e-2, err
        exact += int(torch.equal(c, e))
    # emulate_precision_casts makes most steps bit-identical; the rest differ by an fp32
    # reduction-order ulp that flips a bf16 rounding (seen: one row of one step in 12).
    assert exact >= len(eager) // 2, f"only {exact}/{len(eager)} steps bit-identical"


def test_compiled_batch_one_bucket_matches_eager(tiny):
    """The batch-1 bucket, the one a lone request decodes in: compiled equals eager as the other
    buckets do. Inductor's CPU lowering of a one-row bmm (the absorbed attention's per-head
    matmuls) rounds each product to bf16; before model.model._per_head computed that row as two,
    the compiled step differed from eager by up to 11% of the logits' max here."""
    torch._dynamo.reset()
    kw = dict(max_batch=1, decode_buckets=(1,))
    compiled = drive(make_engine(tiny, offload=True, compiled=True, **kw), steps=6)
    eager = drive(make_engine(tiny, offload=True, **kw), steps=6)
    assert len(compiled) == len(eager) == 18
    exact = 0
    for c, e in zip(compiled, eager):
        assert c.shape[0] == 1
        err = (c - e).abs().amax(dim=-1) / e.abs().amax(dim=-1)
        assert float(err.max()) <= 2e-2, err
        exact += int(torch.equal(c, e))
    assert exact >= len(eager) // 2, f"only {exact}/{len(eager)} steps bit-identical"


def test_compiled_decode_run_ahead(tiny):
    """The compiled decode step launched one token ahead (``async_scheduling``: its input ids
    the step before's sampled tokens, on the device): the same logits at every step as the
    compiled synchronous loop, after warm-up froze the steps (a recompile would raise), with no
    graph break."""
    torch._dynamo.reset()
    counters.clear()
    logs = {}
    for asynchronous in (False, True):
        eng = make_engine(tiny, offload=True, compiled=True, async_scheduling=asynchronous)
        eng.runner.warmup(progress=False)
        logs[asynchronous] = drive(eng)
        ahead = eng.metrics()["decode_ahead_fraction"]
        assert ahead > 0.5 if asynchronous else ahead == 0.0
    assert dict(counters["graph_break"]) == {}
    assert len(logs[True]) == len(logs[False]) >= 12
    for a, s in zip(logs[True], logs[False]):
        assert torch.equal(a, s)


def test_compiled_prefill_chunk(tiny):
    """A prefill chunk bucket compiles fullgraph (no break) and agrees with eager. Not bit for bit:
    the index scores' fp32 head reduction is ordered differently by Inductor, and a near-tie at
    the top-k boundary may then pick another key (see docs/compile.md)."""
    torch._dynamo.reset()
    counters.clear()
    eng = make_engine(tiny, offload=True)
    runner = eng.runner
    from runtime.request import Request

    rng = random.Random(5)
    req = Request("p", [rng.randrange(2, 512) for _ in range(100)], SamplingParams(max_tokens=4))
    req.pages = eng.scheduler.pages.alloc(2)
    args = runner.prefill_inputs(req, 0, 64, 64)
    with torch.no_grad():
        ref = runner.prefill_step(*args)
        compiled = torch.compile(runner.prefill_step, fullgraph=True, dynamic=False)
        out = compiled(*args)
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(out, ref, rtol=0, atol=5e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("prefill_buffer", [True, False])
def test_compiled_prefill_graph_is_the_same_with_and_without_offload(tiny, prefill_buffer):
    """Offloading and GPU-only hand Inductor the same ATen graph for a prefill chunk (issue 13
    item 0: reading the context from the prefill buffer in one mode and from the pool in the
    other gave two graphs, which Inductor fused differently: last bits differed, and top-k
    near-ties then changed the tokens on the GPU). The modes differ only in the pool behind the
    opaque echo::offload op (and, without the prefill buffer, the host pool that
    echo::prefill_indexer_topk_gather reads). Traced to ATen only: Inductor would take minutes
    here."""
    from torch._dynamo.backends.common import aot_autograd

    from echo_compile.compiled import _own_code

    graphs = {}
    for offload in (True, False):
        eng = make_engine(tiny, offload, kv_format="fp8", prefill_buffer=prefill_buffer)
        codes: list[str] = []

        def keep(gm, example_inputs, codes=codes):
            codes.append(gm.code)
            return gm.forward

        step = torch.compile(
            _own_code(eng.runner.prefill_step),
            backend=aot_autograd(fw_compiler=keep),
            fullgraph=True,
            dynamic=False,
        )
        with torch.no_grad():
            step(*eng.runner.padding_inputs(False, 64))
        graphs[offload] = codes
    assert len(graphs[True]) == 1
    code = graphs[True][0]
    assert "echo.offload" in code
    if prefill_buffer:
        assert "index_copy" in code and "prefill_indexer_topk_gather" not in code
    else:
        assert "index_copy" not in code and "prefill_indexer_topk_gather" in code
    diff = difflib.unified_diff(graphs[True][0].splitlines(), graphs[False][0].splitlines())
    assert graphs[True] == graphs[False], "\n".join(list(diff)[:40])


def test_compiled_steps_run_with_deterministic_algorithms_and_restore_the_caller_state():
    """Inductor's flag alone left compiled runs irreproducible on the H200; every compiled step
    call (its compile included) runs with torch's deterministic algorithms, and the process-global
    state is the caller's again afterwards, on success and on error. Deterministic mode's fill of
    uninitialised memory is off inside (settings.FILL_UNINITIALIZED) and torch's again after."""
    import torch.utils.deterministic as det

    from echo_compile import settings
    from echo_compile.compiled import CompiledStep

    seen = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(
            (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
                det.fill_uninitialized_memory,
            )
        )
        if x.item() < 0:
            raise RuntimeError("step failed")
        return x

    step = CompiledStep(fn, torch.device("cpu"), None)
    assert not torch.are_deterministic_algorithms_enabled()
    step(torch.ones(1))
    step.frozen = True
    step(torch.ones(1))
    with pytest.raises(RuntimeError, match="step failed"):
        step(-torch.ones(1))
    assert seen == [(True, True, settings.FILL_UNINITIALIZED)] * 3
    assert not torch.are_deterministic_algorithms_enabled()
    assert det.fill_uninitialized_memory  # torch's default, restored
    torch.use_deterministic_algorithms(True)  # a caller's own strict setting survives a step
    det.fill_uninitialized_memory = not settings.FILL_UNINITIALIZED  # and its own fill choice
    try:
        step(torch.ones(1))
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert det.fill_uninitialized_memory == (not settings.FILL_UNINITIALIZED)
    finally:
        torch.use_deterministic_algorithms(False)
        det.fill_uninitialized_memory = True


def test_settings_make_inductor_deterministic():
    """Reduction configs chosen by on-device timing made two compiles of one step disagree on the
    H200 (echo_compile/settings.py): the settings must turn that timing off."""
    import torch._inductor.config as inductor_config

    from echo_compile import settings

    settings.apply(1)
    assert inductor_config.deterministic is True
    assert inductor_config.emulate_precision_casts is True


@pytest.mark.parametrize("graphs, mode", [(True, "reduce-overhead"), (False, None)])
def test_step_compiler_cuda_graphs_flag_sets_the_compile_mode(monkeypatch, graphs, mode):
    """``StepCompiler(cuda_graphs=False)`` (``bench_dynamic_decode --backend
    inductor_no_graphs``) compiles a CUDA step with Inductor but without reduce-overhead's CUDA
    graphs; the default keeps them. Checked at the ``torch.compile`` call (no GPU here)."""
    import echo_compile.compiled as C

    seen = {}

    def fake_compile(fn, **kw):
        seen.update(kw)
        return fn

    monkeypatch.setattr(C.torch, "compile", fake_compile)

    class Step(torch.nn.Module):
        is_decode = True

        def forward(self, x):
            return x

    C.StepCompiler("cuda", cuda_graphs=graphs)(Step(), num_graphs=1)
    assert seen["backend"] == "inductor" and seen.get("mode") == mode
