"""What the bench model's indexer scores look like in decode, layer by layer.

    python benchmarks/score_stats.py --ctx 90000 --out benchmarks/results/score_stats_h200.json

One request of ``--ctx`` tokens is injected (as ``echo-compile bench`` does, random KV) and
``--steps`` eager decode steps run. Every indexer call's scores are summarised: NaN and infinite
counts, distinct values, the k-th largest score, how many scores equal it (exact ties) and how many
share its top 16 key bits (the candidates of a radix select after two 8-bit passes). The top-k
kernels' cost must not depend on these; this shows what real inputs give them. Without a GPU it
runs through the Triton interpreter (use ``--preset tiny`` and a short ``--ctx`` there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # read when the kernels are defined, so before importing them
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from custom_ops import indexer_kernels as ik  # noqa: E402
from echo_compile.bench import System, Workload, build_model, environment  # noqa: E402


def summarise(scores: torch.Tensor, seq_lens: torch.Tensor, topk: int) -> list[dict]:
    out = []
    for b in range(scores.shape[0]):
        n = int(seq_lens[b])
        if n == 0:
            continue
        s = scores[b, :n].float()
        k = min(topk, n)
        kth = s.sort(descending=True).values[k - 1]  # NaN sorts first: it counts as largest
        bits = s.view(torch.int32)
        key = torch.where((bits & 0x7FFFFFFF) == 0, 0, bits)
        key = key ^ ((key >> 31) & 0x7FFFFFFF)
        kth_key = key[(s == kth) | (s.isnan() & kth.isnan())][:1]
        out.append(
            {
                "len": n,
                "nan": int(s.isnan().sum()),
                "inf": int(s.isinf().sum()),
                "distinct": int(s.unique().numel()),
                "kth": float(kth),
                "ties_at_kth": int((s == kth).sum()) if not kth.isnan() else int(s.isnan().sum()),
                "share_top16_bits": int(((key >> 16) == (kth_key >> 16)).sum()),
                "min": float(s.nan_to_num().min()),
                "max": float(s.nan_to_num().max()),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=("bench", "tiny"), default="bench")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=90000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeat", type=float, default=1.0, help="selection locality (see bench)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results/score_stats_h200.json")
    a = ap.parse_args(argv)

    model = build_model(a.preset, a.layers, 16, a.device)
    calls: list[dict] = []
    real = ik.indexer_topk_cuda

    def spy(q_u8, weights, index_cache, block_table, seq_lens, topk, cfg=None):
        scores = ik.index_scores(
            q_u8, weights, index_cache, block_table, seq_lens, ik.IndexerConfig()
        )
        calls.append({"call": len(calls), "rows": summarise(scores, seq_lens, topk)})
        return real(q_u8, weights, index_cache, block_table, seq_lens, topk, cfg)

    per_req = -(-(a.ctx + a.steps + 64) // 64) * 64
    sut = System(
        model,
        "offload-eager",
        max(per_req, 4096),
        per_req,
        "fp8",
        per_req,
        1,
        (),
        a.device,
        a.repeat,
    )
    import custom_ops.indexer as ix

    ref = ix.indexer_topk_ref
    if a.device != "cuda":  # the op runs its torch reference on CPU: call the kernels instead
        ix.indexer_topk_ref = lambda *args: spy(*args)
    ik.indexer_topk_cuda = spy
    try:
        sut.run(Workload(requests=1, min_ctx=a.ctx, max_ctx=a.ctx, output_len=a.steps))
    finally:
        ik.indexer_topk_cuda, ix.indexer_topk_ref = real, ref
    layers = model.config.num_hidden_layers
    for c in calls:
        c["layer"] = c["call"] % layers
    out = {"environment": environment(), "ctx": a.ctx, "steps": a.steps, "calls": calls}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    for c in calls:
        for r in c["rows"]:
            print(
                f"layer {c['layer']} len {r['len']:6d}: nan {r['nan']} inf {r['inf']} "
                f"distinct {r['distinct']} kth {r['kth']:.4g} ties {r['ties_at_kth']} "
                f"share16 {r['share_top16_bits']} range [{r['min']:.3g}, {r['max']:.3g}]"
            )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
