"""awq_pairs_h200.json: W4A16 linear speed over bf16 by batch size (the pair kernel, tinygemm,
fbgemm, the former AutoAWQ-layout kernel), with issue 17's targets. The file's MoE rows predate
the MoE as served now; its figure is awq_moe.py's, from awq_parts_h200.json."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.plots.common import C_BASE, C_BEST, batch_axes, finish_grid, plt

LINEAR_TARGET = [(1, 16, 2.5), (128, 128, 1.0)]  # (M from, M to, x bf16)
MOE_TARGET = (1, 64, 2.0)


def _x(rs: list[dict], col: str) -> list[float]:
    return [r["bf16_us"] / r[col] if r.get(col) and not math.isnan(r[col]) else math.nan
            for r in rs]  # fmt: skip


def plot_awq_pairs(d: dict, out: Path, written: list[Path]) -> None:
    lin = d.get("linear", [])
    shapes = list(dict.fromkeys((r["in"], r["out"]) for r in lin))
    if not shapes:
        print("skip: awq_pairs: no measurements")
        return
    ncol = min(3, len(shapes))
    nrow = math.ceil(len(shapes) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.4 * ncol, 2.8 * nrow), squeeze=False)
    for ax, key in zip(axes.flat, shapes, strict=False):
        rs = sorted((r for r in lin if (r["in"], r["out"]) == key), key=lambda r: r["M"])
        xs = [r["M"] for r in rs]
        ax.plot(xs, _x(rs, "pair_us"), "o-", color=C_BEST, ms=3, label="pair kernel")
        for col, style, label in (("tinygemm_us", "v:", "tinygemm"),
                                  ("fbgemm_us", "d:", "fbgemm CUTLASS"),
                                  ("former_us", "x:", "former (AutoAWQ layout)")):  # fmt: skip
            ax.plot(xs, _x(rs, col), style, color="#888", ms=3, label=label)
        for lo, hi, t in LINEAR_TARGET:
            ax.hlines(t, lo, hi, colors="red", linestyles="--", lw=1)
        ax.set_title(f"linear {key[0]}->{key[1]}", fontsize=9)
        ax.set_xlabel("batch M (tokens)", fontsize=8)
        ax.axhline(1.0, color=C_BASE, lw=1)
        batch_axes(ax, xs, "x bf16 (higher is faster)")
    title = "AWQ W4A16 linear speed over bf16 (red: issue 17's targets)"
    name = "awq_pairs_vs_bf16.png"
    finish_grid(fig, axes, len(shapes), title, d, "awq_pairs_h200.json", out, name, written)
