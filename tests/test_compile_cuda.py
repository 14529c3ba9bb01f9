"""On the GPU: the whole decode step, cache management included, in CUDA graphs with
reduce-overhead: zero cudagraph skips, zero partitions, no graph break, no missed reinplacing, no
recompile after warm-up, and offloading on/off bit-identical under compilation."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cuda


def test_decode_graphs_gates_and_lossless():
    import torch._dynamo
    import torch._inductor.config as ic
    from test_compile import drive, make_engine  # the CPU test's engine and driver
    from torch._dynamo.utils import ReinplaceCounters, counters

    from model.checkpoint import resolve_model
    from model.loader import load_model
    from runtime.tokenizer import Tokenizer

    path = resolve_model("tiny")
    model, _ = load_model(path, device="cuda")
    tiny = (model, Tokenizer.from_dir(path))
    torch._dynamo.reset()
    counters.clear()
    ReinplaceCounters.clear()
    ic.fx_graph_cache = False
    logs = {}
    for offload in (True, False):
        eng = make_engine(tiny, offload, compiled=True, strict=True)  # cudagraph_or_error=True
        eng.runner.warmup(calls=3, progress=False)
        with torch.compiler.set_stance("fail_on_recompile"):
            logs[offload] = drive(eng)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["inductor"].get("cudagraph_partitions", 0) == 0
    assert dict(counters["graph_break"]) == {}
    assert ReinplaceCounters.get_total_missed() == 0
    assert len(logs[True]) >= 12
    for a, b in zip(logs[True], logs[False]):
        assert torch.equal(a, b)


def test_regional_decode_graphs_gates_and_equal_to_unrolled():
    """compile(regional=True) (echo_compile/regional.py, opt-in): the same gates in CUDA graphs
    (zero skips and partitions, no break, no missed reinplacing, no recompile after warm-up),
    and logits torch.equal to the unrolled step's. Not yet run on a GPU (docs/compile.md)."""
    import torch._dynamo
    import torch._inductor.config as ic
    from test_compile import drive
    from torch._dynamo.utils import ReinplaceCounters, counters

    from echo_compile.compiled import StepCompiler
    from model.checkpoint import resolve_model
    from model.loader import load_model
    from runtime.engine import Engine, EngineConfig
    from runtime.tokenizer import Tokenizer

    path = resolve_model("tiny")
    torch._dynamo.reset()
    counters.clear()
    ReinplaceCounters.clear()
    ic.fx_graph_cache = False
    logs = {}
    for regional in (False, True):
        model, _ = load_model(path, device="cuda")  # one each: regional marks its model
        opts = dict(max_batch=4, host_tokens=4096, gpu_tokens=4 * model.config.index_topk,
                    max_model_len=512, decode_buckets=(4,), prefill_chunk=64, device="cuda",
                    compile_prefill=False)  # fmt: skip
        compiler = StepCompiler("cuda", strict=True, regional=regional)
        eng = Engine(
            model, model.config, Tokenizer.from_dir(path), EngineConfig(**opts), compiler=compiler
        )
        eng.runner.warmup(calls=3, progress=False)
        with torch.compiler.set_stance("fail_on_recompile"):
            logs[regional] = drive(eng)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["inductor"].get("cudagraph_partitions", 0) == 0
    assert dict(counters["graph_break"]) == {}
    assert ReinplaceCounters.get_total_missed() == 0
    assert len(logs[True]) >= 12
    for a, b in zip(logs[False], logs[True]):
        assert torch.equal(a, b)
