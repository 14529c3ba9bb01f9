"""EngineConfig derives the cache, scheduler and compile policy in one place (issue 13 item 7)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from custom_ops.cache.config import CacheConfig
from model.checkpoint import resolve_model
from model.config import ModelConfig
from runtime.engine_config import EngineConfig


@pytest.fixture(scope="module")
def mc() -> ModelConfig:
    return ModelConfig.from_json(resolve_model("tiny") / "config.json")


def test_both_modes_get_the_same_prefill_buffer_in_whole_pages(mc):
    cfg = EngineConfig(max_model_len=100, host_tokens=1024)
    on, off = cfg.cache_config(mc), replace(cfg, offload=False).cache_config(mc)
    assert on.prefill_tokens == off.prefill_tokens == 128  # a compiled prefill reads 2 pages
    assert on.offload and not off.offload
    assert cfg.model_len(mc) == 100
    assert replace(cfg, max_model_len=5000).model_len(mc) == 1024  # bounded by the host pool


def test_one_prefill_compile_policy(mc):
    big = 131072  # the sparse prefill compiles for long context limits too
    assert EngineConfig(max_model_len=4096).prefill_compiled(mc)
    assert EngineConfig(max_model_len=big, host_tokens=big).prefill_compiled(mc)
    assert EngineConfig(max_model_len=big, host_tokens=big, compile_prefill=True).prefill_compiled(
        mc
    )
    assert not EngineConfig(compile_prefill=False).prefill_compiled(mc)
    with pytest.raises(ValueError, match="compile_prefill"):
        EngineConfig(compile_prefill="yes")


def test_one_capacity_rule_for_scheduler_and_cache(mc):
    topk = mc.index_topk
    # a pool of 2 selections caps the batch at 2; a big one leaves max_batch; no pool (GPU-only,
    # gpu_tokens unused) never caps
    for offload, gpu_tokens, rows in ((True, 2 * topk + 5, 2), (True, 9 * topk, 4), (False, 1, 4)):
        cfg = EngineConfig(max_batch=4, gpu_tokens=gpu_tokens, offload=offload)
        assert cfg.cache_config(mc).max_decode_rows == rows
        assert cfg.scheduler_config(mc).max_running == rows
    assert CacheConfig(1, 64, 3 * topk, topk, max_batch=8).max_decode_rows == 3
