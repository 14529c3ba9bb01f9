"""The GPU-pool cap on the decode batch (B x index_topk <= gpu_tokens) with a pool SMALLER than
max_batch x topk: the scheduler admits only what the pool can serve, the rest waits and is
admitted as rows free up, and the engine never overflows a pool."""

from __future__ import annotations

import pytest
from engine_records import random_prompts, run, tiny

from runtime.engine import EngineConfig
from runtime.request import Request
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler
from runtime.scheduler_config import SchedulerConfig

TOPK = 32


def test_scheduler_admits_only_what_the_pool_serves():
    s = Scheduler(
        SchedulerConfig(
            max_batch=4,
            max_model_len=256,
            host_tokens=64 * 16,
            topk=TOPK,
            gpu_tokens=2 * TOPK + TOPK - 1,
        )  # fmt: skip
    )
    reqs = [Request(f"r{i}", [5] * 10, SamplingParams(max_tokens=4)) for i in range(4)]
    for r in reqs:
        s.add(r)
    batch = s.schedule()
    assert [r.request_id for r in s.running] == ["r0", "r1"]  # 3 x 32 > 95 rows
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]
    assert batch is not None and batch.requests == [reqs[0]]  # prefill first
    s.remove(reqs[0])
    s.schedule()
    assert [r.request_id for r in s.running] == ["r1", "r2"]
    # GPU-only: no pool, so max_batch is the only bound
    g = Scheduler(SchedulerConfig(max_batch=4, max_model_len=256, host_tokens=64 * 16, topk=TOPK))
    for r in [Request(f"g{i}", [5] * 10, SamplingParams(max_tokens=4)) for i in range(5)]:
        g.add(r)
    g.schedule()
    assert len(g.running) == 4 and len(g.waiting) == 1


def test_engine_with_a_pool_of_half_the_batch():
    """max_batch=4, gpu_tokens=2 x topk, 4 long requests: without the cap the first decode step
    of four would need 4 x topk distinct rows per layer and the engine would raise "GPU pool
    overflow"; with it, every request finishes, two at a time."""
    model, _ = tiny()
    topk = model.config.index_topk
    cfg = EngineConfig(max_batch=4, host_tokens=64 * 16, gpu_tokens=2 * topk, max_model_len=256,
                       prefill_chunk=64)  # fmt: skip
    prompts = random_prompts([100, 120, 90, 110], model.config.vocab_size, seed=5)
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)] * 4
    eng, rec, out = run(cfg, prompts, params)
    assert all(len(v) == 3 for v in out.values())
    assert max(rec.batch_sizes) == 2 and rec.batch_sizes.count(2) >= 2
    eng.check_pools()
    assert eng.cache.stats()["gpu_pool_usage"] == 0.0


def test_context_limit_error_names_the_host_pool_where_it_binds():
    """A request longer than the host pool was refused as over "the model's" context limit."""
    s = Scheduler(SchedulerConfig(max_batch=2, max_model_len=128, host_tokens=128, topk=TOPK))
    req = Request("r", [1] * 100, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match=r"exceeds the context limit of 128 tokens \(host_tokens: "
                                         r"a request reserves all its pages"):
        s.check(req)
    s = Scheduler(SchedulerConfig(max_batch=2, max_model_len=128, host_tokens=256, topk=TOPK))
    with pytest.raises(
        ValueError, match=r"exceeds the model's context limit of 128 tokens \(max_model_len, "
    ):
        s.check(req)
