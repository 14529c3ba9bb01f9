"""The query-blocked sparse MLA prefill kernel (custom_ops/prefill_attn_kernels.py) at small sizes
through the Triton interpreter (conftest sets TRITON_INTERPRET=1 without a GPU): equal bit for
bit to the decode kernel without splits (the numerics contract of echo::sparse_mla_prefill), close
to the reference, FP8 rows dequantised first or in the loop alike. Real sizes on the GPU:
test_prefill_cuda.py."""

from __future__ import annotations

import pytest
import torch

from custom_ops import attention_kernels as ak
from custom_ops import prefill as pf
from custom_ops import prefill_attn_kernels as pa
from custom_ops.kv_format import unpack_kv_rows
from tests.test_decode_kernels import attention_close, make_pool

# small launch shapes: several row blocks, several scan steps, several head blocks (one partial)
SMALL = pa.PrefillAttnConfig(block_h=16, block_k=16, num_warps=4, num_stages=1, min_programs=1,
                             dequant_rows=16, scan=16)  # fmt: skip


def _inputs(T: int, H: int, L: int, K: int, fmt: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, 576, generator=gen) * 0.3).bfloat16()
    rows = make_pool(L, fmt, gen)
    sel = torch.stack([torch.randperm(L, generator=gen)[:K].sort().values for _ in range(T)]).int()
    sel[1, K // 3 :] = -1  # a causal-prefix-like selection: trailing -1 (skipped blocks)
    sel[2] = -1  # nothing selected: zeros
    sel[3, 5:20] = -1  # unused entries inside the list: masked, not skipped
    return q, rows, sel


def test_dequant_rows_equals_unpack():
    gen = torch.Generator().manual_seed(2)
    rows = make_pool(37, "fp8", gen)
    got = pa.dequant_rows(rows, SMALL)
    assert got.shape == (37, 1152) and got.dtype == torch.uint8
    assert torch.equal(got.view(torch.bfloat16), unpack_kv_rows(rows, "fp8"))
    # up to a device bound (the largest selected position): those rows, the same values
    part = pa.dequant_rows(rows, SMALL, torch.tensor(20, dtype=torch.int32))
    assert torch.equal(part.view(torch.bfloat16)[:21], unpack_kv_rows(rows[:21], "fp8"))


@pytest.mark.parametrize(("fmt", "dequant_first"), [("bf16", True), ("fp8", False), ("fp8", True)])
def test_prefill_attn_equals_decode_kernel_unsplit_and_matches_reference(fmt, dequant_first):
    T, H, L, K = 5, 40, 150, 48
    q, rows, sel = _inputs(T, H, L, K, fmt, seed=len(fmt) + dequant_first)
    cfg = pa.PrefillAttnConfig(**{**SMALL.__dict__, "dequant_first": dequant_first})
    out = pa.sparse_mla_prefill_attn(q, rows, sel, 0.1352, fmt, cfg)
    dec = ak.MlaConfig(block_h=16, block_k=16, num_warps=4, num_stages=1, n_split=1)
    want = ak.sparse_mla_decode_cuda(q, rows, sel, 0.1352, fmt, dec)
    assert torch.equal(out, want)  # same loop, same order: the skip and the grid change nothing
    attention_close(out, pf.sparse_mla_prefill_ref(q, rows, sel, 0.1352, fmt))
    assert (out[2] == 0).all()


def test_few_programs_go_to_the_split_decode_kernel():
    q, rows, sel = _inputs(4, 16, 90, 40, "fp8", seed=5)
    cfg = pa.PrefillAttnConfig(**{**SMALL.__dict__, "min_programs": 10**6})
    out = pa.sparse_mla_prefill_attn(q, rows, sel, 0.1, "fp8", cfg)
    assert torch.equal(out, ak.sparse_mla_decode_cuda(q, rows, sel, 0.1, "fp8"))


def test_prefill_attn_rejects_bad_input():
    q, rows, sel = _inputs(4, 4, 70, 24, "bf16", seed=6)
    with pytest.raises(ValueError, match="rows must be uint8"):
        pa.sparse_mla_prefill_attn(q, rows, sel, 0.1, "fp8", SMALL)
    with pytest.raises(ValueError, match="sel must be int32"):
        pa.sparse_mla_prefill_attn(q, rows, sel.long(), 0.1, "bf16", SMALL)
    with pytest.raises(ValueError, match="multiples of 16"):
        pa.sparse_mla_prefill_attn(q, rows, sel, 0.1, "bf16", pa.PrefillAttnConfig(block_k=24))
    with pytest.raises(ValueError, match="fp8 rows"):
        pa.dequant_rows(rows)
