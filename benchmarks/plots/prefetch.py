"""prefetch_h200.json: indexer + recall with the fused prefetch over the baseline (unfused
indexer + recall) against the threshold margin, one panel per pool hit rate, with the bound
perfect overlap allows and the paper's ratio."""

from __future__ import annotations

from pathlib import Path

from benchmarks.plots.common import C_BASE, C_BEST, C_OLD, C_OTHER, C_TARGET, finish_grid, plt


def plot_prefetch(d: dict, out: Path, written: list[Path]) -> None:
    margins = d.get("margins") or []
    hits = [k for k in d.get("results", {}) if k.startswith("h")]
    if not margins or not hits:
        print("skip: prefetch: no margins or hit rates")
        return
    # the configurations, by the names bench_prefetch gives them: "<cap|ratio>_m<margin>_rows8"
    r0 = d["results"][hits[0]]
    configs = sorted({k.split("_m")[0] for k in r0 if k.endswith("_speedup") and "_m" in k})
    fig, axes = plt.subplots(1, len(hits), figsize=(3.3 * len(hits), 3.0), squeeze=False)
    colours = [C_BEST, C_BASE, C_OLD, C_OTHER]
    for ax, h in zip(axes.flat, hits):
        r = d["results"][h]
        for c, col in zip(configs, colours):
            ys = [r.get(f"{c}_m{m:g}_rows8_speedup") for m in margins]
            pts = [(m, y) for m, y in zip(margins, ys) if y is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, color=col,
                    label=c.replace("ratio", "budget ").replace("cap", "cap "))  # fmt: skip
        if "bound_speedup" in r:
            ax.axhline(r["bound_speedup"], color=C_TARGET, ls="--", lw=1, label="bound")
        paper = d.get("paper_speedups", {}).get(h[1:])
        if paper:
            ax.axhline(paper, color=C_TARGET, ls=":", lw=1, label="paper")
        ax.axhline(1.0, color="#444", lw=0.8)
        ax.set_title(f"hit rate {h[1:]}", fontsize=9)
        ax.set_xticks(margins)
        ax.set_xlabel("threshold margin (0 = ECHO's)", fontsize=8)
        ax.set_ylabel("x baseline (higher is faster)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    title = "fused prefetch: indexer + recall over no prefetch, B = 16, 128K, top-2048"
    finish_grid(fig, axes, len(hits), title, d, "prefetch_h200.json", out, "prefetch_margin.png",
                written)  # fmt: skip
