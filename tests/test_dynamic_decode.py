"""EngineConfig.dynamic_decode: one decode compile for every bucket, its batch dim symbolic.

CPU (Dynamo and AOT tracing, ``aot_eager``: Inductor's minute per graph is the GPU test's; the
bf16, FP8 and AWQ tiny checkpoints): two Dynamo graphs for buckets 1, 2, 4 (B = 1 specialized,
one graph for B >= 2), no recompile while serving batches of 1-3 rows, the logits equal to the
per-bucket engine's step by step. CUDA (``-m cuda``): the same under Inductor and reduce-overhead
with the cudagraph gates (zero skips, zero partitions, no graph break), and offloading on vs off
bit-identical."""

from __future__ import annotations

import pytest
import torch
from test_compile import drive  # the compile tests' three-request driver
from torch._dynamo.utils import counters

from echo_compile.compiled import StepCompiler
from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine, EngineConfig
from runtime.tokenizer import Tokenizer


def _tiny(device: str = "cpu", checkpoint: str = "tiny"):
    path = resolve_model(checkpoint)
    return load_model(path, device=device)[0], Tokenizer.from_dir(path)


def _engine(tiny, dynamic: bool, backend: str, offload: bool = True, strict: bool = False):
    model, tok = tiny
    device = str(next(model.parameters()).device)
    cfg = EngineConfig(
        max_batch=4, host_tokens=4096, gpu_tokens=4 * model.config.index_topk, offload=offload,
        max_model_len=512, decode_buckets=(1, 2, 4), prefill_chunk=64, device=device,
        compile_prefill=False, dynamic_decode=dynamic,
    )  # fmt: skip
    compiler = StepCompiler(device, strict=strict, backend=backend)
    return Engine(model, model.config, tok, cfg, compiler=compiler)


def _serve(tiny, dynamic: bool, backend: str, **kw) -> tuple[list[torch.Tensor], int]:
    """Warm-up, then the driver's requests with recompiles refused: (logits, Dynamo graphs)."""
    torch._dynamo.reset()
    counters.clear()
    eng = _engine(tiny, dynamic, backend, **kw)
    eng.runner.warmup(calls=2, progress=False)
    graphs = counters["stats"]["unique_graphs"]
    marks = []
    real_mark = torch._dynamo.mark_dynamic
    torch._dynamo.mark_dynamic = lambda t, i, **kw: marks.append(i) or real_mark(t, i, **kw)
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            logs = drive(eng)
    finally:
        torch._dynamo.mark_dynamic = real_mark
    assert marks == []  # (host time a step) the marks end with the warm-up's compiles
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled while serving
    return logs, graphs


def test_dynamic_decode_must_be_bool():
    with pytest.raises(ValueError, match="dynamic_decode must be True or False, got 'yes'"):
        EngineConfig(dynamic_decode="yes")


@pytest.mark.parametrize("compile_", [None, False])
def test_dynamic_decode_on_an_eager_llm_is_refused_before_the_load(monkeypatch, compile_):
    """An eager engine (the CPU's default, or compile=False) has no decode compile for the
    option to change: refused naming both, before any weight is read (it was ignored: the
    engine ran eagerly)."""
    import model.loader
    from echo_compile.llm import LLM

    def load(*a, **k):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(model.loader, "load_model", load)
    with pytest.raises(ValueError, match=r"dynamic_decode .* runs eagerly on cpu .*compile=True"):
        LLM("tiny", device="cpu", compile=compile_, progress=False, dynamic_decode=True)


@pytest.mark.parametrize("checkpoint", ["tiny", "tiny-fp8", "tiny-awq"])
def test_one_compile_serves_every_bucket_with_equal_logits(checkpoint):
    """bf16, FP8 and AWQ weights: their weight ops traced with a symbolic batch too."""
    tiny = _tiny(checkpoint=checkpoint)
    dyn, n_dyn = _serve(tiny, True, "aot_eager")
    static, n_static = _serve(tiny, False, "aot_eager")
    assert (n_static, n_dyn) == (3, 2)  # a graph per bucket; B = 1 and B >= 2
    assert {t.shape[0] for t in dyn} == {1, 2, 3}  # every size served, 3 padded to 4
    assert len(dyn) == len(static) >= 12
    for a, b in zip(dyn, static, strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_dynamic_decode_graph_gates_and_lossless_cuda():
    import torch._inductor.config as ic

    tiny = _tiny("cuda")
    ic.fx_graph_cache = False
    logs, graphs = {}, {}
    for offload in (True, False):  # cudagraph_or_error: a skip is an error
        logs[offload], graphs[offload] = _serve(
            tiny, True, "inductor", offload=offload, strict=True
        )
        assert counters["inductor"]["cudagraph_skips"] == 0
        assert counters["inductor"].get("cudagraph_partitions", 0) == 0
        assert dict(counters["graph_break"]) == {}
    assert graphs == {True: 2, False: 2}
    static, _ = _serve(tiny, False, "inductor", strict=True)
    assert len(logs[True]) >= 12
    for a, b, c in zip(logs[True], logs[False], static, strict=True):
        assert torch.equal(a, b)  # offloading changes nothing
        assert torch.equal(a, c)  # nor does the symbolic batch


def test_warmup_captures_the_largest_bucket_first():
    """The dynamic graph is compiled at the first batch above 1 the warm-up runs: the largest."""
    from runtime.model_runner import build_runner

    seen: list[tuple[str, int]] = []

    class Recorder:
        def __init__(self, step, num_graphs, dynamic_batch=False):
            self.kind = "decode" if step.is_decode else "prefill"
            self.frozen = False

        def __call__(self, *args):
            seen.append((self.kind, args[0].shape[0]))

    model, _ = _tiny()
    cfg = EngineConfig(max_batch=8, decode_buckets=(1, 2, 8), prefill_chunk=64, max_model_len=512)
    build_runner(model, cfg, Recorder).warmup(calls=1, progress=False)
    assert [b for k, b in seen if k == "decode"] == [8, 2, 1]
    prefill = [b for k, b in seen if k == "prefill"]
    assert prefill == sorted(prefill, reverse=True) and len(prefill) > 1
