"""awq_parts_h200.json: the 256-expert fused int4 MoE's speed over the bf16 grouped MoE by token
count, medians of alternating rounds with their range, with issue 17's target."""

from __future__ import annotations

from pathlib import Path

from benchmarks.plots.awq_pairs import MOE_TARGET
from benchmarks.plots.common import C_BASE, C_BEST, batch_axes, finish_grid, plt


def plot_awq_moe(d: dict, out: Path, written: list[Path]) -> None:
    rs = sorted((r for r in d.get("moe", []) if "ab_rounds" in r), key=lambda r: r["T"])
    if not rs:
        print("skip: awq_parts: no alternating rounds")
        return
    fig, axes = plt.subplots(1, 1, figsize=(4.6, 3.0), squeeze=False)
    ax = axes[0, 0]
    xs = [r["T"] for r in rs]
    # the served pair MoE only: its "pair_separate_sum" column is the same code wherever the
    # served rule already takes the separate sum (above one token)
    bf = [r["ab_median_us"]["bf16"] for r in rs]
    med = [b / r["ab_median_us"]["pair"] for b, r in zip(bf, rs)]
    lo = [m - b / max(r["ab_rounds"]["pair"]) for m, b, r in zip(med, bf, rs)]
    hi = [b / min(r["ab_rounds"]["pair"]) - m for m, b, r in zip(med, bf, rs)]
    ax.errorbar(xs, med, yerr=[lo, hi], fmt="o-", color=C_BEST, ms=3, capsize=2,
                label="pair MoE (served)")  # fmt: skip
    ax.hlines(MOE_TARGET[2], MOE_TARGET[0], MOE_TARGET[1], colors="red", linestyles="--", lw=1)
    ax.axhline(1.0, color=C_BASE, lw=1)
    ax.set_xlabel("batch T (tokens)", fontsize=8)
    batch_axes(ax, xs, "x bf16 grouped MoE (higher is faster)")
    title = f"fused int4 MoE, {rs[0]['experts']} experts, top-{rs[0]['topk']} (red: target)"
    finish_grid(fig, axes, 1, title, d, "awq_parts_h200.json", out, "awq_moe_vs_bf16.png", written)
