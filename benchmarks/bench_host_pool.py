"""How long the pinned host KV pool takes to set up at serving sizes (CUDA only), the ways side
by side in one run, and how fast the recall's row copy reads each way's memory:

    python -m benchmarks.bench_host_pool --gib 16,64 --out $OUT/host_pool.json

For each total size (spread over ``--layers`` layers of ``--row-bytes`` rows, a separate block a
layer as the engine allocates it), wall-clock seconds of:
- ``hostalloc``: ``cudaHostAlloc(Mapped | Portable)`` a layer, then one ``memset`` a layer on one
  thread (the way that custom_ops/cache/host_pool.py's own mapping replaces);
- ``served``: ``allocate_host_rows`` as it is (anonymous memory with transparent huge pages
  advised, faulted in by threads, ``cudaHostRegister``ed); ``served_4k``: the same with
  ``HUGE_PAGES`` off;
each with ``*_free_s`` (giving it back) and, for the served ways, ``*_all_zero`` (read by a
GPU kernel through the mapping). ``--copy-rows``: the recall's row copy (benchmarks/
bench_cache_ops.bench_copy: 2048 rows, CUDA graphs) from a layer of N_H rows allocated each way,
in alternating rounds, to see whether the way changes how fast the GPU reads it over PCIe.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import glob
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from custom_ops.cache import host_pool
from custom_ops.cache.host_pool import _host_memory_limit, allocate_host_rows


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


class HostAllocRows:
    """One layer pinned the way the engine did before: cudaHostAlloc, then memset."""

    def __init__(self, n_tokens: int, row_bytes: int):
        from cuda.bindings import runtime as cudart

        self._cudart, self.nbytes = cudart, n_tokens * row_bytes
        flags = cudart.cudaHostAllocMapped | cudart.cudaHostAllocPortable
        err, ptr = cudart.cudaHostAlloc(self.nbytes, flags)
        assert err == cudart.cudaError_t.cudaSuccess, err
        self.ptr = int(ptr)
        ctypes.memset(self.ptr, 0, self.nbytes)
        err, dptr = cudart.cudaHostGetDevicePointer(self.ptr, 0)
        shape = (n_tokens, row_bytes)
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1",
                                         "data": (int(dptr), False), "version": 3}  # fmt: skip

    def __del__(self) -> None:
        self._cudart.cudaFreeHost(self.ptr)


def hostalloc_layers(layers: int, rows: int, row_bytes: int) -> list[torch.Tensor]:
    return [torch.as_tensor(HostAllocRows(rows, row_bytes), device="cuda") for _ in range(layers)]


def served_layers(layers: int, rows: int, row_bytes: int, huge: bool) -> list[torch.Tensor]:
    host_pool.HUGE_PAGES = huge
    try:
        return allocate_host_rows(layers, rows, row_bytes, torch.device("cuda"), pinned=True)
    finally:
        host_pool.HUGE_PAGES = True


WAYS = {
    "hostalloc": hostalloc_layers,
    "served": lambda n, r, b: served_layers(n, r, b, True),
    "served_4k": lambda n, r, b: served_layers(n, r, b, False),
}


def one_size(gib: float, layers: int, row_bytes: int) -> dict:
    rows = int(gib * 2**30 / layers / row_bytes)
    total = layers * rows * row_bytes
    res: dict = {"gib": gib, "layers": layers, "rows_per_layer": rows, "row_bytes": row_bytes,
                 "bytes": total}  # fmt: skip
    for name, way in WAYS.items():
        res[f"{name}_s"], pool = _timed(lambda way=way: way(layers, rows, row_bytes))
        if name != "hostalloc":
            res[f"{name}_all_zero"] = all(not bool(t.any()) for t in pool)
        res[f"{name}_free_s"], _ = _timed(lambda pool=pool: (pool.clear(), gc.collect()))
        res[f"{name}_GBps"] = total / res[f"{name}_s"] / 1e9
    return res


def copy_rows(row_bytes: int, reps: int, rounds: int) -> dict:
    """The ways' copies in ``rounds`` alternating rounds (a fresh allocation each time), each
    round's figures kept, and the median of the gather kernel's per way."""
    from benchmarks import bench_cache_ops as bc

    out: dict = {name: {"rounds": []} for name in WAYS}
    for _ in range(rounds):
        for name, way in WAYS.items():
            (host,) = way(1, bc.N_H, row_bytes)
            host.random_(0, 256)
            r = bc.bench_copy(host, 2048, 8, torch.Generator().manual_seed(0), reps)
            out[name]["rounds"].append(r)
            del host
            gc.collect()
    for name in WAYS:
        us = statistics.median(r["gather_kernel_us"] for r in out[name]["rounds"])
        out[name]["gather_kernel_us_median"] = us
        out[name]["gather_kernel_GBps_median"] = out[name]["rounds"][0]["bytes"] / (us * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", default="16,64", help="total pool sizes, GiB, comma-separated")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--row-bytes", type=int, default=656, help="656: an fp8 row; 1152: bf16")
    ap.add_argument("--copy-rows", action="store_true", help="also time the recall's row copy")
    ap.add_argument("--copy-rounds", type=int, default=3, help="alternating rounds of the copies")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/host_pool.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_pool: needs a CUDA device (pinned, device-mapped memory)")
    torch.cuda.init()
    limit = _host_memory_limit()
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = None
    out: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host_memory_limit_bytes": limit,
        "cpus": len(os.sched_getaffinity(0)),
        "transparent_hugepage": thp,
        "numa_nodes": len(glob.glob("/sys/devices/system/node/node[0-9]*")),
        "sizes": [],
    }

    def save() -> None:  # after every part: a cut-short run keeps what finished
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)

    for gib in (float(x) for x in a.gib.split(",") if x):
        if gib * 2**30 > 0.6 * limit:
            print(f"skip {gib} GiB: over 60% of the host memory limit ({limit / 2**30:.0f} GiB)")
            continue
        out["sizes"].append(one_size(gib, a.layers, a.row_bytes))
        print(json.dumps(out["sizes"][-1]), flush=True)
        save()
    if a.copy_rows:
        out["copy_2048_rows"] = copy_rows(a.row_bytes, a.reps, a.copy_rounds)
        print(json.dumps(out["copy_2048_rows"]), flush=True)
        save()


if __name__ == "__main__":
    main()
