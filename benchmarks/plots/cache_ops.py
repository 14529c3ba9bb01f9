"""cache_ops_h200.json: op latencies and the recall bandwidth against the targets."""

from __future__ import annotations

from pathlib import Path

from benchmarks.plots.common import C_BASE, C_BEST, C_OTHER, C_TARGET, plt, save, source_note


def plot_cache(d: dict, out: Path, written: list[Path]) -> None:
    tg = d.get("targets", {})

    def us(key: str) -> float | None:
        return d.get(key, {}).get("median_us")

    lat = []  # (label, measured, target or None)
    if us("allocate_37") is not None:
        lat.append(("allocate 37", us("allocate_37"), tg.get("allocate_us")))
    if us("allocate_2048") is not None:
        lat.append(("allocate 2048", us("allocate_2048"), None))
    if us("free_37") is not None:
        lat.append(("free 37 evictions", us("free_37"), tg.get("free_us")))
    if us("fp8.offload_64_rows") is not None:
        lat.append(("offload 64 rows (fp8)", us("fp8.offload_64_rows"), None))
    if us("fp8.recall_37_misses") is not None:
        lat.append(("recall, 37 misses (fp8)", us("fp8.recall_37_misses"), None))
    if us("fp8.recall_hit_0.97") is not None and us("fp8.offload_64_rows") is not None:
        lat.append(
            (
                "recall hit 0.97 + offload (fp8)",
                us("fp8.recall_hit_0.97") + us("fp8.offload_64_rows"),
                tg.get("alloc_free_recall_offload_us_at_0.97"),
            )
        )
    bw = []  # (label, GB/s)
    for fmt in ("fp8", "bf16"):
        r = d.get(f"{fmt}.recall_2048_misses", {})
        c = d.get(f"{fmt}.copy_2048_rows", {})
        if "GBps" in r:
            bw.append((f"{fmt} recall op", r["GBps"], C_BEST))
        if "gather_kernel_GBps" in c:
            bw.append((f"{fmt} gather kernel", c["gather_kernel_GBps"], C_OTHER))
        if "memcpy_async_GBps" in c:
            bw.append((f"{fmt} cudaMemcpyAsync", c["memcpy_async_GBps"], C_BASE))
    if not lat and not bw:
        print("skip: cache ops: no measurements")
        return
    n = (1 if lat else 0) + (1 if bw else 0)
    fig, axes = plt.subplots(
        1, n, figsize=(10, 4.0), squeeze=False, gridspec_kw={"width_ratios": [1.6, 1][:n]}
    )
    k = 0
    if lat:
        ax = axes[0, k]
        k += 1
        y = list(range(len(lat)))
        ax.barh(y, [m for _, m, _ in lat], color=C_BEST, label="measured (median)")
        tys = [(i, t) for i, (_, _, t) in enumerate(lat) if t is not None]
        ax.scatter(
            [t for _, t in tys],
            [i for i, _ in tys],
            marker="|",
            s=400,
            color=C_TARGET,
            zorder=3,
            label="target",
        )
        for i, (_, m, t) in enumerate(lat):
            ax.text(
                m,
                i,
                f" {m:.1f}" + (f" (target {t:g})" if t is not None else ""),
                va="center",
                fontsize=7,
            )
        ax.set_yticks(y)
        ax.set_yticklabels([lab for lab, _, _ in lat], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlim(1, max(m for _, m, _ in lat) * 12)
        ax.set_xlabel("µs per call per layer (log)", fontsize=8)
        s = d.get("sizes", {})
        ax.set_title(
            f"Cache ops, N_G={s.get('N_G', '?'):,}, B={s.get('B')}, k={s.get('k')}", fontsize=9
        )
        ax.legend(fontsize=7, loc="upper right", markerscale=0.4)
        ax.grid(axis="x", alpha=0.3, which="both")
    if bw:
        ax = axes[0, k]
        y = list(range(len(bw)))
        ax.barh(y, [v for _, v, _ in bw], color=[c for _, _, c in bw])
        for i, (_, v, _) in enumerate(bw):
            ax.text(v, i, f" {v:.1f}", va="center", fontsize=7)
        ax.set_yticks(y)
        ax.set_yticklabels([lab for lab, _, _ in bw], fontsize=8)
        ax.invert_yaxis()
        t = tg.get("recall_2048_rows_GBps")
        if t is not None:
            ax.axvline(t, color=C_TARGET, ls="--", lw=1.2)
            ax.text(t, len(bw) - 0.5, f" target {t:g}", color=C_TARGET, fontsize=7, va="top")
        ax.set_xlim(0, max([v for _, v, _ in bw] + [t or 0]) * 1.2)
        ax.set_xlabel("GB/s, 2048 rows host -> GPU", fontsize=8)
        ax.set_title("Recall of 2048 missed rows vs raw copies", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    source_note(fig, d, "cache_ops_h200.json")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(fig, out, "cache_ops.png", written)
