"""The first half of the lossless property, where logits need not be bit-identical: with a GPU
pool that caps the decode batch (``B x index_topk > gpu_tokens``), the offloaded run decodes
smaller batches than GPU-only, yet the attended set of every request at every layer and decode
step is identical, and the GPU slots handed to attention hold exactly the selected host rows.
(The second half, bit-identical logits for identical batches, is tests/test_lossless.py.)"""

from __future__ import annotations

import pytest
import torch
from engine_records import random_prompts, run, tiny

from runtime.engine import EngineConfig
from runtime.sampling_params import SamplingParams

# two shorter than index_topk (32): their rows carry -1 padding; two far longer (sparse)
LENS = [9, 150, 27, 211]
MAX_TOKENS = [10, 6, 14, 8]


def _config(offload: bool, topk: int, device: str) -> EngineConfig:
    return EngineConfig(
        max_batch=4,
        host_tokens=64 * 24,
        gpu_tokens=2 * topk,  # caps the offloaded batch at 2 rows; GPU-only runs 4
        offload=offload,
        max_model_len=320,
        prefill_chunk=64,
        device=device,
    )


def test_attended_set_equal_when_the_pool_caps_the_batch():
    check_attended_set("cpu")


@pytest.mark.cuda
def test_attended_set_equal_when_the_pool_caps_the_batch_cuda():
    check_attended_set("cuda")  # eager: the recording wrappers see every layer's select/fetch


def check_attended_set(device: str) -> None:
    model, _ = tiny(device)
    topk = model.config.index_topk
    prompts = random_prompts(LENS, model.config.vocab_size, seed=3)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    off, rec_off, out_off = run(_config(True, topk, device), prompts, params)
    gpu, rec_gpu, out_gpu = run(_config(False, topk, device), prompts, params)

    # the batches really differ: the pool cap was exercised
    assert max(rec_off.batch_sizes) == 2 and max(rec_gpu.batch_sizes) == 4
    assert len(rec_off.batch_sizes) > len(rec_gpu.batch_sizes)
    off.check_pools()  # no recall ever overflowed the pool

    # the same queries were made: every request, layer and decode position, in both runs
    n_layers = model.config.num_hidden_layers
    expected = sum(MAX_TOKENS) * n_layers
    assert len(rec_off.selected) == len(rec_gpu.selected) == expected
    assert rec_off.selected.keys() == rec_gpu.selected.keys()
    for key, sel in rec_off.selected.items():
        assert torch.equal(sel, rec_gpu.selected[key]), f"attended set differs at {key}"
    # ... covering -1 padded rows (short requests) and really sparse ones (long requests)
    padded = [k for k, s in rec_off.selected.items() if (s == -1).any()]
    sparse = [k for k, s in rec_off.selected.items() if k[1] + 1 > topk]
    assert padded and sparse
    assert all((s >= 0).sum() == min(k[1] + 1, topk) for k, s in rec_off.selected.items())
    # every offloaded fetch was checked row by row, and rows really moved (misses happened)
    assert rec_off.fetch_checks == len(rec_off.batch_sizes) * n_layers
    stats = off.cache.stats()
    assert stats["recalled_rows_per_step"] >= 1.0 and all(h < 1.0 for h in stats["hit_rate"])

    # greedy tokens agree; logits only up to the batch-size dependence of the fp32 lm head
    assert out_off == out_gpu
    if device != "cpu":
        return  # GPU GEMMs may depend on the batch size in more places: tokens and sets only
    dec_off, dec_gpu = _decode_logits(rec_off), _decode_logits(rec_gpu)
    assert dec_off.keys() == dec_gpu.keys()
    for rid in dec_off:
        torch.testing.assert_close(dec_off[rid], dec_gpu[rid], atol=1e-4, rtol=0)


def _decode_logits(rec) -> dict[str, torch.Tensor]:
    """Request id -> its decode logits [steps, V], in step order, whatever batch each row was in."""
    rows: dict[str, list[torch.Tensor]] = {}
    for is_decode, ids, logits in rec.logits:
        if is_decode:
            for rid, lg in zip(ids, logits):
                rows.setdefault(rid, []).append(lg)
    return {rid: torch.stack(r) for rid, r in rows.items()}
