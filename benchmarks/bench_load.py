"""Does reading a checkpoint's shards in reader threads load it faster than one after another?

    python -m benchmarks.bench_load [--shards 8] [--shard-mb 384] [--threads 2,4] [--reps 3]

Writes a synthetic checkpoint in a temporary directory (removed after): ``--shards`` safetensors
files of ``--shard-mb`` MB each, V3.2-like tensors (bf16 [2048, 7168] expert-sized weights, each
with a small fp32 scale), then reads every tensor into a preallocated destination, as
``model.loader.load_weights`` does (``safe_open(...).get_tensor``, then ``copy_``):
- serial: shard after shard, tensor after tensor (the loader);
- willneed: serial, the kernel first asked to read every file ahead (``POSIX_FADV_WILLNEED``);
- threads=N: N reader threads each read whole shards ahead into memory (``get_tensor`` then
  ``clone``: ``get_tensor`` alone maps the file, reading nothing), the main thread copying them in
  the serial order (what a read-ahead loader would do; checks and errors in order);
- warm_read_only: ``get_tensor`` alone, in 1 thread and in one per CPU (does it release the GIL?).
Each way is timed cold, the files dropped from the page cache first (``fsync`` then
``posix_fadvise(DONTNEED)``: no root needed, unlike drop_caches; what is left cached is not
measured here, only the times), and warm (the files cached), the median of ``--reps``. GB/s are
1e9 bytes of tensors a second. NOTE: a weak proxy for a GPU host's NVMe or network disk: one
virtual disk here, and the CPU count bounds what threads can overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SHAPE = (2048, 7168)  # a V3.2 expert's gate/up projection (bf16: 29.4 MB)
SCALE = (16, 56)  # its 128x128 block scales


def make_shards(out: Path, shards: int, shard_mb: int) -> list[Path]:
    per = max(1, shard_mb * 10**6 // (SHAPE[0] * SHAPE[1] * 2))
    files = []
    g = torch.Generator().manual_seed(0)
    for s in range(shards):
        ts = {}
        for i in range(per):
            ts[f"l{s}.e{i}.weight"] = torch.randn(SHAPE, generator=g).to(torch.bfloat16)
            ts[f"l{s}.e{i}.weight_scale_inv"] = torch.rand(SCALE, generator=g)
        f = out / f"model-{s:05d}.safetensors"
        save_file(ts, str(f))
        files.append(f)
    return files


def drop_cached(files: list[Path]) -> None:
    """Evict the files' pages from the page cache (clean pages only: fsync first)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_shard(f: Path, clone: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The shard's tensors; ``clone``: read into memory of their own (NOTE: ``get_tensor`` maps
    the file and reads nothing yet, warm_read_only below: the pages are read where the tensor is
    first used, the loader's ``copy_``)."""
    with safe_open(str(f), framework="pt", device="cpu") as sf:
        return [(n, sf.get_tensor(n).clone() if clone else sf.get_tensor(n)) for n in sf.keys()]


def load_serial(files: list[Path], dest: dict[str, torch.Tensor]) -> int:
    n = 0
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                dest[name].copy_(t)
                n += t.nbytes
    return n


def load_threads(files: list[Path], dest: dict[str, torch.Tensor], threads: int) -> int:
    n = 0
    with ThreadPoolExecutor(threads) as pool:
        for fut in [pool.submit(read_shard, f, True) for f in files]:  # consumed in order
            for name, t in fut.result():
                dest[name].copy_(t)
                n += t.nbytes
    return n


def load_willneed(files: list[Path], dest: dict[str, torch.Tensor]) -> int:
    """``load_serial`` with the kernel asked to read every file ahead (``POSIX_FADV_WILLNEED``:
    its readahead runs while the loader copies, in no thread of ours)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
    return load_serial(files, dest)


def read_only(files: list[Path], threads: int) -> int:
    """Every tensor read, no copy: with the files cached, whether ``get_tensor`` runs in
    parallel threads at all (holding the GIL through its copy out of the mapping, it would not)."""
    with ThreadPoolExecutor(threads) as pool:
        return sum(t.nbytes for ts in pool.map(read_shard, files) for _, t in ts)


def timed(load: Callable[[], int], files: list[Path], cold: bool, reps: int) -> dict:
    secs = []
    for _ in range(reps):
        if cold:
            drop_cached(files)
        t0 = time.perf_counter()
        n = load()
        secs.append(time.perf_counter() - t0)
    s = statistics.median(secs)
    all_s = [round(x, 3) for x in secs]
    return {"s": round(s, 3), "gb_per_s": round(n / 1e9 / s, 3), "all_s": all_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--shard-mb", type=int, default=384)
    p.add_argument("--threads", default="2,4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the temporary checkpoint goes (/tmp)")
    p.add_argument("--out", default="benchmarks/results/load_cpu.json")
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_load_", dir=a.dir))
    try:
        files = make_shards(tmp, a.shards, a.shard_mb)
        dest = {}  # the model's parameters, as load_weights copies into them
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for n in sf.keys():
                    sl = sf.get_slice(n)
                    dtype = torch.float32 if sl.get_dtype() == "F32" else torch.bfloat16
                    dest[n] = torch.empty(sl.get_shape(), dtype=dtype)
        ways: dict[str, Callable[[], int]] = {
            "serial": lambda: load_serial(files, dest),
            "willneed": lambda: load_willneed(files, dest),
        }
        for k in map(int, a.threads.split(",")):
            ways[f"threads={k}"] = lambda k=k: load_threads(files, dest, k)
        res: dict = {
            "shards": a.shards,
            "gb": round(sum(f.stat().st_size for f in files) / 1e9, 3),
            "cold": {},
            "warm": {},
        }
        for way, load in ways.items():  # cold first: a warm run caches every file
            res["cold"][way] = timed(load, files, True, a.reps)
            print("cold", way, res["cold"][way], flush=True)
        for way, load in ways.items():
            load()  # (every file cached)
            res["warm"][way] = timed(load, files, False, a.reps)
            print("warm", way, res["warm"][way], flush=True)
        res["warm_read_only"] = {}
        for k in sorted({1, os.cpu_count() or 1}):
            res["warm_read_only"][f"threads={k}"] = timed(
                lambda k=k: read_only(files, k), files, False, a.reps
            )
            print("warm_read_only", k, res["warm_read_only"][f"threads={k}"], flush=True)
    finally:
        shutil.rmtree(tmp)
    res.update(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=f"{platform.machine()} {platform.processor() or platform.platform()}",
        cpus=os.cpu_count(),
        python=platform.python_version(),
        torch=torch.__version__,
    )
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
