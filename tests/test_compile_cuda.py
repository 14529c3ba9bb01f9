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
