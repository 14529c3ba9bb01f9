"""How long the pinned host KV pool takes to set up at serving sizes (CUDA only), by phase and by
way of doing each phase, side by side in one run:

    python -m benchmarks.bench_host_pool --gib 8,32 --out $OUT/host_pool.json

For each total size (spread over ``--layers`` layers of ``--row-bytes`` rows, as the engine
allocates it: one ``cudaHostAlloc`` a layer, custom_ops/cache/host_pool.py):
- ``alloc_serial_s`` / ``alloc_threads_s``: the allocations alone (``zero=False``), one after
  another, then the same from ``--threads`` threads (whether the driver's pinning runs in parallel);
- ``zero_memset_s``: clearing them with one ``memset`` a layer on one thread (the engine's way);
  ``zero_memset_threads_s``: the same memsets from ``--threads`` threads; ``zero_gpu_s``: the GPU
  writing zeros through the mapped pointers (``.zero_()`` on each layer's CUDA view);
- ``fresh_all_zero``: whether the memory was already all zero before any clearing (what the
  driver hands out; not a documented guarantee);
- ``free_s``: giving it back;
- ``reg_{4k,huge}_*``: the other way to pin: anonymous memory (``huge``: transparent huge pages,
  madvise) faulted in and cleared from ``--threads`` threads (``map_touch``), then
  ``cudaHostRegister``ed a layer at a time (``register``), and again from the threads at once.
Wall-clock seconds (these are host-side setup costs, not kernels), one round per size.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from custom_ops.cache.host_pool import PinnedRows, _host_memory_limit


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def one_size(gib: float, layers: int, row_bytes: int, threads: int, dev: torch.device) -> dict:
    rows = int(gib * 2**30 / layers / row_bytes)
    res: dict = {"gib": gib, "layers": layers, "rows_per_layer": rows, "row_bytes": row_bytes}
    total = layers * rows * row_bytes
    res["bytes"] = total
    pool: list[PinnedRows] = []
    res["alloc_serial_s"] = _timed(
        lambda: pool.extend(PinnedRows(rows, row_bytes, dev, zero=False) for _ in range(layers))
    )
    views = [p.cuda() for p in pool]
    res["fresh_all_zero"] = all(not bool(v.any()) for v in views)
    res["zero_memset_s"] = _timed(lambda: [ctypes.memset(p.ptr, 0, p.nbytes) for p in pool])
    with ThreadPoolExecutor(threads) as ex:
        res["zero_memset_threads_s"] = _timed(
            lambda: list(ex.map(lambda p: ctypes.memset(p.ptr, 0, p.nbytes), pool))
        )
    res["zero_gpu_s"] = _timed(lambda: [v.zero_() for v in views])
    views.clear()
    res["free_s"] = _timed(lambda: (pool.clear(), gc.collect()))
    with ThreadPoolExecutor(threads) as ex:
        res["alloc_threads_s"] = _timed(
            lambda: pool.extend(
                ex.map(lambda _: PinnedRows(rows, row_bytes, dev, zero=False), range(layers))
            )
        )
    pool.clear()
    gc.collect()
    for huge in (False, True):
        res |= registered(layers, rows * row_bytes, huge, threads)
    for k in [k for k in res if k.endswith("_s")]:
        res[k[:-2] + "_GBps"] = total / res[k] / 1e9
    return res


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]  # fmt: skip
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_RW, MAP_PRIVATE_ANON, MADV_HUGEPAGE = 0x3, 0x22, 14
CHUNK = 256 << 20


def registered(layers: int, nbytes: int, huge: bool, threads: int) -> dict:
    """The other way to pin: anonymous memory (transparent huge pages when ``huge``) faulted in
    and cleared by ``threads`` threads, then ``cudaHostRegister``ed (mapped, portable), a layer
    at a time; then registered from ``threads`` threads at once."""
    from cuda.bindings import runtime as cudart

    flags = cudart.cudaHostRegisterMapped | cudart.cudaHostRegisterPortable
    tag = "huge" if huge else "4k"
    res: dict = {}
    ptrs: list[int] = []

    def mapped() -> None:
        for _ in range(layers):
            ptr = _libc.mmap(None, nbytes, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
            if ptr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap failed")
            if huge:
                _libc.madvise(ptr, nbytes, MADV_HUGEPAGE)
            ptrs.append(ptr)

    def touched(ex: ThreadPoolExecutor) -> None:
        spans = [(p, o) for p in ptrs for o in range(0, nbytes, CHUNK)]
        list(ex.map(lambda s: ctypes.memset(s[0] + s[1], 0, min(CHUNK, nbytes - s[1])), spans))

    def register(p: int) -> None:
        (err,) = cudart.cudaHostRegister(p, nbytes, flags)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaHostRegister: {err}")

    def unregister_all() -> None:
        for p in ptrs:
            cudart.cudaHostUnregister(p)

    with ThreadPoolExecutor(threads) as ex:
        res[f"reg_{tag}_map_touch_s"] = _timed(lambda: (mapped(), touched(ex)))
        res[f"reg_{tag}_register_s"] = _timed(lambda: [register(p) for p in ptrs])
        res[f"reg_{tag}_unregister_s"] = _timed(unregister_all)
        res[f"reg_{tag}_register_threads_s"] = _timed(lambda: list(ex.map(register, ptrs)))
    unregister_all()
    for p in ptrs:
        _libc.munmap(p, nbytes)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", default="8,32", help="total pool sizes, GiB, comma-separated")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--row-bytes", type=int, default=656, help="656: an fp8 row; 1152: bf16")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/host_pool.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_pool: needs a CUDA device (pinned, device-mapped memory)")
    dev = torch.device("cuda")
    torch.cuda.init()
    limit = _host_memory_limit()
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = None
    out = {
        "transparent_hugepage": thp,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host_memory_limit_bytes": limit,
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "threads": a.threads,
        "sizes": [],
    }
    for gib in (float(x) for x in a.gib.split(",")):
        if gib * 2**30 > 0.6 * limit:
            print(f"skip {gib} GiB: over 60% of the host memory limit ({limit / 2**30:.0f} GiB)")
            continue
        r = one_size(gib, a.layers, a.row_bytes, a.threads, dev)
        print(json.dumps(r), flush=True)
        out["sizes"].append(r)
        with open(a.out, "w") as f:  # after every size: a cut-short run keeps what finished
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
