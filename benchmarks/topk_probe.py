"""The exact top-k selection, another version of it against the current one, on the same scores.

    git show 3910879:custom_ops/indexer_kernels.py > ik_v1.py   # the one-program resolve
    python benchmarks/topk_probe.py --old ik_v1.py --out benchmarks/results/topk_probe_h200.json

For each batch B and live length, fp32 scores drawn from N(0, 1) (the shape of the bench model's
scores: ~50 of 90K share the k-th score's top 16 bits, ``score_stats_h200.json``) are selected by
both versions' ``topk_from_scores`` with their default configs; both results are checked against
the reference (``torch.equal``) and timed (median CUDA-graph replay of 20 calls).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":  # a smoke run through the Triton interpreter (no timings); before the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_decode_kernels import graph_time_us  # noqa: E402
from test_decode_kernels import select_ref  # noqa: E402

from custom_ops import indexer_kernels as new  # noqa: E402
from echo_compile.bench import environment  # noqa: E402

TOPK = 2048


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--old", type=Path, required=True, help="an indexer_kernels.py to compare")
    ap.add_argument("--batches", default="1,2,4,16,64")
    ap.add_argument("--lens", default="32768,90000")
    ap.add_argument("--pages", type=int, default=1563, help="block-table width (1563: 100,032)")
    ap.add_argument("--out", default="benchmarks/results/topk_probe_h200.json")
    a = ap.parse_args(argv)
    spec = importlib.util.spec_from_file_location("ik_old", a.old)
    old = sys.modules["ik_old"] = importlib.util.module_from_spec(spec)  # (its dataclass needs it)
    spec.loader.exec_module(old)
    P = a.pages
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        for n in [int(x) for x in a.lens.split(",")]:
            scores = torch.randn(b, P * 64, generator=gen, device=DEV)
            bt = torch.arange(b * P, dtype=torch.int32, device=DEV).view(b, P)
            lens = torch.full((b,), n, dtype=torch.int32, device=DEV)
            want = select_ref(scores, bt, lens, TOPK)
            chunks = new._chunking(b, P * 64, new.IndexerConfig(), torch.device(DEV))
            row = {"B": b, "len": n, "chunks": chunks}
            for name, mod in (("old", old), ("new", new)):
                call = functools.partial(
                    mod.topk_from_scores, scores, bt, lens, TOPK, mod.IndexerConfig()
                )
                host, kth = call()
                row[f"{name}_exact"] = bool(
                    torch.equal(host, want[0]) and torch.equal(kth, want[1])
                )
                row[f"{name}_us"] = graph_time_us(call, 20) if DEV == "cuda" else None
            rows.append(row)
            print(row, flush=True)
    out = {"environment": environment(), "old": str(a.old), "topk": TOPK, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
