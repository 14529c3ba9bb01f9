"""A prefill chunk's indexer and the rows its attention reads, with and without the device prefill
buffer (``EngineConfig.prefill_buffer``; docs/prefetch.md, "Prefill").

    python -m benchmarks.bench_prefill_gather --out $OUT/prefill_gather_h200.json

One ``--chunk``-query chunk at the end of each ``--ctx`` context (64 index heads, top-2048, fp8
rows of 656 B in pinned host memory), the block table ``--model-len`` tokens wide as a compiled
prefill's is (it sets the query blocks: ``score_rows``). Per chunk, the median of CUDA-graph
replays, side by side in one run:
- ``indexer``: ``prefill_indexer_topk`` alone (the indexer of the buffered path);
- ``buffer_read``: the buffered path's read of the context (``prefill_kv[positions]``);
- ``dense_host``: every position of the context read from the host (the path without the buffer
  before the gather op);
- ``gather_after``: the gather op with each block's rows copied in a launch after its selection;
- ``gather_fused[cfg]``: the gather op with the copies in the next block's scores launch, for
  each ``--copy-progs`` (copy programs per launch);
- ``copy_all`` / ``copy_late``: marking and copying alone, the whole chunk's selection and the
  last block's new rows (the rows no overlap can hide);
- with DeepGEMM installed, ``indexer_deep_gemm`` and ``gather_deep_gemm``: the scores backend
  ``kernel_backend="auto"`` gives a 2048-token chunk, whose copies run after the selection.
``bound_ms = indexer + copy_late + max(0, copy_all - copy_late - indexer)`` is what perfect
overlap allows (the earlier blocks' copies wholly under the scoring); ``of_bound`` = bound /
fused. Random keys select nearly independent rows per query, so a block's union is close to the
whole context: the most a chunk can copy (a real model's selections overlap more: fewer rows).
The op's outputs are checked against the reference (rows of the same selection) once per size.
``--dry-run``: the same code at toy sizes on CPU (Triton interpreter), one untimed-quality call
per part (tests/test_bench_checks.py runs it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # read when the kernels are defined, so before importing them
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from benchmarks.cuda_timer import graph_time  # noqa: E402
from custom_ops import prefill_gather as pg  # noqa: E402
from custom_ops import prefill_gather_kernels as pgk  # noqa: E402
from custom_ops import prefill_kernels as pk  # noqa: E402
from custom_ops.cache.host_pool import allocate_host_rows  # noqa: E402
from custom_ops.kv_format import PAGE  # noqa: E402
from tests.test_prefill_ops import make_prefill_inputs  # noqa: E402

ROW = 656  # fp8 rows


def wall_ms(fn) -> float:
    """The dry run's timer: one call's wall time (interpreted: checks the code, not a speed)."""
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def bench_one(res: dict, ctx: int, a, gen: torch.Generator) -> None:
    T, P, dev = a.chunk, -(-max(a.model_len, ctx) // PAGE), gen.device
    inp = make_prefill_inputs(P, a.heads, T, ctx - T, 0, gen)
    (host,) = allocate_host_rows(1, (P + 3) * PAGE, ROW, dev, pinned=True)
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, device=dev, generator=gen))
    dev_rows = torch.randint(0, 256, (P * PAGE + 1, ROW), dtype=torch.uint8, device=dev)
    bt, L = inp["block_table"], P * PAGE
    pos_all = torch.arange(L, device=dev)
    slots_all = bt[0, pos_all // PAGE].long() * PAGE + pos_all % PAGE
    cfg = a.indexer_config
    qb = pk.score_rows(L, T, cfg.score_elems)
    k = a.topk
    row: dict = {"ctx": ctx, "chunk": T, "block_table_tokens": L, "query_block": qb,
                 "blocks": -(-T // qb), "ms": {}}  # fmt: skip
    sel = pk.prefill_indexer_topk_cuda(**inp, topk=k, cfg=cfg)
    last = (T - 1) // qb * qb
    early = pg.selected_positions(sel[:last], L)
    row["rows_selected"] = int(pg.selected_positions(sel, L).sum())
    row["rows_late"] = row["rows_selected"] - int(early.sum())
    # the op against its reference, once
    s2, rows, copied = pgk.prefill_indexer_topk_gather_cuda(**inp, topk=k, host_kv=host, cfg=cfg)
    want, _ = pg.gather_selected_ref(host, bt, s2)
    row["check"] = bool(torch.equal(s2, sel) and torch.equal(rows, want)
                        and int(copied.sum()) == row["rows_selected"])  # fmt: skip
    g0 = a.gather_configs[0]

    def copy(s, mark=None, g=g0):  # marking and copying the new rows of selection s
        cp = pgk._Copy(host, bt, 1, g, dev)
        if mark is not None:
            cp.mark.copy_(mark)
        cp.mark_new(s, 0)
        cp.copy(0, s.numel())
        return cp.rows

    parts = {
        "indexer": lambda: pk.prefill_indexer_topk_cuda(**inp, topk=k, cfg=cfg),
        "buffer_read": lambda: dev_rows[pos_all],
        "dense_host": lambda: host[slots_all],
        "gather_after": lambda: pgk.prefill_indexer_topk_gather_cuda(
            **inp, topk=k, host_kv=host, cfg=cfg, fuse=False
        ),
        "copy_all": lambda: copy(sel),
        "copy_late": lambda: copy(sel[last:], early.int()),
    }
    if a.deep_gemm:  # the scores backend a 2048-token chunk gets on the H200 by default
        parts["indexer_deep_gemm"] = lambda: pk.prefill_indexer_topk_cuda(
            **inp, topk=k, cfg=cfg, logits_backend="deep_gemm"
        )
        parts["gather_deep_gemm"] = lambda: pgk.prefill_indexer_topk_gather_cuda(
            **inp, topk=k, host_kv=host, cfg=cfg, logits_backend="deep_gemm"
        )
    for n, g in zip(a.copy_progs, a.gather_configs):
        parts[f"gather_fused[{n}]"] = lambda g=g: pgk.prefill_indexer_topk_gather_cuda(
            **inp, topk=k, host_kv=host, cfg=cfg, gather=g
        )
    for name, fn in parts.items():
        t = wall_ms(fn) if a.dry_run else graph_time([fn], a.replays).median_us / 1e3
        row["ms"][name] = t
        print(f"ctx {ctx} {name}: {t:.3f} ms", flush=True)
    ms = row["ms"]
    bound = (
        ms["indexer"] + ms["copy_late"] + max(0.0, ms["copy_all"] - ms["copy_late"] - ms["indexer"])
    )
    row["bound_ms"] = bound
    row["of_bound"] = {n: bound / ms[f"gather_fused[{n}]"] for n in a.copy_progs}
    row["copy_GBps"] = row["rows_selected"] * ROW / ms["copy_all"] / 1e6
    row["buffer_bytes_per_layer"] = (L + 1) * ROW
    res["sizes"].append(row)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/prefill_gather_h200.json")
    ap.add_argument("--ctx", default="32768,100000", help="contexts (the chunk ends there)")
    ap.add_argument("--model-len", type=int, default=131072, help="block table width (tokens)")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--copy-progs", default="8,16,32", help="copy programs of a fused launch")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU, checks only")
    a = ap.parse_args(argv)
    a.copy_progs = [int(x) for x in a.copy_progs.split(",") if x]
    a.heads, a.indexer_config = 64, pk.PrefillIndexerConfig()
    try:
        import deep_gemm  # noqa: F401

        a.deep_gemm = not a.dry_run
    except ImportError:
        a.deep_gemm = False
    a.gather_configs = [pgk.GatherConfig(copy_progs=n) for n in a.copy_progs]
    if a.dry_run:  # toy sizes: several query blocks, small launches
        a.ctx, a.model_len, a.chunk, a.topk, a.heads = "200", 256, 48, 16, 4
        a.indexer_config = pk.PrefillIndexerConfig(block_q=16, block_t=64, score_elems=16 * 256)
        a.gather_configs = [pgk.GatherConfig(copy_progs=n, block_rows=4, block_words=64)
                            for n in a.copy_progs]  # fmt: skip
    elif not torch.cuda.is_available():
        print("bench_prefill_gather: needs a CUDA device (or --dry-run)")
        return 1
    import triton

    res: dict = {
        "environment": {
            "device": "cpu (interpreter)" if a.dry_run else torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        },
        "command": "python -m benchmarks.bench_prefill_gather "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "gather_config": repr(pgk.GatherConfig()),
        "deep_gemm": a.deep_gemm,
        "sizes": [],
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cpu" if a.dry_run else "cuda").manual_seed(0)
    for ctx in (int(x) for x in a.ctx.split(",") if x):
        bench_one(res, ctx, a, gen)
        out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
