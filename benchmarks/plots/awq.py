"""awq_h200.json: W4A16 vs bf16 latency by batch size."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.plots.common import C_BASE, C_BEST, batch_axes, finish_grid, plt


def plot_awq(d: dict, out: Path, written: list[Path]) -> None:
    lin = [r for r in d.get("linear", []) if "awq_us" in r]
    moe = [r for r in d.get("moe", []) if "awq_us" in r]
    shapes = list(dict.fromkeys((r["in"], r["out"]) for r in lin))
    experts = list(dict.fromkeys(r["experts"] for r in moe))
    panels = [("linear", s) for s in shapes] + [("moe", e) for e in experts]
    if not panels:
        print("skip: awq: no measurements")
        return
    ncol = 3 if len(panels) > 2 else len(panels)
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.4 * ncol, 2.8 * nrow), squeeze=False)
    for ax, (kind, key) in zip(axes.flat, panels, strict=False):
        if kind == "linear":
            rs = sorted((r for r in lin if (r["in"], r["out"]) == key), key=lambda r: r["M"])
            xs = [r["M"] for r in rs]
            ax.plot(xs, [r["awq_us"] for r in rs], "o-", color=C_BEST, ms=3, label="AWQ W4A16")
            ax.plot(xs, [r["bf16_us"] for r in rs], "s-", color=C_BASE, ms=3, label="bf16 F.linear")
            for col, style, label in (
                ("tinygemm_us", "v:", "int4 tinygemm"),
                ("pairs_us", "d:", "pair-layout Triton"),
                ("repacked_us", "d:", "repacked Triton"),  # results from before the pair layout
                ("former_us", "x:", "former AWQ kernel"),
            ):
                if all(col in r for r in rs):  # results files from before the repack lack them
                    ax.plot(xs, [r[col] for r in rs], style, color="#888", ms=3, label=label)
            ax.set_title(f"linear {key[0]}->{key[1]}", fontsize=9)
            ax.set_xlabel("batch M (tokens)", fontsize=8)
        else:
            rs = sorted((r for r in moe if r["experts"] == key), key=lambda r: r["T"])
            xs = [r["T"] for r in rs]
            ax.plot(xs, [r["awq_us"] for r in rs], "o-", color=C_BEST, ms=3, label="AWQ W4A16")
            ax.plot(
                xs,
                [r["bf16_triton_us"] for r in rs],
                "s-",
                color=C_BASE,
                ms=3,
                label="bf16 Triton MoE",
            )
            if any("bf16_dense_all_experts_us" in r for r in rs):
                pts = [
                    (r["T"], r["bf16_dense_all_experts_us"])
                    for r in rs
                    if "bf16_dense_all_experts_us" in r
                ]
                ax.plot(
                    *zip(*pts, strict=True),
                    "^--",
                    color="#888",
                    ms=3,
                    label="bf16 dense, all experts",
                )
            ax.set_title(f"fused MoE, {key} experts, top-{rs[0].get('topk')}", fontsize=9)
            ax.set_xlabel("batch T (tokens)", fontsize=8)
        batch_axes(ax, xs, "µs per call")
    title = "AWQ W4A16 vs bf16 latency by batch size (main tables of the run)"
    finish_grid(fig, axes, len(panels), title, d, "awq_h200.json", out, "awq_vs_bf16.png", written)
