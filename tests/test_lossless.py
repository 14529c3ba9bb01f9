"""The lossless property: decoding with the KV cache offloaded to host memory and a GPU pool so
small that every step evicts and recalls gives logits bit-identical (torch.equal) to the run whose
KV cache lives entirely on the device."""

from __future__ import annotations

import random

import pytest
import torch

from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine, EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.tokenizer import Tokenizer


def _record_logits(engine: Engine) -> list[tuple[bool, list[str], torch.Tensor]]:
    log: list[tuple[bool, list[str], torch.Tensor]] = []
    forward = engine.runner.forward

    def wrapped(batch):
        out = forward(batch)
        log.append(
            (batch.is_decode, [r.request_id for r in batch.requests], out.detach().cpu().clone())
        )
        return out

    engine.runner.forward = wrapped
    return log


def run_engine(model, tok, offload: bool, fmt: str, lens: list[int], steps: int, device: str):
    topk = model.config.index_topk
    n = len(lens)
    eng = Engine(
        model,
        model.config,
        tok,
        EngineConfig(
            max_batch=n,
            host_tokens=64 * (sum(-(-(x + steps) // 64) for x in lens) + n),
            gpu_tokens=n * topk,  # the smallest pool the scheduler accepts
            kv_format=fmt,
            offload=offload,
            max_model_len=max(lens) + steps + 64,
            prefill_chunk=128,
            device=device,
        ),
    )
    log = _record_logits(eng)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i, n_tok in enumerate(lens):
        eng.add_request(
            f"r{i}", [rng.randrange(2, model.config.vocab_size) for _ in range(n_tok)], params
        )
    while eng.has_unfinished():
        eng.step()
    return eng, log


def check_lossless(device: str, fmt: str, lens: list[int], steps: int) -> None:
    path = resolve_model("tiny")
    model, _ = load_model(path, device=device)
    tok = Tokenizer.from_dir(path)
    topk = model.config.index_topk
    assert min(lens) > 2 * topk, "requests must be longer than top-k for selection to be sparse"
    off, log_off = run_engine(model, tok, True, fmt, lens, steps, device)
    _, log_gpu = run_engine(model, tok, False, fmt, lens, steps, device)
    decode_steps = sum(1 for d, _, _ in log_off if d)
    assert decode_steps >= steps
    assert len(log_off) == len(log_gpu)
    for (d1, ids1, a), (d2, ids2, b) in zip(log_off, log_gpu):
        assert (d1, ids1) == (d2, ids2)
        assert torch.equal(a, b), (
            f"logits differ at a {'decode' if d1 else 'prefill'} step of {ids1}"
        )
    # The pool really was too small: rows were recalled on every layer, and misses happened.
    stats = off.cache.stats()
    assert all(h < 1.0 for h in stats["hit_rate"]), stats
    assert stats["recalled_rows_per_step"] >= 1.0, stats
    # Every slot the finished requests held was released.
    assert stats["gpu_pool_usage"] == 0.0
    assert off.scheduler.pages.num_free == off.scheduler.pages.num_pages


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_offload_equals_gpu_only_bit_for_bit(fmt):
    check_lossless("cpu", fmt, lens=[97, 150, 211], steps=32)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_offload_equals_gpu_only_bit_for_bit_cuda(fmt):
    check_lossless("cuda", fmt, lens=[97, 150, 211, 300, 400], steps=40)


def test_lossless_with_page_reuse_and_abort():
    """More requests than decode rows, staggered lengths and one abort mid-decode: pages and GPU
    slots are released and handed to later requests; logits must stay bit-identical."""
    path = resolve_model("tiny")
    model, _ = load_model(path)
    tok = Tokenizer.from_dir(path)
    topk = model.config.index_topk
    logs = {}
    for offload in (True, False):
        eng = Engine(
            model,
            model.config,
            tok,
            EngineConfig(
                max_batch=2,
                host_tokens=64 * 16,
                gpu_tokens=2 * topk,
                offload=offload,
                max_model_len=320,
                prefill_chunk=64,
            ),
        )
        log = _record_logits(eng)
        rng = random.Random(7)
        for i in range(5):
            n = rng.randint(80, 200)
            params = SamplingParams(max_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True)
            eng.add_request(f"r{i}", [rng.randrange(2, 512) for _ in range(n)], params)
        steps = 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
            if steps == 12:
                eng.abort_request("r1")
        assert eng.scheduler.pages.num_free == eng.scheduler.pages.num_pages
        if offload:
            assert eng.cache.stats()["gpu_pool_usage"] == 0.0
        logs[offload] = log
    assert len(logs[True]) == len(logs[False]) > 20
    for (d1, ids1, a), (d2, ids2, b) in zip(logs[True], logs[False]):
        assert (d1, ids1) == (d2, ids2)
        assert torch.equal(a, b)
