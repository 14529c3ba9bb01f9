"""``custom_ops.moe_align``: the one-program Triton groupings (``moe_align``, ``expert_rows``) equal
their torch references bit for bit (interpreter on CPU, the GPU's Triton with the ``device``
fixture there), and both dispatch by device and size."""

import pytest
import torch

from custom_ops import moe_align as A


def _routing(t: int, e: int, k: int, skip_frac: float, g: torch.Generator) -> torch.Tensor:
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    skip = torch.rand(t, k, generator=g) < skip_frac
    return ids.masked_fill(skip, e)  # e: the skip id (another rank's expert)


CASES = [  # (tokens, experts, top-k, block_m, skipped fraction)
    (1, 256, 8, 16, 0.0),
    (2, 256, 8, 16, 0.0),
    (3, 8, 2, 16, 0.0),
    (13, 6, 3, 16, 0.3),
    (40, 4, 4, 32, 0.0),
    (64, 256, 8, 16, 0.5),
    (128, 256, 8, 16, 0.0),
    (128, 257, 8, 64, 0.1),
    (512, 256, 8, 16, 0.0),  # 4096 pairs: the kernel's limit
    (9, 16, 16, 16, 1.0),  # every pair skipped
    (1, 1, 1, 1, 0.0),  # one pair, one expert, block 1: on the GPU Triton makes 1s constants
    (3, 1, 1, 16, 0.3),
]


@pytest.mark.parametrize("t,e,k,bm,skip", CASES)
def test_kernel_equals_torch(device, t, e, k, bm, skip):
    g = torch.Generator().manual_seed(t * 1000 + e)
    trials = 2 if t * k < 4096 or device == "cuda" else 1  # the interpreter's sort of 4096: ~15 s
    for trial, dtype in zip(range(trials), (torch.int32, torch.int64)):
        ids = _routing(t, e, k, skip, g).to(dtype)
        want = A.moe_align_torch(ids, e, bm)
        got = A.moe_align_kernel(ids.to(device), e, bm)
        assert torch.equal(got[0].cpu(), want[0]), (t, e, k, bm, trial, dtype)
        assert torch.equal(got[1].cpu(), want[1]), (t, e, k, bm, trial, dtype)


def test_kernel_equals_torch_when_one_expert_takes_every_pair(device):
    ids = torch.full((150, 8), 5, dtype=torch.int32)  # 1200 pairs on expert 5: many blocks
    want = A.moe_align_torch(ids, 64, 16)
    got = A.moe_align_kernel(ids.to(device), 64, 16)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_kernel_refuses_sizes_it_cannot_hold():
    with pytest.raises(ValueError, match="4097 pairs"):
        A.moe_align_kernel(torch.zeros(4097, 1, dtype=torch.int32), 8, 16)


def test_dispatch_keeps_torch_on_cpu_and_for_large_calls(monkeypatch):
    called = []
    monkeypatch.setattr(A, "moe_align_kernel", lambda *a: called.append(a) or None)
    ids = torch.zeros(4, 8, dtype=torch.int32)
    got = A.moe_align(ids, 16, 16)  # CPU: the torch form
    assert not called and torch.equal(got[0], A.moe_align_torch(ids, 16, 16)[0])


@pytest.mark.parametrize("t,e,k,bm,skip", CASES)
def test_expert_rows_kernel_equals_torch(device, t, e, k, bm, skip):
    g = torch.Generator().manual_seed(t * 1000 + e + 7)
    trials = 2 if t * k < 4096 or device == "cuda" else 1
    for trial, dtype in zip(range(trials), (torch.int32, torch.int64)):
        ids = _routing(t, e, k, skip, g).to(dtype)
        mg = bm * (trial + 1)  # rows per expert block
        want = A.expert_rows_torch(ids, e, mg)
        got = A.expert_rows_kernel(ids.to(device), e, mg)
        assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
        assert torch.equal(got[0].cpu(), want[0]), (t, e, k, mg, trial, dtype)
        assert torch.equal(got[1].cpu(), want[1]), (t, e, k, mg, trial, dtype)


@pytest.mark.parametrize("form", ["torch", "kernel"])
def test_expert_rows_rank_each_experts_pairs_in_order(device, form):
    rows_of = _rows_form(form, device)
    rows, masked_m = rows_of(torch.tensor([[2, 0], [2, 1], [0, 2], [3, 2]]), 5, 8)
    assert masked_m.tolist() == [2, 1, 4, 1, 0] and masked_m.dtype == torch.int32
    # expert 2's pairs (0,0) (1,0) (2,1) (3,1) take rows 16, 17, 18, 19 in pair order
    assert rows.tolist() == [16, 0, 17, 8, 1, 18, 24, 19]


@pytest.mark.parametrize("form", ["torch", "kernel"])
def test_expert_rows_skip_id_goes_to_the_dump_row_and_no_count(device, form):
    rows_of = _rows_form(form, device)
    rows, masked_m = rows_of(torch.tensor([[2, 5], [5, 1], [0, 2]]), 5, 8)  # 5: the skip id
    assert masked_m.tolist() == [1, 1, 2, 0, 0]
    assert rows.tolist() == [16, 40, 40, 8, 0, 17]


def _rows_form(form: str, device: str):
    if form == "torch":
        return A.expert_rows_torch
    return lambda ids, e, mg: tuple(r.cpu() for r in A.expert_rows_kernel(ids.to(device), e, mg))


def test_expert_rows_dispatch_keeps_torch_on_cpu(monkeypatch):
    called = []
    monkeypatch.setattr(A, "expert_rows_kernel", lambda *a: called.append(a) or None)
    ids = torch.zeros(4, 8, dtype=torch.int32)
    got = A.expert_rows(ids, 16, 16)
    assert not called and torch.equal(got[0], A.expert_rows_torch(ids, 16, 16)[0])


@pytest.mark.cuda
def test_dispatch_takes_the_kernels_on_cuda_up_to_their_limit(monkeypatch):
    called = []
    for name in ("moe_align_kernel", "expert_rows_kernel"):
        real = getattr(A, name)
        monkeypatch.setattr(A, name, lambda *a, f=real, n=name: called.append(n) or f(*a))
    for pairs, kernel in ((8, True), (A.KERNEL_MAX_PAIRS, True), (A.KERNEL_MAX_PAIRS + 8, False)):
        called.clear()
        ids = torch.randint(0, 64, (pairs // 8, 8), device="cuda")
        got = (A.moe_align(ids, 64, 16), A.expert_rows(ids, 64, 32))
        assert called == (["moe_align_kernel", "expert_rows_kernel"] if kernel else [])
        assert torch.equal(got[0][0], A.moe_align_torch(ids, 64, 16)[0])
        assert torch.equal(got[1][0], A.expert_rows_torch(ids, 64, 32)[0])


def test_expert_rows_kernel_refuses_sizes_it_cannot_hold():
    with pytest.raises(ValueError, match="4097 pairs"):
        A.expert_rows_kernel(torch.zeros(4097, 1, dtype=torch.int32), 8, 16)
