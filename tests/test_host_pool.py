"""The pinned host pool's memory, the parts that run on any Linux host (custom_ops/cache/
host_pool.py): the anonymous mapping and the threads that fault it in. Registering it with CUDA
is tests/test_cache_cuda.py's (test_pinned_host_pool_is_uva)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from custom_ops.cache import host_pool as hp


def view(ptr: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


@pytest.mark.parametrize("huge", [True, False])
def test_mapped_memory_is_zero_and_fault_in_covers_every_byte(monkeypatch, huge):
    monkeypatch.setattr(hp, "HUGE_PAGES", huge)
    monkeypatch.setattr(hp, "FAULT_CHUNK", 3 * 4096)  # chunks that do not divide the spans
    sizes = [5 * 4096 + 123, 7 * 4096, 100]
    ptrs = [hp.map_anonymous(n) for n in sizes]
    try:
        assert all(not bool(view(p, n).any()) for p, n in zip(ptrs, sizes))  # zero-filled
        for p, n in zip(ptrs, sizes):  # something in every byte, so a chunk missed shows
            view(p, n).fill_(7)
        hp.fault_in(list(zip(ptrs, sizes)))
        assert all(not bool(view(p, n).any()) for p, n in zip(ptrs, sizes))
    finally:
        for p, n in zip(ptrs, sizes):
            hp.unmap(p, n)


def test_a_mapping_that_cannot_be_made_names_its_size():
    with pytest.raises(ValueError, match=r"host KV pool: mapping \d+ bytes .*GiB.*--host-tokens"):
        hp.map_anonymous(2**62)


def test_a_forked_child_does_not_inherit_the_mapping():
    """A child (a compile worker, a subprocess started by fork) gets no copy of the pool: the
    kernel would copy every pinned page of a private mapping into it at the fork."""
    import os
    import signal

    n = 1 << 20
    ptr = hp.map_anonymous(n)
    try:
        hp.fault_in([(ptr, n)])
        pid = os.fork()
        if pid == 0:  # the child: reading the pool's address faults when it is not mapped
            os._exit(ctypes.c_uint8.from_address(ptr + n // 2).value + 3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, status
    finally:
        hp.unmap(ptr, n)
