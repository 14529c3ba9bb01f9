"""Stacked ms per eager decode step by category: e2e_h200.json's breakdown and step_h200.json's
rows (with their compiled / GPU-only / eager step times)."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.plots.common import C_OTHER, plt, save, source_note
from benchmarks.report_data import BREAKDOWN_CATEGORIES, breakdown_label, mean

BREAKDOWN_COLORS = ("#2a7ab0", "#e08a3c", "#c0392b", "#5b9e5b", "#9b6fb5", "#9aa5b1")


def plot_e2e_breakdown(d: dict, out: Path, written: list[Path]) -> None:
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
            entries.append((breakdown_label(k), bd[k]))
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
    """bench_step's rows (report_data.load_steps): the eager step's breakdown at each batch, with
    the compiled step time."""
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
                e,
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
    _breakdown_figure(d, entries, title, "step_b*_h200.json", out, "step_breakdown.png", written)


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
