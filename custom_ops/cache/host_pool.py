"""Host KV pool allocation: one ``[N_H, row]`` uint8 tensor per layer.

- CPU: an ordinary tensor (CI runs the engine this way; the mechanism is the same).
- CUDA with offloading: pinned host memory that GPU kernels read and write directly (UVA). We
  map it ourselves and register it with ``cudaHostRegister(Mapped | Portable)`` through
  cuda.bindings (below: faster than ``cudaHostAlloc``) rather than
  ``torch.empty(pin_memory=True)``, whose caching host allocator rounds every block up to a power
  of two (a 45 GiB pool would pin 64 GiB). The tensor handed out is CUDA-typed, built from the
  mapped device pointer through ``__cuda_array_interface__``: under torch.compile a CPU tensor in
  the graph would stop CUDA-graph capture. Each layer gets its own allocation (one base tensor per
  layer: views of one shared base make Inductor clone the whole base, docs/graph_notes.md).
- CUDA without offloading: device memory (the GPU-only policy).

The pool is sized once at start; a request for more memory than the machine has fails here with
the byte count, instead of an opaque allocator error (or the OOM killer) later.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)


def _host_memory_limit() -> int:
    """Physical memory, lowered to the cgroup limit when a container sets one."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def _check_size(num_layers: int, n_tokens: int, row_bytes: int, available: int, where: str) -> int:
    if num_layers <= 0 or n_tokens <= 0 or row_bytes <= 0:
        raise ValueError(
            f"host KV pool: num_layers, n_tokens and row_bytes must be positive, got "
            f"{num_layers}, {n_tokens}, {row_bytes}"
        )
    total = num_layers * n_tokens * row_bytes
    if total > available:
        raise ValueError(
            f"host KV pool: {num_layers} layers x {n_tokens} tokens x {row_bytes} B = {total} "
            f"bytes ({total / 2**30:.2f} GiB) asked for, but {where} has only {available} bytes "
            f"({available / 2**30:.2f} GiB); lower host_tokens (--host-tokens)"
        )
    return total


# Pinning: anonymous memory mapped with transparent huge pages advised, faulted in by threads,
# then cudaHostRegister'ed, rather than cudaHostAlloc, which faults in and pins its 4 KB pages on
# one thread: on an H100 host 64 GiB over 61 layers took 44.2 s that way (with a memset a layer)
# and 3.6 s this way, the GPU's reads of it as fast (docs/cache_ops.md, "Pinning the host pool").
# The kernel hands anonymous memory out zero-filled.
HUGE_PAGES = True  # madvise(MADV_HUGEPAGE); False: 4 KB pages (6.3 s for the 64 GiB above)
FAULT_CHUNK = 64 << 20  # bytes a thread faults in at a time
_PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS, _MADV_DONTFORK, _MADV_HUGEPAGE = 0x3, 0x22, 10, 14


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def map_anonymous(nbytes: int) -> int:
    """``nbytes`` of private anonymous memory (zero-filled, not yet faulted in), huge pages
    advised when ``HUGE_PAGES`` (ignored where the kernel has none); its address. It is not
    inherited by a forked child (``MADV_DONTFORK``, as CUDA's own pinned memory): the kernel
    would otherwise copy every pinned page of a private mapping into the child at the fork."""
    libc = _libc()
    ptr = libc.mmap(None, nbytes, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS, -1, 0)
    if ptr is None or ptr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise ValueError(
            f"host KV pool: mapping {nbytes} bytes ({nbytes / 2**30:.2f} GiB) failed: "
            f"{os.strerror(err)}; lower host_tokens (--host-tokens)"
        )
    libc.madvise(ptr, nbytes, _MADV_DONTFORK)
    if HUGE_PAGES:
        libc.madvise(ptr, nbytes, _MADV_HUGEPAGE)
    return ptr


def unmap(ptr: int, nbytes: int) -> None:
    _libc().munmap(ptr, nbytes)


def fault_in(spans: list[tuple[int, int]]) -> None:
    """Touch every page of the ``(address, bytes)`` spans from a thread per CPU (at most 16):
    the kernel's zero-filling of fresh pages is the cost, and it runs in parallel this way (the
    writes are zeros, so the contents stay as mapped). ``memset`` runs without the GIL."""
    parts = [(p + o, min(FAULT_CHUNK, n - o)) for p, n in spans for o in range(0, n, FAULT_CHUNK)]
    threads = max(1, min(16, len(os.sched_getaffinity(0)), len(parts)))
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda part: ctypes.memset(part[0], 0, part[1]), parts))


class PinnedRows:
    """One layer's pinned, device-mapped host rows: anonymous memory (``map_anonymous``)
    registered with CUDA as mapped and portable. ``cuda()`` is the CUDA-typed view kernels use;
    ``cpu()`` a CPU view of the same bytes. Both, and any view of them, keep this object (and so
    the memory) alive.
    ``ptr``: ``nbytes`` the caller mapped and faulted in (``allocate_host_rows``), which this
    object then owns; 0: mapped and faulted in here."""

    def __init__(self, n_tokens: int, row_bytes: int, device: torch.device, ptr: int = 0):
        self.shape = (n_tokens, row_bytes)
        self.nbytes = n_tokens * row_bytes
        self.device = device
        self.ptr = 0  # registered: unregistered by __del__
        # NOTE: owned before anything else can raise (the import included): unmapped by
        # __del__, registered or not
        self._mapped = ptr
        if not ptr:
            self._mapped = ptr = map_anonymous(self.nbytes)
            fault_in([(ptr, self.nbytes)])
        from cuda.bindings import runtime as cudart  # lazily: only CUDA machines need it

        self._cudart = cudart
        flags = cudart.cudaHostRegisterMapped | cudart.cudaHostRegisterPortable
        with torch.cuda.device(device):
            (err,) = cudart.cudaHostRegister(ptr, self.nbytes, flags)
            if err != cudart.cudaError_t.cudaSuccess:
                raise ValueError(
                    f"host KV pool: pinning {self.nbytes} bytes ({self.nbytes / 2**30:.2f} GiB) "
                    f"(cudaHostRegister) failed: {err}; lower host_tokens (--host-tokens)"
                )
            self.ptr = ptr
            err, dptr = cudart.cudaHostGetDevicePointer(self.ptr, 0)
            if err != cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaHostGetDevicePointer failed: {err}")
        self.dptr = int(dptr)
        # Read by torch.as_tensor(self, device="cuda"); torch keeps a reference to self.
        self.__cuda_array_interface__ = {
            "shape": self.shape,
            "typestr": "|u1",
            "data": (self.dptr, False),
            "strides": None,
            "version": 3,
        }

    def cuda(self) -> torch.Tensor:
        return torch.as_tensor(self, device=self.device)

    def cpu(self) -> torch.Tensor:
        buf = (ctypes.c_uint8 * self.nbytes).from_address(self._mapped)
        # NOTE: on the buffer, which the tensor's storage holds, so every view of this tensor
        # (a slice, a reshape) keeps the allocation alive; an attribute of the tensor would go
        # with the tensor while a view of it still reads the unmapped memory
        buf._echo_pinned_owner = self
        return torch.frombuffer(buf, dtype=torch.uint8).view(self.shape)

    def __del__(self) -> None:
        if getattr(self, "ptr", 0):
            self._cudart.cudaHostUnregister(self.ptr)
            self.ptr = 0
        if getattr(self, "_mapped", 0):
            unmap(self._mapped, self.nbytes)
            self._mapped = 0


def allocate_host_rows(
    num_layers: int, n_tokens: int, row_bytes: int, device: torch.device, pinned: bool
) -> list[torch.Tensor]:
    """``num_layers`` separate zeroed uint8 ``[n_tokens, row_bytes]`` tensors (see the module
    docstring). Pinned ones are mapped first, every layer's pages faulted in by one pool of
    threads, then registered a layer at a time."""
    device = torch.device(device)
    check_host_rows(num_layers, n_tokens, row_bytes, device, pinned)
    if device.type != "cuda":
        return [torch.zeros(n_tokens, row_bytes, dtype=torch.uint8) for _ in range(num_layers)]
    if not pinned:
        return [
            torch.zeros(n_tokens, row_bytes, dtype=torch.uint8, device=device)
            for _ in range(num_layers)
        ]
    nbytes = n_tokens * row_bytes
    t0 = time.perf_counter()
    ptrs: list[int] = []
    try:
        ptrs.extend(map_anonymous(nbytes) for _ in range(num_layers))
        fault_in([(p, nbytes) for p in ptrs])
        rows = []
        while ptrs:  # each PinnedRows owns its mapping from here on
            rows.append(PinnedRows(n_tokens, row_bytes, device, ptrs.pop(0)))
    finally:
        for p in ptrs:
            unmap(p, nbytes)
    logger.info(
        "host KV pool: %d layers x %d rows x %d B = %.1f GiB pinned in %.1f s",
        num_layers, n_tokens, row_bytes, num_layers * nbytes / 2**30, time.perf_counter() - t0,
    )  # fmt: skip
    return [r.cuda() for r in rows]


def check_host_rows(
    num_layers: int, n_tokens: int, row_bytes: int, device: torch.device, pinned: bool
) -> None:
    """``allocate_host_rows``'s refusal, which ``LLM`` also runs before it reads a weight: a
    ValueError with the byte count when the rows cannot fit the memory they would live in (the
    host's, or the GPU's free memory for the GPU-only pool)."""
    device = torch.device(device)
    if device.type == "cuda" and not pinned:
        free, _ = torch.cuda.mem_get_info(device)
        _check_size(num_layers, n_tokens, row_bytes, free, f"{device} (free memory)")
    else:
        _check_size(num_layers, n_tokens, row_bytes, _host_memory_limit(), "this machine")
