"""Several compiled engines in one process (issue 13 item 1): each owns its compiled steps, so a
second or third engine, in sequence or alive at once, neither reuses nor fills an earlier one's
Dynamo cache, and no recompile limit is hit.

The steps are compiled with the aot_eager backend: Dynamo's caches, guards and fullgraph capture
are what this tests, and Inductor takes about a minute per graph on a small CPU. aot_eager runs
the captured ATen graph eagerly, so each engine's output must equal an eager engine's bit for
bit. tests/test_engines_cuda.py runs the real (Inductor, CUDA graphs) version on the GPU."""

from __future__ import annotations

import gc
import random

import pytest
import torch._dynamo.config as dynamo_config
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from echo_compile.compiled import StepCompiler
from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine, EngineConfig
from runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model():
    return load_model(resolve_model("tiny"))[0]


def make(model, compiled: bool, **kw) -> Engine:
    cfg = EngineConfig(
        max_batch=2,
        host_tokens=1024,
        gpu_tokens=2 * model.config.index_topk,
        max_model_len=128,
        decode_buckets=(2,),
        prefill_chunk=16,  # prompts of 20-40 tokens: two or three chunks, the last one padded
        compile_prefill=True,
        **kw,
    )
    compiler = StepCompiler("cpu", backend="aot_eager") if compiled else None
    eng = Engine(model, model.config, None, cfg, compiler=compiler)
    eng.runner.warmup(calls=1, progress=False)
    return eng


PROMPTS = [[random.Random(i).randrange(2, 512) for _ in range(n)] for i, n in enumerate((20, 37))]


def start(eng: Engine) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, params)


def collect(eng: Engine, out: dict) -> None:
    for o in eng.step():
        tok, lp = out.setdefault(o.request_id, ([], []))
        tok += o.new_token_ids
        lp += o.new_logprobs


def run(eng: Engine) -> dict:
    out: dict = {}
    start(eng)
    while eng.has_unfinished():
        collect(eng, out)
    return out


def test_compiled_engines_in_sequence_and_alive_at_once(model, monkeypatch):
    # the smallest limit settings.apply allows (5 entries a code object): with the steps of every
    # engine on one code object (the bug), the 4 modes' decode graphs and 2 formats' prefill
    # graphs would be 6 entries of StepModule.forward, and the fourth engine's warm-up would fail
    monkeypatch.setattr(dynamo_config, "recompile_limit", 1)
    counters.clear()
    eager = {fmt: run(make(model, False, kv_format=fmt)) for fmt in ("bf16", "fp8")}
    first = make(model, True, kv_format="bf16", offload=True)
    second = make(model, True, kv_format="bf16", offload=False)  # alive with the first
    outs: list[dict] = [{}, {}]
    for eng in (first, second):
        start(eng)
    while first.has_unfinished() or second.has_unfinished():  # their steps interleave
        for eng, out in zip((first, second), outs):
            if eng.has_unfinished():
                collect(eng, out)
    assert outs[0] == eager["bf16"]
    assert outs[1] == eager["bf16"]  # GPU-only == offload: the same batches were decoded
    steps = [fn for e in (first, second) for _, _, fn in e.runner.compiled]
    del first, eng
    gc.collect()
    third = make(model, True, kv_format="fp8", offload=True)
    fourth = make(model, True, kv_format="fp8", offload=False)
    assert run(third) == eager["fp8"]
    assert run(fourth) == eager["fp8"]
    assert run(second) == eager["bf16"]  # still serving after the others came and went
    steps += [fn for e in (third, fourth) for _, _, fn in e.runner.compiled]
    assert len(steps) == 8 and len({id(s.code) for s in steps}) == 8
    for s in steps:  # one entry per bucket, on the step's own code object
        assert len(_debug_get_cache_entry_list(s.code)) == 1
        assert s.frozen
    assert dict(counters["graph_break"]) == {}
