"""Does the recall gather's bandwidth depend on where the host rows start? (issue 18)

    python -m benchmarks.bench_row_stride --out benchmarks/results/row_stride_h200.json

An fp8 KV row is 656 bytes (kv_format.py): at that stride most rows start 16 bytes into a
128-byte line and span six lines (768 bytes read for 656), while a 1152-byte bf16 row is nine
whole lines. This times the recall's gather kernel (``bench_cache_ops.bench_copy``: 2048 and
65,536 random rows of a 2M-row pinned host pool, CUDA graphs, the default copy configuration)
at row widths 640-1152 bytes and reports each as the time per row and as the bandwidth of the
656 bytes an fp8 row holds. If a padded width (672 = 21 x 32 B sectors, 704, 768 = 6 lines)
moves 2048 rows faster than 656 does, padding the host pool's rows would raise the fp8 recall's
useful bandwidth by that much, at (width - 656) / 656 more host memory per row. Widths 640 and
16 time the other layout that would align the rows at no memory cost: the 16 bytes of scales in
a host array of their own beside 640-byte rows (c_kv and k_pe, five whole lines); the sum of the
two gathers' times bounds one kernel that reads both.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton

from benchmarks.bench_cache_ops import DEV, N_H, bench_copy
from custom_ops.cache.host_pool import allocate_host_rows

FP8_ROW = 656
WIDTHS = (16, 640, 656, 672, 704, 768, 1152)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/row_stride_h200.json")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--rows", default="2048,65536")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(1234)
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host_rows": N_H,
        "method": "bench_cache_ops.bench_copy at each row width: median over replays of a CUDA "
        "graph of 8 gathers of distinct random rows, L2 flushed before each replay",
        "runs": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print("| width B | rows | gather us | ns/row | GB/s moved | GB/s of 656 B | memcpy GB/s |")
    print("|---|---|---|---|---|---|---|")
    for w in map(int, args.widths.split(",")):
        host = allocate_host_rows(1, N_H, w, DEV, pinned=True)[0]  # device-mapped, as served
        host.random_(0, 256)
        for n in map(int, args.rows.split(",")):
            r = bench_copy(host, n, 8, gen, args.reps)
            us = r["gather_kernel_us"]
            row = {
                "width": w,
                "rows": n,
                "gather_us": us,
                "ns_per_row": us * 1e3 / n,
                "GBps_moved": r["gather_kernel_GBps"],
                "GBps_of_fp8_row": n * FP8_ROW / (us * 1e3),
                "memcpy_GBps": r["memcpy_async_GBps"],
                "check": r["gather_kernel_check"],
            }
            res["runs"].append(row)
            out.write_text(json.dumps(res, indent=2))
            print(f"| {w} | {n} | {us:.2f} | {row['ns_per_row']:.2f} | {row['GBps_moved']:.1f} "
                  f"| {row['GBps_of_fp8_row']:.1f} | {row['memcpy_GBps']:.1f} | {row['check']}",
                  flush=True)  # fmt: skip
        del host


if __name__ == "__main__":
    main()
