"""Figures of the committed H200 results, for docs/benchmarks.md.

    python benchmarks/plot_results.py [--results benchmarks/results] [--out docs/figures]

Reads the results JSONs (any of them may be missing: its figures are skipped with a note) and
writes PNGs with matplotlib's Agg backend:

    e2e_throughput.png     e2e_h200.json: throughput per system at each measured GPU pool size,
                           effective batch and mean hit rate on each bar
    e2e_hit_rate.png       e2e_h200.json: per-layer hit rate of the offload system(s)
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


def plot_e2e(d: dict, out: Path, written: list[Path]) -> None:
    rows = [r for r in d.get("results", []) if "throughput_tok_s" in r]
    if not rows:
        print("skip: e2e: no results")
        return
    wl = d.get("workload", {})
    pools = sorted({r.get("gpu_pool_tokens") for r in rows}, key=lambda p: (p is None, p))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    colors = {"offload": C_BEST, "gpu-only": C_BASE, "offload-eager": "#7fb3d5"}

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(systems)
    top = max(r["throughput_tok_s"] for r in rows)
    for i, sys_name in enumerate(systems):
        for j, pool in enumerate(pools):
            r = next(
                (r for r in rows if r["system"] == sys_name and r.get("gpu_pool_tokens") == pool),
                None,
            )
            if r is None:
                continue
            x = j + (i - (len(systems) - 1) / 2) * width
            ax.bar(
                x,
                r["throughput_tok_s"],
                width * 0.92,
                color=colors.get(sys_name, C_OTHER),
                label=sys_name if j == 0 else None,
            )
            hr = mean(r.get("hit_rate") or [])
            hr_s = "n/a" if math.isnan(hr) else f"{hr:.3f}"
            ax.text(
                x,
                r["throughput_tok_s"] + top * 0.015,
                f"{r['throughput_tok_s']:.0f} tok/s\nbatch {r.get('effective_batch', 0):.1f}\n"
                f"hit rate {hr_s}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(range(len(pools)))
    ax.set_xticklabels([f"GPU pool {p:,} tokens/layer" if p else "GPU pool ?" for p in pools])
    ax.set_ylabel("decode throughput (tokens/s)")
    ax.set_ylim(0, top * 1.35)
    ax.set_title(
        f"End to end: {wl.get('requests', '?')} requests, context "
        f"{wl.get('min_ctx', '?'):,}-{wl.get('max_ctx', '?'):,}, "
        f"{wl.get('output_len', '?')} output tokens, "
        f"{d.get('model', {}).get('num_hidden_layers', '?')} layers, "
        f"{d.get('kv_format', '?')} KV",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    source_note(fig, d, "e2e_h200.json")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(fig, out, "e2e_throughput.png", written)

    hr_rows = [r for r in rows if r.get("hit_rate")]
    if not hr_rows:
        print("skip: e2e hit rate: no system reports per-layer hit rates")
        return
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    n_layers = max(len(r["hit_rate"]) for r in hr_rows)
    width = 0.8 / len(hr_rows)
    for i, r in enumerate(hr_rows):
        xs = [k + (i - (len(hr_rows) - 1) / 2) * width for k in range(len(r["hit_rate"]))]
        label = f"{r['system']} (pool {r.get('gpu_pool_tokens', 0):,})"
        ax.bar(xs, r["hit_rate"], width * 0.92, label=label, color=colors.get(r["system"], C_OTHER))
        for x, h in zip(xs, r["hit_rate"], strict=True):
            ax.text(x, h, f"{h:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(n_layers))
    ax.set_xticklabels([f"layer {k}" for k in range(n_layers)])
    ax.set_ylabel("GPU-pool hit rate of selected rows")
    ax.set_ylim(0, max(max(r["hit_rate"]) for r in hr_rows) * 1.3)
    ax.set_title("Per-layer hit rate, offload systems", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    source_note(fig, d, "e2e_h200.json")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(fig, out, "e2e_hit_rate.png", written)


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
