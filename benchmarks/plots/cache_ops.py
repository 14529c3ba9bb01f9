"""cache_ops_h200.json: op latencies and the recall bandwidth against the targets."""

from __future__ import annotations

from pathlib import Path

from benchmarks.plots.common import C_BASE, C_BEST, C_OTHER, C_TARGET, plt, save, source_note


def plot_cache(d: dict, out: Path, written: list[Path]) -> None:
    tg = d.get("targets", {})

    def us(key: str) -> float | None:
        """The figure the targets are scored on: amortized over a refill period where there is
        one, else the median."""
        v = d.get(key, {})
        return v.get("amortized_us", v.get("median_us")) if isinstance(v, dict) else None

    ops = [  # (label, key, target)
        ("allocate 37", "allocate_37", tg.get("allocate_us")),
        ("allocate 2048", "allocate_2048", None),
        ("free 37", "free_37", tg.get("free_us")),
        ("offload 64 rows (fp8)", "fp8.offload_64_rows", tg.get("offload_64_rows_us")),
        ("recall, 37 misses (fp8)", "fp8.recall_37_misses", tg.get("recall_37_misses_us")),
        ("recall, hit 0.97 (fp8)", "fp8.recall_hit_0.97", None),
    ]
    # (label, default, a launch per phase or None, target)
    lat = [(lab, us(k), us(f"launches.{k}"), t) for lab, k, t in ops if us(k) is not None]
    bw = []  # (label, GB/s)
    for fmt in ("fp8", "bf16"):
        r = d.get(f"{fmt}.recall_2048_misses", {})
        c = d.get(f"{fmt}.copy_2048_rows", {})
        if "GBps" in r:
            bw.append((f"{fmt} recall op", r.get("amortized_GBps", r["GBps"]), C_BEST))
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
        ax.barh([i - 0.2 for i in y], [m for _, m, _, _ in lat], height=0.4, color=C_BEST,
                label="one launch (default)")  # fmt: skip
        alt = [(i, a) for i, (_, _, a, _) in enumerate(lat) if a is not None]
        ax.barh([i + 0.2 for i, _ in alt], [a for _, a in alt], height=0.4, color=C_OTHER,
                label="a launch per phase")  # fmt: skip
        tys = [(i, t) for i, (_, _, _, t) in enumerate(lat) if t is not None]
        ax.scatter(
            [t for _, t in tys],
            [i for i, _ in tys],
            marker="|",
            s=400,
            color=C_TARGET,
            zorder=3,
            label="target",
        )
        for i, (_, m, _, t) in enumerate(lat):
            ax.text(
                m,
                i - 0.2,
                f" {m:.1f}" + (f" (target {t:g})" if t is not None else ""),
                va="center",
                fontsize=7,
            )
        ax.set_yticks(y)
        ax.set_yticklabels([lab for lab, _, _, _ in lat], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlim(1, max(m for _, m, _, _ in lat) * 12)
        ax.set_xlabel("µs per call per layer (log; amortized over the reserve's refill)",
                      fontsize=8)  # fmt: skip
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
        ax.set_xlabel("GB/s, 2048 rows host -> GPU (the op: amortized)", fontsize=8)
        ax.set_title("Recall of 2048 missed rows vs raw copies", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    source_note(fig, d, "cache_ops_h200.json")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(fig, out, "cache_ops.png", written)
