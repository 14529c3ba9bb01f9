"""Does the prefill attention kernel's time depend on how much the queries' selections overlap?

    python -m benchmarks.bench_prefill_overlap --out $OUT/prefill_overlap_h200.json

Issue 14 asks for the selected rows to be read once per query block where queries share them.
``echo::sparse_mla_prefill``'s kernel (custom_ops/prefill_attn_kernels.py) reads each query's
rows itself; rows that neighbouring queries share come from L2 if the programs that need them
run close together. This measures what sharing is worth to that kernel: the same shapes (a
``--chunk``-query chunk, 128 heads, top-``--topk`` of a ``--ctx`` context, bf16 and fp8 rows),
three selections, the median of CUDA-graph replays of the default configuration:
- ``shared``: every query selects the same ``topk`` rows (all reuse: one query block's rows);
- ``sliding``: query i selects ``topk`` rows from a window that moves by one position per query
  (neighbours share all but one row; the whole chunk reads ``topk + chunk`` distinct rows);
- ``independent``: every query its own random ``topk`` rows of the context (neighbours share
  ``topk^2 / ctx`` rows on average: the least reuse).
If ``shared`` is not faster than ``independent``, reading shared rows once (in registers or
shared memory, across queries) cannot make the kernel faster: its time is then the per-query
math and gathers, not the rows' traffic from memory.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import torch

from benchmarks.cuda_timer import graph_time
from custom_ops import prefill_attn_kernels as pa
from custom_ops.kv_format import KV_LORA, ROPE, pack_kv_rows


def selections(kind: str, T: int, K: int, L: int, gen: torch.Generator) -> torch.Tensor:
    """[T, K] int32 positions, ascending per row, on ``gen``'s device."""
    dev = gen.device
    if kind == "shared":
        one = torch.randperm(L, generator=gen, device=dev)[:K].sort().values
        sel = one.expand(T, K)
    elif kind == "sliding":
        start = int(torch.randint(0, L - K - T, (1,), generator=gen, device=dev))
        sel = start + torch.arange(T, device=dev)[:, None] + torch.arange(K, device=dev)[None, :]
    else:
        r = torch.rand(T, L, generator=gen, device=dev)
        sel = torch.argsort(r, dim=1)[:, :K].sort(dim=1).values
    return sel.to(torch.int32).contiguous()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/prefill_overlap_h200.json")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--replays", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_prefill_overlap: needs a CUDA device")
        return 1
    import triton

    dev, T, K, L, H = "cuda", args.chunk, args.topk, args.ctx, args.heads
    gen = torch.Generator().manual_seed(0)
    res: dict = {
        "environment": {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        },
        "command": "python -m benchmarks.bench_prefill_overlap " + " ".join(argv or []),
        "shape": {"chunk": T, "heads": H, "topk": K, "ctx": L},
        "config": repr(pa.PrefillAttnConfig()),
        "ms": {},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    q = (torch.randn(T, H, KV_LORA + ROPE, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    flops = 2 * T * H * K * (KV_LORA + ROPE + KV_LORA)
    c_kv = torch.randn(L, KV_LORA, generator=gen) * 0.5
    k_pe = torch.randn(L, ROPE, generator=gen) * 0.5
    for fmt in ("bf16", "fp8"):
        rows = pack_kv_rows(c_kv, k_pe, fmt).to(dev)
        dgen = torch.Generator(device=dev).manual_seed(1)
        for kind in ("shared", "sliding", "independent"):
            sel = selections(kind, T, K, L, dgen)
            t = (
                graph_time(
                    [lambda s=sel, r=rows, f=fmt: pa.sparse_mla_prefill_attn(q, r, s, 0.1352, f)],
                    args.replays,
                ).median_us
                / 1e3
            )
            res["ms"][f"{fmt}_{kind}"] = t
            print(f"{fmt} {kind}: {t:.3f} ms ({flops / t / 1e9:.0f} TFLOP/s)", flush=True)
            out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
