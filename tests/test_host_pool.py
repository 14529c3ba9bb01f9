"""The pinned host pool's memory, the parts that run on any Linux host (custom_ops/cache/
host_pool.py): the anonymous mapping and the threads that fault it in. Registering it with CUDA
is tests/test_cache_cuda.py's (test_pinned_host_pool_is_uva); here a stand-in for cuda.bindings
checks who owns, unregisters and unmaps what."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import types
import weakref

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
            import faulthandler
            import resource

            faulthandler.disable()  # (pytest's handler would print the expected fault's stack)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # and no core file
            os._exit(ctypes.c_uint8.from_address(ptr + n // 2).value + 3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, status
    finally:
        hp.unmap(ptr, n)


class FakeCudart(types.ModuleType):
    """cuda.bindings.runtime's calls PinnedRows makes, recorded; ``fail_at``: the registration
    (0-based) that fails."""

    cudaHostRegisterMapped, cudaHostRegisterPortable = 2, 1
    cudaError_t = types.SimpleNamespace(cudaSuccess=0, cudaErrorMemoryAllocation=2)

    def __init__(self, fail_at: int = -1):
        super().__init__("cuda.bindings.runtime")
        self.fail_at, self.registered, self.unregistered = fail_at, [], []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> tuple:  # noqa: N802
        if len(self.registered) == self.fail_at:
            self.fail_at = -1
            return (self.cudaError_t.cudaErrorMemoryAllocation,)
        self.registered.append(ptr)
        return (self.cudaError_t.cudaSuccess,)

    def cudaHostGetDevicePointer(self, ptr: int, flags: int) -> tuple:  # noqa: N802
        return self.cudaError_t.cudaSuccess, ptr

    def cudaHostUnregister(self, ptr: int) -> tuple:  # noqa: N802
        self.unregistered.append(ptr)
        return (self.cudaError_t.cudaSuccess,)


@pytest.fixture
def fake_cuda(monkeypatch):
    """PinnedRows on this host: a stand-in cudart, no device switch; every unmap recorded."""
    cudart = FakeCudart()
    cuda, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    cuda.bindings, bindings.runtime = bindings, cudart
    for name, mod in (("cuda", cuda), ("cuda.bindings", bindings),
                      ("cuda.bindings.runtime", cudart)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    unmapped: list[int] = []
    real_unmap = hp.unmap

    def unmap(ptr: int, nbytes: int) -> None:
        unmapped.append(ptr)
        real_unmap(ptr, nbytes)

    monkeypatch.setattr(hp, "unmap", unmap)
    yield cudart, unmapped
    gc.collect()


def test_a_view_of_the_cpu_view_keeps_the_rows(fake_cuda):
    """Any view of ``cpu()`` (a slice, a reshape) keeps the mapping: it is unmapped once the last
    view goes, not with the tensor ``cpu()`` returned."""
    cudart, unmapped = fake_cuda
    pr = hp.PinnedRows(4, 4096, torch.device("cuda"))
    owner, ptr = weakref.ref(pr), pr.ptr
    rows = pr.cpu()[1:3].view(-1)
    del pr
    gc.collect()
    assert owner() is not None and unmapped == []
    rows.fill_(5)  # (a segfault were it unmapped)
    assert int(rows.sum()) == 5 * 2 * 4096
    del rows
    gc.collect()
    assert owner() is None and unmapped == [ptr] and cudart.unregistered == [ptr]


@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_failed_registration_unmaps_every_layer_once(fake_cuda, fail_at):
    """A layer's cudaHostRegister fails: the error names the size; every layer's mapping is
    unmapped exactly once, and only the registered ones unregistered."""
    cudart, unmapped = fake_cuda
    cudart.fail_at = fail_at
    with pytest.raises(ValueError, match=r"pinning 16384 bytes .*cudaHostRegister.*--host-tokens"):
        hp.allocate_host_rows(4, 4, 4096, torch.device("cuda"), pinned=True)
    gc.collect()
    assert len(unmapped) == 4 == len(set(unmapped)), unmapped
    assert sorted(cudart.unregistered) == sorted(cudart.registered)
    assert len(cudart.registered) == fail_at


def test_without_cuda_bindings_every_layer_is_unmapped(fake_cuda, monkeypatch):
    """cuda.bindings missing: the ImportError, and no layer's mapping left behind."""
    _, unmapped = fake_cuda
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(ImportError):
        hp.allocate_host_rows(3, 4, 4096, torch.device("cuda"), pinned=True)
    gc.collect()
    assert len(unmapped) == 3 == len(set(unmapped)), unmapped
