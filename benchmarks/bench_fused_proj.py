"""MLA's two projections of the hidden state, ``q_a_proj`` (7168 -> 1536) and
``kv_a_proj_with_mqa`` (7168 -> 576), as two linears against one fused linear
(``model.fused_proj.fuse_linears``; as a candidate, the indexer's ``wk`` (7168 -> 128) a third
part), in each weights format as served (bf16 ``nn.Linear``,
``FP8Linear``, ``AWQLinear`` repacked by ``repack_awq_model``), at decode and prefill token counts.

    python -m benchmarks.bench_fused_proj --out $OUT/fused_proj_h200.json

Each graph runs R calls over R different weight copies (more bytes than the L2 holds, as in a
decode step where every layer has its own weights): ``parts_us`` is the parts called one after the
other (``N``: their widths), ``fused_us`` the fused module's one call, per layer, median over
replays (benchmarks.cuda_timer).
First it checks, per format and M, that the fused output's columns equal the parts' outputs within
the GEMMs' rounding (``rel_err``; ``bit_equal`` says whether they are identical).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from torch import nn

from benchmarks.bench_awq import copies_for, rel_err
from benchmarks.cuda_timer import Backend, graph_time
from model.awq import AWQLinear
from model.awq_convert import repack_awq_model
from model.fp8_weights import FP8Linear
from model.fused_proj import fuse_linears

D = 7168
# the linears fused: what the model serves (q_a_proj, kv_a_proj_with_mqa) and a candidate with
# the indexer's wk between them (whole 128-row blocks before the ragged 576, for FP8; AWQ
# checkpoints keep the indexer 16-bit, so not for AWQ)
VARIANTS = {"q_a+kv_a": (1536, 576), "q_a+wk+kv_a": (1536, 128, 576)}
FORMATS = ("bf16", "fp8", "awq")


def make_parts(fmt: str, d: int, outs: tuple[int, ...], device, gen) -> list[nn.Module]:
    """Random linears ``d -> out`` in ``fmt``, not yet repacked."""
    parts = []
    for n in outs:
        lin = nn.Linear(d, n, bias=False, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, d, generator=gen, device=device) * 0.02)
        if fmt == "fp8":
            lin = FP8Linear.from_linear(lin)
        elif fmt == "awq":
            lin = AWQLinear.from_linear(lin)
        parts.append(lin.requires_grad_(False))
    return parts


def layer(fmt: str, d: int, outs: tuple[int, ...], device, gen) -> tuple[list, nn.Module]:
    """One layer's separate linears and their fusion, both served as the model serves them."""
    parts = make_parts(fmt, d, outs, device, gen)
    fused = fuse_linears(parts)
    if fmt == "awq":  # after the fusion, as the loader does it
        repack_awq_model(nn.ModuleList([*parts, fused]))
    return parts, fused


def weight_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def check(parts, fused, x) -> dict:
    with torch.no_grad():
        each = torch.cat([p(x) for p in parts], -1).float()
        one = fused(x).float()
    err = rel_err(one, each)
    return {"rel_err": err, "bit_equal": bool(torch.equal(one, each)), "pass": err < 1e-2}


def bench(fmt: str, ms: list[int], d: int, outs: tuple[int, ...], reps: int, device,
          backend: Backend | None = None, copies: int | None = None) -> list[dict]:  # fmt: skip
    gen = torch.Generator(device).manual_seed(0)
    first = layer(fmt, d, outs, device, gen)
    nbytes = weight_bytes(first[1])
    r = copies or copies_for(nbytes)
    layers = [first] + [layer(fmt, d, outs, device, gen) for _ in range(r - 1)]
    rows = []
    for m in ms:
        x = torch.randn(m, d, generator=gen, device=device).bfloat16()
        row = {"format": fmt, "M": m, "K": d, "N": list(outs), "copies": r,
               "fused_weight_MB": nbytes / 1e6, **check(*first, x)}  # fmt: skip
        with torch.no_grad():
            parts = graph_time([lambda p=p, x=x: [q(x) for q in p] for p, _ in layers], reps,
                             backend=backend)  # fmt: skip
            one = graph_time([lambda f=f, x=x: f(x) for _, f in layers], reps, backend=backend)
        row |= {"parts_us": parts.median_us, "fused_us": one.median_us,
                "speedup": parts.median_us / one.median_us}  # fmt: skip
        rows.append(row)
        print(f"| {fmt} {list(outs)} | {m} | {row['parts_us']:.2f} | {row['fused_us']:.2f} | "
              f"{row['speedup']:.3f} | {row['rel_err']:.1e} {row['bit_equal']} |",
              flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/fused_proj_h200.json")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batches", default="1,4,16,64,128,1024")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    import triton

    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": "python -m benchmarks.bench_fused_proj "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "out"),  # fmt: skip
        "method": "CUDA graph of R layers' calls over distinct weights; per-layer median us",
        "rows": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print("| format [N] | M | parts us | fused us | speedup | rel_err, bit-equal |")
    print("|---|---|---|---|---|---|")
    ms = [int(b) for b in args.batches.split(",")]
    for variant in args.variants.split(","):
        for fmt in args.formats.split(","):
            if fmt == "awq" and len(VARIANTS[variant]) > 2:
                continue  # (the variants' comment)
            try:
                rows = bench(fmt, ms, D, VARIANTS[variant], args.reps, torch.device("cuda"))
                res["rows"] += [{"variant": variant, **r} for r in rows]
            except Exception as e:  # noqa: BLE001  (recorded; the others go on)
                res.setdefault("errors", []).append({"format": fmt, "error": repr(e)})
                print(f"{variant} {fmt}: {e!r}", flush=True)
            out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
