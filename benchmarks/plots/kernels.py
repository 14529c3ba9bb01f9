"""decode_kernels_h200.json: kernel time per swept configuration against the targets."""

from __future__ import annotations

from pathlib import Path

from benchmarks.plots.common import C_BASE, C_BEST, C_OLD, C_OTHER, C_TARGET, plt, save, source_note


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
