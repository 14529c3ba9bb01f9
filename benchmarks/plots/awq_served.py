"""awq_served_h200.json (``bench_awq_pairs --no-sweeps``): the AWQ linear as ``AWQLinear`` serves
it, over bf16, from decode batches to prefill chunks, with tinygemm and the best SCALED wide tile
beside it and issue 17's targets."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.plots.awq_pairs import LINEAR_TARGET
from benchmarks.plots.common import C_BASE, C_BEST, batch_axes, finish_grid, plt


def _ratio(bf16: float, us: float | None) -> float:
    return bf16 / us if us and not math.isnan(us) else math.nan


def plot_awq_served(d: dict, out: Path, written: list[Path]) -> None:
    lin, pre = d.get("linear", []), d.get("prefill", [])
    shapes = list(dict.fromkeys((r["in"], r["out"]) for r in lin + pre))
    if not shapes:
        print("skip: awq_served: no measurements")
        return
    ncol = min(2, len(shapes))
    nrow = math.ceil(len(shapes) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 2.9 * nrow), squeeze=False)
    for ax, key in zip(axes.flat, shapes, strict=False):
        rl = sorted((r for r in lin if (r["in"], r["out"]) == key), key=lambda r: r["M"])
        rp = sorted((r for r in pre if (r["in"], r["out"]) == key), key=lambda r: r["M"])
        xs = [r["M"] for r in rl + rp]
        served = [_ratio(r["bf16_us"], r["served_us"]) for r in rl]
        served += [_ratio(r["bf16_us"], r["dequant_mm_us"]) for r in rp]
        ax.plot(xs, served, "o-", color=C_BEST, ms=3, label="served")
        ax.plot([r["M"] for r in rl], [_ratio(r["bf16_us"], r["tinygemm_us"]) for r in rl], "v:",
                color="#888", ms=3, label="tinygemm")  # fmt: skip
        ax.plot([r["M"] for r in rp], [_ratio(r["bf16_us"], r["scaled_best_us"]) for r in rp],
                "s:", color="#888", ms=3, label="SCALED wide tile")  # fmt: skip
        for lo, hi, t in LINEAR_TARGET:
            ax.hlines(t, lo, hi, colors="red", linestyles="--", lw=1)
        ax.set_title(f"linear {key[0]}->{key[1]}", fontsize=9)
        ax.set_xlabel("tokens M (from 256: dequantised + cuBLAS)", fontsize=8)
        ax.axhline(1.0, color=C_BASE, lw=1)
        batch_axes(ax, xs, "x bf16 (higher is faster)")
        ax.tick_params(axis="x", labelrotation=60)
    title = "AWQ W4A16 linear as served, over bf16 (red: issue 17's targets)"
    finish_grid(fig, axes, len(shapes), title, d, "awq_served_h200.json", out,
                "awq_served_vs_bf16.png", written)  # fmt: skip
