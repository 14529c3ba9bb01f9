"""On the GPU: three compiled engines in one process, as a notebook or a server that rebuilds its
engine does it (issue 13 item 1: the second one died in warm-up with FailOnRecompileLimitHit).
Offload on and off, bf16 and fp8, one deleted before the next is built and two alive at once;
each generates, with zero cudagraph skips and partitions and no graph break, and the offloaded
engine matches the GPU-only one of its format bit for bit (same batches: the pool holds
max_batch selections)."""

from __future__ import annotations

import gc
import random

import pytest

pytestmark = pytest.mark.cuda


def test_three_compiled_engines_in_one_process():
    import torch
    from torch._dynamo.utils import counters

    from echo_compile import LLM, SamplingParams

    counters.clear()
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (40, 300, 17, 129)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)

    def build(fmt: str, offload: bool) -> LLM:
        llm = LLM(
            "tiny",
            max_batch=2,
            host_tokens=4096,
            gpu_tokens=2 * 32,  # max_batch x the tiny model's index_topk
            kv_format=fmt,
            offload=offload,
            max_model_len=512,
            prefill_chunk=64,
            progress=False,
        )
        assert llm.engine.config.device.startswith("cuda") and llm.engine.runner.compiled
        assert llm.engine.model_config.index_topk == 32
        return llm

    def gen(llm: LLM) -> list[tuple[list[int], list[float]]]:
        return [(r.token_ids, r.logprobs) for r in llm.generate(prompts, params)]

    first = build("bf16", True)
    out_first = gen(first)
    del first
    gc.collect()
    second = build("fp8", False)
    out_second = gen(second)
    third = build("fp8", True)  # alive with the second
    out_third = gen(third)
    assert gen(second) == out_second  # the second still serves, and the same
    assert out_third == out_second  # lossless under compilation, prefill included
    for out in (out_first, out_second):
        assert [len(t) for t, _ in out] == [12] * len(prompts)
    torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["inductor"].get("cudagraph_partitions", 0) == 0
    assert dict(counters["graph_break"]) == {}


def test_asynchronous_scheduling_under_cuda_graphs():
    """A compiled engine with ``async_scheduling``: the same tokens and logprobs as the
    synchronous engine, offloaded, sampled as well as greedy; the steps run ahead replay the
    captured graphs (zero skips and partitions, no graph break, no recompile: a frozen step
    raises on one)."""
    import torch
    from torch._dynamo.utils import counters

    from echo_compile import LLM, SamplingParams

    counters.clear()
    rng = random.Random(11)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (40, 300, 17, 129, 64)]
    params = [
        SamplingParams(max_tokens=n, temperature=t, seed=3, ignore_eos=True, logprobs=True)
        for n, t in ((16, 0.0), (9, 0.8), (16, 1.0), (3, 0.0), (12, 0.0))
    ]

    def run(asynchronous: bool) -> tuple[list, dict]:
        llm = LLM(
            "tiny", max_batch=4, host_tokens=4096, gpu_tokens=4 * 32, kv_format="fp8",
            max_model_len=512, prefill_chunk=64, progress=False, async_scheduling=asynchronous,
        )  # fmt: skip
        out = [(r.token_ids, r.logprobs) for r in llm.generate(prompts, params)]
        return out, llm.engine.metrics()

    sync_out, sync_m = run(False)
    async_out, async_m = run(True)
    assert async_out == sync_out
    assert sync_m["decode_ahead_fraction"] == 0.0 and async_m["decode_ahead_fraction"] > 0.5
    # the GPU's own idle time between decode steps is measured in both loops (its gaps counted);
    # which loop idles less is a benchmark (`echo-compile bench --async-scheduling off,on`), not
    # asserted here: the tiny model's steps are host-bound, and beside the other test processes
    # of a GPU run the two were 0.693 and 0.685 ms (gpu_session44/call3_cuda_engines.log).
    # That the steps do overlap is checked directly below.
    assert sync_m["decode_gpu_idle_gaps"] > 10 and async_m["decode_gpu_idle_gaps"] > 10

    # the overlap itself: when step() returns, the step it launched ahead is still running on
    # the device (reading the step before waited for that step alone, not the whole stream)
    llm = LLM(
        "tiny", max_batch=4, host_tokens=4096, gpu_tokens=4 * 32, kv_format="fp8",
        max_model_len=512, prefill_chunk=64, progress=False, async_scheduling=True,
    )  # fmt: skip
    eng = llm.engine
    for i, p in enumerate(prompts[:4]):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    running = []
    while eng.has_unfinished():
        eng.step()
        if eng._in_flight is not None:
            running.append(not eng._in_flight.copied.query())
    # (most, not all: the tiny model's step is short, and the host's work between two of them
    # is not always shorter)
    assert len(running) > 30 and sum(running) > 0.5 * len(running), running
    torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["inductor"].get("cudagraph_partitions", 0) == 0
    assert dict(counters["graph_break"]) == {}
