"""Figures of the committed H200 results, for docs/benchmarks.md.

    python benchmarks/plot_results.py [--results benchmarks/results] [--out docs/figures]

Reads the results JSONs (any of them may be missing: its figures are skipped with a note) and
writes PNGs with matplotlib's Agg backend:

    e2e_throughput.png     e2e_h200.json (Fig. 13): throughput per system at each measured GPU pool
                           size, all requests at once (rate inf; rows without a rate count as
                           such), effective batch and mean hit rate on each bar, offload / GPU-only
                           ratio above each pool
    e2e_rate_sweep.png     e2e_h200.json (Fig. 12): throughput vs Poisson request rate per system,
                           effective batch at each point (skipped without finite-rate rows)
    e2e_hit_rate.png       e2e_h200.json: per-layer hit rate of the offload system(s), all at once
    e2e_breakdown.png      e2e_h200.json "breakdown": ms per eager decode step by category
    step_breakdown.png     step_h200.json: the same at B=1/16/64, with compiled / GPU-only / eager
                           step times (bench_step.py)
                           (attention, indexer, cache management, moe, dense mlp, other) per pool
    decode_kernels.png     decode_kernels_h200.json: kernel times per swept config vs targets
    cache_ops.png          cache_ops_h200.json: op latencies and recall bandwidth vs targets
    awq_vs_bf16.png        awq_h200.json: W4A16 vs bf16 latency by batch size

Every plotted number is a field of a JSON file; targets are drawn from the files' "targets".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DPI = 90
C_OLD, C_BEST, C_OTHER, C_BASE, C_TARGET = "#9aa5b1", "#2a7ab0", "#c7d6e3", "#e08a3c", "#c0392b"


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        print(f"skip: {path} not found")
    except (OSError, json.JSONDecodeError) as e:
        print(f"skip: {path}: {type(e).__name__}: {e}")
    return None


def save(fig, out: Path, name: str, written: list[Path]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    p = out / name
    fig.savefig(p, dpi=DPI)
    plt.close(fig)
    written.append(p)
    print(f"wrote {p} ({p.stat().st_size / 1024:.0f} KB)")


def source_note(fig, d: dict, file: str) -> None:
    env = d.get("environment", d)
    bits = [
        file,
        env.get("device"),
        f"torch {env.get('torch')}",
        f"triton {env.get('triton')}",
        str(env.get("date", ""))[:10],
    ]
    fig.text(
        0.99,
        0.005,
        " | ".join(b for b in bits if b and b != "torch None" and b != "triton None"),
        ha="right",
        va="bottom",
        fontsize=7,
        color="#666",
    )


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


# ------------------------------------------------------------------------------------------------
# (a), (b): end to end

E2E_COLORS = {"offload": C_BEST, "gpu-only": C_BASE, "offload-eager": "#7fb3d5"}
# echo_compile.breakdown.CATEGORIES, in its order; any other key of a file is drawn after them
BREAKDOWN_CATEGORIES = ("attention", "indexer", "cache management", "moe", "dense mlp", "other")
BREAKDOWN_COLORS = ("#2a7ab0", "#e08a3c", "#c0392b", "#5b9e5b", "#9b6fb5", "#9aa5b1")


def row_rate(r: dict) -> float:
    """A row's request rate (req/s); rows of older files have none: all requests at once."""
    v = r.get("rate")
    return float("inf") if v is None else float(v)


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
        _e2e_breakdown(d, out, written)
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


ANNOTATION = "echo_breakdown:"


def corrected_breakdown(e: dict) -> dict:
    """A breakdown entry without the double count of runs made before the fix in
    echo_compile/breakdown.py: there a region's device-side annotation (named echo_breakdown:*,
    spanning the region's kernels) was counted as an unclaimed kernel, inside "other". The entry
    lists its unclaimed time by name, so that share is taken out exactly."""
    annot = sum(v for n, v in (e.get("unclaimed_top") or {}).items() if n.startswith(ANNOTATION))
    if not annot:
        return e
    ms = dict(e["ms_per_step"])
    ms["other"] = ms.get("other", 0.0) - annot
    return e | {
        "ms_per_step": ms,
        "total_ms": e.get("total_ms", sum(e["ms_per_step"].values())) - annot,
        "unclaimed_ms": (e.get("unclaimed_ms") or 0.0) - annot,
        "annotation_ms_removed": annot,
    }


def breakdown_label(key: str) -> str:
    """A breakdown entry's key ("200000": offloading's; "gpu-only 200000") as "system, pool N"."""
    system, _, n = key.rpartition(" ")
    return f"{system or 'offload'}, pool {int(n):,}"


def _e2e_breakdown(d: dict, out: Path, written: list[Path]) -> None:
    """Stacked ms per eager decode step by category, one bar per profiled pool."""
    bd = d["breakdown"]

    def pool_key(k: str):
        try:
            return (0, -int(k))
        except ValueError:
            return (1, k)

    entries = []
    for k in sorted(bd, key=pool_key):
        if bd[k].get("ms_per_step"):
            entries.append((breakdown_label(k), corrected_breakdown(bd[k])))
    if not entries:
        print("skip: e2e breakdown: no entry has ms_per_step")
        return
    m = d.get("model", {})
    rep = f", repeat {d['repeat']:g}" if isinstance(d.get("repeat"), (int, float)) else ""
    title = (
        f"Where an eager decode step's time goes: {m.get('num_hidden_layers', '?')} "
        f"layers, {d.get('kv_format', '?')} KV{rep}"
    )
    _breakdown_figure(d, entries, title, "e2e_h200.json", out, "e2e_breakdown.png", written)


def plot_step(d: dict, out: Path, written: list[Path]) -> None:
    """step_h200.json: the eager step's breakdown at each batch, with the compiled step time."""
    entries = []
    for r in d.get("rows", []):
        e = r.get("breakdown")
        if not e or not e.get("ms_per_step"):
            continue
        st = r.get("step_ms", {})
        entries.append(
            (
                f"B={r['batch']}, compiled step {st.get('offload', float('nan')):.1f} ms\n"
                f"(GPU-only {st.get('gpu_only', float('nan')):.1f}, "
                f"eager {st.get('offload_eager', float('nan')):.1f})",
                corrected_breakdown(e),
            )
        )
    if not entries:
        print("skip: step: no row has a breakdown")
        return
    m = d.get("model", {})
    title = (
        f"Decode step by batch: {m.get('num_hidden_layers', '?')} layers, context "
        f"{d.get('ctx', '?'):,}, {d.get('kv_format', '?')} KV, repeat {d.get('repeat', '?')}"
    )
    _breakdown_figure(d, entries, title, "step_h200.json", out, "step_breakdown.png", written)


def _breakdown_figure(
    d: dict,
    entries: list[tuple[str, dict]],
    title: str,
    file: str,
    out: Path,
    name: str,
    written: list[Path],
) -> None:
    cats = list(BREAKDOWN_CATEGORIES)
    for _, e in entries:
        cats += [c for c in e["ms_per_step"] if c not in cats]
    colors = {
        c: BREAKDOWN_COLORS[i] if i < len(BREAKDOWN_COLORS) else C_OTHER for i, c in enumerate(cats)
    }
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.75 * len(entries)))
    top = max(e.get("total_ms", sum(e["ms_per_step"].values())) for _, e in entries)
    labels = []
    for y, (label, e) in enumerate(entries):
        left = 0.0
        for c in cats:
            v = e["ms_per_step"].get(c)
            if not v:
                continue
            ax.barh(y, v, left=left, color=colors[c], label=c if y == 0 else None, height=0.6)
            if v >= top * 0.06:
                ax.text(
                    left + v / 2, y, f"{v:.1f}", ha="center", va="center", fontsize=7, color="w"
                )
            left += v
        total = e.get("total_ms", left)
        unc = e.get("unclaimed_ms") or 0.0
        note = f"\n (other incl. {unc:.1f} unclaimed)" if unc > 0.005 else ""
        if e.get("annotation_ms_removed"):
            note += f"\n ({e['annotation_ms_removed']:.1f} ms double count removed)"
        ax.text(left, y, f" total {total:.1f} ms" + note, va="center", fontsize=8)
        hr = mean(e.get("hit_rate") or [])
        labels.append(
            f"{label}\nbatch {e.get('batch', '?')}, hit rate "
            + ("n/a" if math.isnan(hr) else f"{hr:.3f}")
        )
    ax.set_yticks(range(len(entries)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.35)
    ax.set_ylim(len(entries) - 0.5, -0.5 - 0.7)  # room for the legend above the bars
    times = {e.get("time") for _, e in entries}
    kind = (
        "GPU kernel time"
        if times == {"device"}
        else "CPU time"
        if times == {"cpu"}
        else "GPU kernel or CPU time"
    )
    ax.set_xlabel(f"eager decode step, {kind} (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=len(cats), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    source_note(fig, d, file)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(fig, out, name, written)


# ------------------------------------------------------------------------------------------------
# (c): decode kernels


def _cfg_label(cfg: dict, keys: list[tuple[str, str]]) -> str:
    return " ".join(f"{short}{cfg[k]}" for k, short in keys if k in cfg)


def _sweep_panel(
    ax,
    rows: list[dict],
    labels: list[str],
    ok_key: str,
    title: str,
    target_us: float | None,
    target_label: str,
    extra: list[tuple[str, float]],
    rate=None,
):
    """Bars of measured µs per config: the sweep's first row (the default at run time) grey, the
    fastest verified one blue, the others light; extra baselines orange; target as a line."""
    timed = [(r, lab) for r, lab in zip(rows, labels, strict=True) if "us" in r]
    good = [r for r, _ in timed if r.get(ok_key)]
    best = min(good, key=lambda r: r["us"]) if good else None
    names, vals, cols, notes = [], [], [], []
    for r, lab in timed:
        names.append(lab + ("" if r.get(ok_key) else " (FAILED check)"))
        vals.append(r["us"])
        cols.append(C_BEST if r is best else C_OLD if r is rows[0] else C_OTHER)
        notes.append(rate(r["us"]) if rate else "")
    for lab, v in extra:
        names.append(lab)
        vals.append(v)
        cols.append(C_BASE)
        notes.append(rate(v) if rate else "")
    y = range(len(vals))
    ax.barh(y, vals, color=cols)
    for k, (v, note) in enumerate(zip(vals, notes, strict=True)):
        ax.text(v, k, f" {v:.1f}" + (f" ({note})" if note else ""), va="center", fontsize=7)
    ax.set_yticks(list(y))
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    if target_us is not None:
        ax.axvline(target_us, color=C_TARGET, ls="--", lw=1.2)
        conv = "" if target_label.endswith("µs") else f" = {target_us:.0f} µs"
        title += f"; target {target_label}{conv} (red line)"
    ax.set_xlim(0, max(vals + [target_us or 0]) * 1.3)
    ax.set_xlabel("µs per call (median, CUDA graph)", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", alpha=0.3)


def plot_decode(d: dict, out: Path, written: list[Path]) -> None:
    ix, att, tg = d.get("indexer", {}), d.get("attention", {}), d.get("targets", {})
    panels = []
    if ix.get("scores"):
        panels.append("scores")
    if ix.get("topk_standalone"):
        panels.append("topk")
    if att.get("runs"):
        panels += ["bf16", "fp8"]
    if not panels:
        print("skip: decode kernels: no sweeps")
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.0 + 1.55 * len(panels)), squeeze=False)
    for ax, p in zip(axes[:, 0], panels, strict=True):
        if p == "scores":
            rows = ix["scores"]
            labels = [
                _cfg_label(
                    r["config"],
                    [
                        ("score_block", "blk"),
                        ("score_tokens", "tok"),
                        ("score_warps", "w"),
                        ("score_stages", "st"),
                    ],
                )
                + (" +hist" if r["config"].get("fuse_hist") else " no hist*")
                for r in rows
            ]
            t_us = ix["bytes_read"] / (tg["scores_tb_s"] * 1e6) if "scores_tb_s" in tg else None
            _sweep_panel(
                ax,
                rows,
                labels,
                "ok",
                f"Indexer scores, B={ix.get('B')}, {ix.get('L'):,} tokens",
                t_us,
                f"≥ {tg.get('scores_tb_s')} TB/s",
                [],
                rate=lambda u: f"{ix['bytes_read'] / u / 1e6:.2f} TB/s",
            )
        elif p == "topk":
            rows = ix["topk_standalone"]
            labels = [
                "radix top-k " + _cfg_label(r["config"], [("sel_block", "blk"), ("sel_warps", "w")])
                for r in rows
            ]
            extra = [("torch.topk", ix["torch_topk_us"])] if "torch_topk_us" in ix else []
            _sweep_panel(
                ax,
                rows,
                labels,
                "exact",
                f"Exact top-{ix.get('topk')} of {ix.get('L'):,}, B={ix.get('B')} "
                "(standalone, scores in L2)",
                tg.get("topk_us"),
                f"≤ {tg.get('topk_us'):g} µs",
                extra,
            )
        else:
            rows = [r for r in att["runs"] if r.get("fmt") == p]
            labels = [
                _cfg_label(
                    r["config"],
                    [("block_h", "h"), ("block_k", "k"), ("num_warps", "w"), ("num_stages", "st")],
                )
                + (f" split{r['config']['n_split']}" if r["config"].get("n_split") else "")
                for r in rows
            ]
            extra = (
                [("torch bf16 gather+bmm", att["torch_bf16_us"])]
                if p == "bf16" and "torch_bf16_us" in att
                else []
            )
            t_us = (
                att["flops"] / (tg["attention_tflops"] * 1e6)
                if "attention_tflops" in tg and "flops" in att
                else None
            )
            _sweep_panel(
                ax,
                rows,
                labels,
                "ok",
                f"Sparse MLA decode, {p} rows, B={att.get('B')} H={att.get('H')} K={att.get('K')}",
                t_us,
                f"≥ {tg.get('attention_tflops'):g} TFLOP/s",
                extra,
                rate=lambda u: f"{att['flops'] / u / 1e6:.0f} TFLOP/s",
            )
    fig.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in (C_OLD, C_BEST, C_OTHER, C_BASE)],
        labels=["default at run time", "fastest verified config", "other config", "torch baseline"],
        loc="upper center",
        ncol=4,
        fontsize=7,
        frameon=False,
    )
    if "scores" in panels:
        fig.text(
            0.01,
            0.022,
            "* no hist: the top-k then runs its first histogram pass itself "
            "(the standalone top-k times include that pass)",
            fontsize=7,
            color="#444",
        )
    source_note(fig, d, "decode_kernels_h200.json")
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    save(fig, out, "decode_kernels.png", written)


# ------------------------------------------------------------------------------------------------
# (d): cache ops


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


# ------------------------------------------------------------------------------------------------
# (e): AWQ


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
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_ylim(bottom=0)
        ax.set_ylabel("µs per call", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle("AWQ W4A16 vs bf16 latency by batch size (main tables of the run)", fontsize=10)
    source_note(fig, d, "awq_h200.json")
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    save(fig, out, "awq_vs_bf16.png", written)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "figures")
    a = ap.parse_args(argv)
    written: list[Path] = []
    for file, fn in (
        ("e2e_h200.json", plot_e2e),
        ("step_h200.json", plot_step),
        ("decode_kernels_h200.json", plot_decode),
        ("cache_ops_h200.json", plot_cache),
        ("awq_h200.json", plot_awq),
    ):
        d = load(a.results / file)
        if d is None:
            continue
        try:
            fn(d, a.out, written)
        except Exception as e:  # one malformed file must not stop the other figures
            print(f"skip: {file}: {type(e).__name__}: {e}", file=sys.stderr)
            plt.close("all")
    print(f"{len(written)} figure(s) written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
