"""EngineConfig derives the cache, scheduler and compile policy in one place (issue 13 item 7)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

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


def test_llm_checks_everything_but_the_weights_before_loading_them(monkeypatch, tmp_path):
    """The options against the model config, the tokenizer, the chat template and the
    generation config are read before the weights (minutes on a real checkpoint): each mistake
    is a ValueError and the loader is never called. The loader is asked to drop the MTP layer
    (never run; held, it is GiBs of host memory through warm-up)."""
    import json
    import shutil

    import model.loader
    from echo_compile.llm import LLM

    asked: dict = {}

    def no_load(*a, **k):
        asked.update(k)
        raise AssertionError("loaded")

    monkeypatch.setattr(model.loader, "load_model", no_load)
    with pytest.raises(ValueError, match=r"gpu_tokens=16 cannot hold .* >= max_batch x topk = 256"):
        LLM("tiny", device="cpu", gpu_tokens=16, progress=False)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(resolve_model("tiny"), ckpt)
    tok_config = ckpt / "tokenizer_config.json"
    good = tok_config.read_text()
    tok_config.write_text(json.dumps({**json.loads(good), "chat_template": "{% if %}"}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: chat_template does not parse"):
        LLM(str(ckpt), device="cpu", progress=False)
    tok_config.write_text(good)
    (ckpt / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="temperature"):
        LLM(str(ckpt), device="cpu", progress=False)
    (ckpt / "generation_config.json").unlink()
    with pytest.raises(AssertionError, match="loaded"):
        LLM(str(ckpt), device="cpu", progress=False)
    assert asked["keep_mtp"] is False


def test_prefetch_cap_past_the_host_pool_is_refused_when_the_config_is_made():
    with pytest.raises(ValueError, match=r"prefetch_cap must be at most host_tokens \(1024"):
        EngineConfig(host_tokens=1024, prefetch="request", prefetch_cap=1025)
    EngineConfig(host_tokens=1024, prefetch_cap=1025)  # prefetch off: nothing is staged


@pytest.mark.parametrize(
    "buckets, message",
    [
        (8, "decode_buckets must be a list of positive integers, got 8"),
        ((1, 2, 16), "decode_buckets must be increasing and end at max_batch"),  # max_batch 8
    ],
)
def test_decode_buckets_are_checked_when_the_config_is_made(buckets, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(decode_buckets=buckets)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_llm_on_cuda_without_cuda_is_one_clear_error():
    from echo_compile.llm import LLM

    with pytest.raises(ValueError, match=r"device='cuda': CUDA is not available .*device='cpu'"):
        LLM("tiny", device="cuda", progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_compile_on_cuda_without_cuda_is_one_clear_error():
    import echo_compile
    from model.loader import load_model

    model, _ = load_model("tiny", device="cpu")
    with pytest.raises(ValueError, match=r"device='cuda': CUDA is not available"):
        echo_compile.compile(model, host_tokens=1024, gpu_tokens=64, device="cuda")
