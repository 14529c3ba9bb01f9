"""What every figure shares: the Agg backend, colours, the source line, saving."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 90
C_OLD, C_BEST, C_OTHER, C_BASE, C_TARGET = "#9aa5b1", "#2a7ab0", "#c7d6e3", "#e08a3c", "#c0392b"


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


def batch_axes(ax, xs: list[int], ylabel: str) -> None:
    """A panel over batch sizes: log2 x axis with the sizes as ticks, y from 0, grid, legend."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_ylim(bottom=0)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)


def finish_grid(fig, axes, used: int, title: str, d: dict, file: str, out: Path, name: str,
                written: list[Path]) -> None:  # fmt: skip
    """A grid of panels: blank the unused ones, title, source line, layout, save."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    source_note(fig, d, file)
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    save(fig, out, name, written)
