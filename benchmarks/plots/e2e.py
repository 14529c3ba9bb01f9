"""e2e_h200.json: throughput per system and pool (Fig. 13), the rate sweep (Fig. 12), per-layer
hit rates; its breakdown is drawn by plots.breakdown."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.plots.breakdown import plot_e2e_breakdown
from benchmarks.plots.common import C_BASE, C_BEST, C_OTHER, plt, save, source_note
from benchmarks.report_data import mean, row_rate

E2E_COLORS = {"offload": C_BEST, "gpu-only": C_BASE, "offload-eager": "#7fb3d5"}


def _pool_label(p) -> str:
    return f"GPU pool {int(p):,} tokens/layer" if p is not None else "GPU pool ?"


def _join(vals) -> str:
    vs = sorted({v for v in vals if v is not None})
    return "/".join(f"{v:,}" if isinstance(v, int) else str(v) for v in vs)


def _e2e_title(d: dict, rows: list[dict]) -> str:
    wl, m = d.get("workload", {}), d.get("model", {})
    reqs = _join(r.get("requests") for r in rows)
    rep = f", repeat {d['repeat']:g}" if isinstance(d.get("repeat"), (int, float)) else ""
    return (
        f"{reqs or wl.get('requests', '?')} requests, context "
        f"{wl.get('min_ctx', '?'):,}-{wl.get('max_ctx', '?'):,}, "
        f"{wl.get('output_len', '?')} output tokens, "
        f"{m.get('num_hidden_layers', '?')} layers, {d.get('kv_format', '?')} KV{rep}"
    )


def plot_e2e(d: dict, out: Path, written: list[Path]) -> None:
    rows = [r for r in d.get("results", []) if "throughput_tok_s" in r]
    if not rows:
        print("skip: e2e: no results")
    at_once = [r for r in rows if math.isinf(row_rate(r))]
    swept = [r for r in rows if not math.isinf(row_rate(r))]
    if rows and not at_once:
        print("skip: e2e throughput / hit rate: no all-at-once (rate inf) rows")
    if at_once:
        _e2e_throughput(d, at_once, out, written)
        _e2e_hit_rate(d, at_once, out, written)
    if rows and not swept:
        print("skip: e2e rate sweep: no finite-rate rows")
    if swept:
        _e2e_rate_sweep(d, swept, out, written)
    if d.get("breakdown"):
        plot_e2e_breakdown(d, out, written)
    else:
        print("skip: e2e breakdown: the file has no breakdown")


def _e2e_throughput(d: dict, rows: list[dict], out: Path, written: list[Path]) -> None:
    """Fig. 13: throughput per system at each GPU pool size, requests all at once."""
    pools = sorted({r.get("gpu_pool_tokens") for r in rows}, key=lambda p: (p is None, -(p or 0)))
    systems = list(dict.fromkeys(r["system"] for r in rows))

    def row(sys_name, pool):
        return next(
            (r for r in rows if r["system"] == sys_name and r.get("gpu_pool_tokens") == pool),
            None,
        )

    fig, ax = plt.subplots(figsize=(max(7.5, 2.6 * len(pools) + 1.5), 4.6))
    width = 0.8 / len(systems)
    top = max(r["throughput_tok_s"] for r in rows)
    for i, sys_name in enumerate(systems):
        for j, pool in enumerate(pools):
            r = row(sys_name, pool)
            if r is None:
                continue
            x = j + (i - (len(systems) - 1) / 2) * width
            ax.bar(
                x,
                r["throughput_tok_s"],
                width * 0.92,
                color=E2E_COLORS.get(sys_name, C_OTHER),
                label=sys_name,
            )
            hr = mean(r.get("hit_rate") or [])
            hr_s = "n/a" if math.isnan(hr) else f"{hr:.3f}"
            ax.annotate(
                f"{r['throughput_tok_s']:.0f} tok/s\nbatch {r.get('effective_batch', 0):.1f}\n"
                f"hit rate {hr_s}",
                (x, r["throughput_tok_s"]),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    for j, pool in enumerate(pools):
        off, base = row("offload", pool), row("gpu-only", pool)
        if off is None or base is None or not base["throughput_tok_s"]:
            continue
        group_top = max(r["throughput_tok_s"] for r in rows if r.get("gpu_pool_tokens") == pool)
        ax.annotate(
            f"offload / GPU-only = {off['throughput_tok_s'] / base['throughput_tok_s']:.1f}x",
            (j, group_top),
            xytext=(0, 40),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
            fontweight="bold",
        )
    ax.set_xticks(range(len(pools)))
    ax.set_xticklabels([_pool_label(p) for p in pools])
    ax.set_ylabel("decode throughput (tokens/s)")
    ax.set_ylim(0, top * 1.55)
    ax.set_title(f"End to end, all requests at once: {_e2e_title(d, rows)}", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8, loc="upper right", ncol=len(uniq))
    ax.grid(axis="y", alpha=0.3)
    source_note(fig, d, "e2e_h200.json")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(fig, out, "e2e_throughput.png", written)


def _e2e_hit_rate(d: dict, rows: list[dict], out: Path, written: list[Path]) -> None:
    hr_rows = [r for r in rows if r.get("hit_rate")]
    if not hr_rows:
        print("skip: e2e hit rate: no system reports per-layer hit rates")
        return
    hr_rows.sort(key=lambda r: (-(r.get("gpu_pool_tokens") or 0), r["system"]))
    n_layers = max(len(r["hit_rate"]) for r in hr_rows)
    n_bars = n_layers * len(hr_rows)
    lines = n_bars > 40  # too many bars to read: one line per system and pool instead
    width_in = min(16, max(6.5, (0.14 * n_layers if lines else 0.32 * n_bars) + 2))
    fig, ax = plt.subplots(figsize=(width_in, 4.0))
    width = 0.8 / len(hr_rows)
    pools = list(dict.fromkeys(r.get("gpu_pool_tokens") for r in hr_rows))
    hatches = ["", "//", "..", "xx", "\\\\", "++"]
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P"]
    for i, r in enumerate(hr_rows):
        label = (
            f"{r['system']}, pool {r.get('gpu_pool_tokens') or 0:,} "
            f"(mean {mean(r['hit_rate']):.3f})"
        )
        color = E2E_COLORS.get(r["system"], C_OTHER)
        pi = pools.index(r.get("gpu_pool_tokens"))
        if lines:
            ax.plot(
                range(len(r["hit_rate"])),
                r["hit_rate"],
                ls=styles[pi % len(styles)],
                marker=markers[pi % len(markers)],
                ms=3,
                lw=1,
                color=color,
                label=label,
            )
            continue
        xs = [k + (i - (len(hr_rows) - 1) / 2) * width for k in range(len(r["hit_rate"]))]
        ax.bar(
            xs,
            r["hit_rate"],
            width * 0.92,
            label=label,
            color=color,
            hatch=hatches[pi % len(hatches)],
            edgecolor="white",
            linewidth=0,
        )
        if n_bars <= 16:
            for x, h in zip(xs, r["hit_rate"], strict=True):
                ax.text(x, h, f"{h:.3f}", ha="center", va="bottom", fontsize=8)
        else:
            for x, h in zip(xs, r["hit_rate"], strict=True):
                ax.text(x, h, f" {h:.2f}", ha="center", va="bottom", fontsize=6, rotation=90)
    step = max(1, math.ceil(n_layers / 24))
    ax.set_xticks(range(0, n_layers, step))
    if n_layers > 12:
        ax.set_xticklabels([str(k) for k in range(0, n_layers, step)], fontsize=8)
        ax.set_xlabel("layer", fontsize=8)
    else:
        ax.set_xticklabels([f"layer {k}" for k in range(0, n_layers, step)], fontsize=8)
    ax.set_ylabel("GPU-pool hit rate of selected rows")
    lo = min(min(r["hit_rate"]) for r in hr_rows)
    hi = max(max(r["hit_rate"]) for r in hr_rows)
    if lines:
        pad = max(hi - lo, 0.01)
        ax.set_ylim(max(0.0, lo - 0.3 * pad), hi + 0.9 * pad)  # zoomed; room for the legend
        ax.set_xlim(-1, n_layers)
    else:
        ax.set_ylim(0, hi * 1.45)
    ax.set_title("Per-layer hit rate, offload systems, all requests at once", fontsize=10)
    ax.legend(fontsize=8, ncol=2 if len(hr_rows) > 3 else 1, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    source_note(fig, d, "e2e_h200.json")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(fig, out, "e2e_hit_rate.png", written)


def _e2e_rate_sweep(d: dict, rows: list[dict], out: Path, written: list[Path]) -> None:
    """Fig. 12: throughput vs Poisson request rate, per system (and pool, if several)."""
    pools = list(dict.fromkeys(r.get("gpu_pool_tokens") for r in rows))
    keys = list(dict.fromkeys((r["system"], r.get("gpu_pool_tokens")) for r in rows))
    markers = ["o", "s", "^", "D", "v", "P"]
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for i, (sys_name, pool) in enumerate(keys):
        pts = sorted(
            (r for r in rows if r["system"] == sys_name and r.get("gpu_pool_tokens") == pool),
            key=row_rate,
        )
        xs = [row_rate(r) for r in pts]
        ys = [r["throughput_tok_s"] for r in pts]
        label = sys_name + (f", pool {pool or 0:,}" if len(pools) > 1 else "")
        ax.plot(
            xs,
            ys,
            marker=markers[i % len(markers)],
            ms=5,
            color=E2E_COLORS.get(sys_name, C_OTHER),
            ls="-" if pools.index(pool) == 0 else "--",
            label=label,
        )
        for x, y, r in zip(xs, ys, pts, strict=True):
            hr = mean(r.get("hit_rate") or [])
            ax.annotate(
                f"B={r.get('effective_batch', 0):.1f}"
                + ("" if math.isnan(hr) else f"\nhit {hr:.2f}"),
                (x, y),
                xytext=(0, 7 if i % 2 == 0 else -9),
                textcoords="offset points",
                ha="center",
                va="bottom" if i % 2 == 0 else "top",
                fontsize=8,
            )
    rates = sorted({row_rate(r) for r in rows})
    ax.set_xscale("log")
    ax.set_xticks(rates)
    ax.set_xticklabels([f"{x:g}" for x in rates])
    ax.minorticks_off()
    if len(rates) == 1:
        ax.set_xlim(rates[0] / 2, rates[0] * 2)
    else:
        ax.set_xlim(rates[0] / 1.4, rates[-1] * 1.4)
    top = max(r["throughput_tok_s"] for r in rows)
    ax.set_ylim(0, top * 1.25)
    ax.set_xlabel("request rate (requests/s, Poisson arrivals; log)")
    ax.set_ylabel("decode throughput (tokens/s)")
    wl, m = d.get("workload", {}), d.get("model", {})
    rep = f", repeat {d['repeat']:g}" if isinstance(d.get("repeat"), (int, float)) else ""
    ax.set_title(
        f"Throughput vs request rate, {_pool_label(pools[0]) if len(pools) == 1 else 'GPU pools '}"
        f"{'' if len(pools) == 1 else _join(pools)}, "
        f"{_join(r.get('requests') for r in rows) or '?'} requests per point\n"
        f"context {wl.get('min_ctx', '?'):,}-{wl.get('max_ctx', '?'):,}, "
        f"{wl.get('output_len', '?')} output tokens, {m.get('num_hidden_layers', '?')} layers, "
        f"{d.get('kv_format', '?')} KV{rep}; B = eff. batch, hit = mean hit rate",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    source_note(fig, d, "e2e_h200.json")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(fig, out, "e2e_rate_sweep.png", written)
