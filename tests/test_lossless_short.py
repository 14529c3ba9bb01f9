"""Lossless with -1 padding in the selections: prompts shorter than index_topk (the indexer pads
their rows with -1) mixed with long ones, offloaded with the smallest pool that keeps the batches
of the GPU-only run (max_batch x topk): every forward's logits bit-identical (torch.equal), and
the attention op ignores -1 entries whatever the pool rows they would alias hold."""

from __future__ import annotations

import pytest
import torch
from engine_records import random_prompts, run, tiny

from custom_ops import attention as _attention  # noqa: F401  (registers echo::sparse_mla_decode)
from custom_ops.kv_format import KV_LORA, pack_kv_rows, unpack_kv_rows
from runtime.engine import EngineConfig
from runtime.sampling_params import SamplingParams

LENS = [5, 150, 20, 31, 97]  # three shorter than topk = 32, one of them one token short


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_lossless_with_prompts_shorter_than_topk(fmt):
    check_short_lossless(fmt, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_lossless_with_prompts_shorter_than_topk_cuda(fmt):
    check_short_lossless(fmt, "cuda")  # eager; the compiled runs are tests/test_lossless.py's


def check_short_lossless(fmt: str, device: str) -> None:
    model, _ = tiny(device)
    topk = model.config.index_topk
    assert sum(n < topk for n in LENS) >= 2 and sum(n > 2 * topk for n in LENS) >= 2
    prompts = random_prompts(LENS, model.config.vocab_size, seed=21)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * len(LENS)
    runs = {}
    for offload in (True, False):
        cfg = EngineConfig(max_batch=len(LENS), host_tokens=64 * 16,
                           gpu_tokens=len(LENS) * topk, kv_format=fmt, offload=offload,
                           max_model_len=192, prefill_chunk=64, device=device)  # fmt: skip
        runs[offload] = run(cfg, prompts, params)
    (off, rec_off, out_off), (_, rec_gpu, out_gpu) = runs[True], runs[False]
    assert out_off == out_gpu
    assert len(rec_off.logits) == len(rec_gpu.logits)
    for (d1, ids1, a), (d2, ids2, b) in zip(rec_off.logits, rec_gpu.logits):
        assert (d1, ids1) == (d2, ids2)
        assert torch.equal(a, b), f"logits differ at a {'decode' if d1 else 'prefill'} of {ids1}"
    # padded selections were really decoded, alongside evicting long requests
    assert any((s == -1).any() for s in rec_off.selected.values())
    stats = off.cache.stats()
    assert stats["recalled_rows_per_step"] >= 1.0 and all(h < 1.0 for h in stats["hit_rate"])


def _dense(q: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of q [H, 576] over rows [n, 576] (the valid ones only), fp32 -> bf16."""
    p = torch.softmax((q.float() @ rows.float().T) * scale, dim=-1)  # [H, n]
    return (p @ rows[:, :KV_LORA].float()).to(torch.bfloat16)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_attention_ignores_minus_one_entries(fmt):
    g = torch.Generator().manual_seed(4)
    n, heads, k = 40, 4, 32
    pool = pack_kv_rows(torch.randn(n, 512, generator=g), torch.randn(n, 64, generator=g), fmt)
    q = (torch.randn(3, heads, 576, generator=g) * 0.3).bfloat16()
    slots = torch.full((3, k), -1, dtype=torch.int32)
    slots[0, :5] = torch.tensor([7, 3, 12, 20, 9])  # a short request: the tail is padding
    slots[1] = torch.randperm(n - 2, generator=g)[:k].int() + 1  # full: rows 0 and n-1 unused
    # row 2 stays empty (a padded batch row): zeros
    scale = 0.1
    out = torch.ops.echo.sparse_mla_decode(q, pool, slots, scale, fmt)
    rows = unpack_kv_rows(pool, fmt)
    for b in range(2):
        valid = slots[b][slots[b] >= 0].long()
        torch.testing.assert_close(out[b], _dense(q[b], rows[valid], scale), atol=2e-2, rtol=2e-2)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    # a -1 entry aliases no row: rows 0 and n-1 (what -1 reads after a clamp or as an index)
    # and every row no entry selects may hold anything, even huge values, and change nothing
    garbage = pool.clone()
    used = torch.zeros(n, dtype=torch.bool)
    used[slots[slots >= 0].long()] = True
    big = pack_kv_rows(torch.full((n, 512), 300.0), torch.full((n, 64), 300.0), fmt)
    garbage[~used] = big[~used]
    assert torch.equal(out, torch.ops.echo.sparse_mla_decode(q, garbage, slots, scale, fmt))
