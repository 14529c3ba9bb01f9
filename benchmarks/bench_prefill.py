"""Long-context prefill on one GPU (H200): the sparse prefill ops and the TTFT they give.

    python -m benchmarks.bench_prefill --out benchmarks/results/prefill_h200.json

On the bench preset (real V3.2 attention and indexer dimensions, ``--layers`` 4, ``--experts`` 16):
1. correctness of each prefill kernel against its reference on the GPU (PASS/FAIL, recorded;
   a failure never stops the timings): indexer logits, top-k, the whole indexer op, attention (the
   prefill attention kernel, every configuration timed below, and the old path: the decode kernel);
2. TTFT of one prompt of each ``--ttft`` length (default 8K, 32K, 100K): every chunk of
   ``--chunk`` tokens through the model (eager, as the engine's eager prefill runs it: block table
   as wide as the prompt so far) with the KV written through to pinned host memory, then the last
   token's logits. ``first_s`` is the first run at that length (the allocator grows its cache),
   ``ttft_s`` the median of the ``--ttft-reps`` - 1 runs after it. Side by side: the old explicit
   path (model/prefill_ref.py) at ``--old`` only (8K: at ~48 s per 32K prompt it does not fit the
   budget) and the old attention path (the decode kernel per query) at ``--old-attn``; and at
   ``--no-buffer-ttft`` the same model on a cache without the device prefill buffer
   (``EngineConfig.prefill_buffer=False``, path ``sparse_no_buffer``), whose last logits after a
   two-chunk warm-up must equal the buffered path's (``no_buffer_logits_equal``);
3. (run last) prefill throughput: ``--tput`` prompts of ``--tput-len`` tokens back to back;
4. where the time goes for one chunk at the end of a ``--profile-ctx`` context, each part timed
   alone with CUDA events on the model's own shapes: indexer logits, top-k, attention (and the old
   attention path next to it), MoE, and the rest of a layer (projections, norms, rope, KV
   write-through) = the whole layer minus those, each with its achieved TFLOP/s; then launch
   configurations side by side: logits, top-k (the radix select), attention (prefill kernel and
   decode kernel), each checked against the default's result.
5. (run first, after the checks) DeepGEMM's ``fp8_mqa_logits`` as the indexer's scores backend
   (``kernel_backend``: docs/backends.md) next to the Triton kernel, one ``--chunk``-query chunk
   at the end of each ``--dg-ctx`` context (64 index heads): the logits step alone (DeepGEMM
   with and without its causal clean-up, and the key gather it needs), the whole
   ``prefill_indexer_topk`` by each, CUDA-graph replays, TFLOP/s on the causal work, and the
   ``prefill_auto_table`` the timings suggest; its correctness checks join 1. Without deep_gemm
   (or on CPU) these are skipped and say so. ``--kernel-backend`` picks the TTFT runs' backend;
   the lengths in ``--dg-ttft`` also run with each scores backend forced (paths
   ``sparse_triton`` and ``sparse_deep_gemm``; ``sparse`` is the resolved ``--kernel-backend``).
JSON is written after every measurement; sizes past ``--budget-s`` seconds are skipped (recorded).
``--dry-run`` runs the same code with the tiny preset at toy sizes on CPU (Triton interpreter).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

if "--dry-run" in sys.argv:  # read when the kernels are defined, so before importing them
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from benchmarks.cuda_timer import graph_time  # noqa: E402
from custom_ops import attention_kernels as ak  # noqa: E402
from custom_ops import indexer_kernels as ik  # noqa: E402
from custom_ops import prefill as pf  # noqa: E402
from custom_ops import prefill_attn_kernels as pa  # noqa: E402
from custom_ops import prefill_kernels as pk  # noqa: E402
from custom_ops.backends import deep_gemm_prefill_kernels as dpk  # noqa: E402
from custom_ops.backends import select as sel  # noqa: E402
from custom_ops.backends.deep_gemm_ops import prefill_logits_width  # noqa: E402
from custom_ops.cache.config import CacheConfig  # noqa: E402
from custom_ops.cache.kv_cache import KVCache  # noqa: E402
from custom_ops.kv_format import PAGE, pages_for  # noqa: E402
from echo_compile.bench.model_builder import build_model  # noqa: E402
from echo_compile.bench.result import environment  # noqa: E402
from model.forward_meta import ForwardMeta  # noqa: E402
from model.prefill_ref import explicit_prefill_in  # noqa: E402
from model.quantize import quantize_in_memory  # noqa: E402
from tests.test_decode_kernels import attention_close, check_scores, make_pool  # noqa: E402
from tests.test_prefill_ops import (  # noqa: E402
    PREFILL_SCORE_REL,
    check_selection_near_ties,
    magnitudes,
    make_prefill_inputs,
)

START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {msg}", flush=True)


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, dev: str, reps: int = 1) -> float:
    """Median wall seconds of ``fn()`` (synchronised), over ``reps`` runs."""
    ts = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


# the prefill attention kernel's configurations timed side by side (the first is the default)
ATTN_CFGS = [
    pa.PrefillAttnConfig(),
    pa.PrefillAttnConfig(dequant_first=False),
    pa.PrefillAttnConfig(block_k=32, num_stages=4),
    pa.PrefillAttnConfig(num_warps=16),
    # all 128 heads in one program (each row read once per query; q alone is 144 KB of shared
    # memory, so few stages): exploratory, may not fit or may spill
    pa.PrefillAttnConfig(block_h=128, num_warps=16, num_stages=1),
    pa.PrefillAttnConfig(block_h=128, block_k=32, num_warps=16, num_stages=2),
]
# the old path (the decode kernel) at its default and at its best decode configuration
OLD_ATTN_CFGS = [ak.MlaConfig(), ak.MlaConfig(num_stages=3)]
# the radix select's launch shapes (the default first)
SELECT_CFGS = [
    ik.IndexerConfig(),
    ik.IndexerConfig(sel_warps=8),
    ik.IndexerConfig(sel_block=1024),
    ik.IndexerConfig(sel_block=4096, sel_warps=8),
]


@contextlib.contextmanager
def old_attention():
    """echo::sparse_mla_prefill's CUDA path as it was: the decode kernel per query (the op looks
    the launcher up in custom_ops.prefill_kernels at every call)."""
    new = pk.sparse_mla_prefill_cuda
    pk.sparse_mla_prefill_cuda = pk.sparse_mla_prefill_decode_kernel
    try:
        yield
    finally:
        pk.sparse_mla_prefill_cuda = new


HEADS_DG = (32, 64)  # DeepGEMM's SM90 fp8_mqa_logits (custom_ops/backends/deep_gemm_ops.HEADS)
DG_REL = 2**-10  # DeepGEMM's scores vs the reference: decode's bound (docs/backends.md)


def dg_unavailable(dev: str) -> str | None:
    """Why DeepGEMM's prefill scores cannot run here (None: they can)."""
    if not dev.startswith("cuda"):
        return "not on CUDA (dry run)"
    if not sel.installed("deep_gemm"):
        return "deep_gemm is not installed (the [kernels] extra or the carried wheel)"
    return None


@contextlib.contextmanager
def prefill_scores_by(cache: KVCache, backend: str):
    """Every layer's prefill scores by ``backend`` (``LayerKV.prefill_plan``, read at each eager
    prefill call), then back."""
    old = [layer.prefill_plan for layer in cache.layers]
    for layer in cache.layers:
        layer.prefill_plan = ((1, backend),)
    try:
        yield
    finally:
        for layer, p in zip(cache.layers, old):
            layer.prefill_plan = p


def _dg_times(row: dict, a, ctx: int, cfg: pk.PrefillIndexerConfig, dev: str) -> bool:
    """One context's timings into ``row``; returns whether DeepGEMM's whole op was faster."""
    T = a.chunk
    P = pages_for(ctx)
    L, W = P * PAGE, prefill_logits_width(P * PAGE)
    gen = torch.Generator(device=dev).manual_seed(ctx)
    inp = make_prefill_inputs(P, 64, T, ctx - T, 0, gen)  # the last chunk of the context
    q, w, ic, bt, pos = inp.values()
    flops = 2.0 * float((pos + 1).sum()) * 64 * 128  # the causal work
    qb = pk.score_rows(L, T, cfg.score_elems)
    qbw = dpk.query_rows(W, T, cfg.score_elems, 64, dpk.num_sms())  # as the op's DeepGEMM path
    row |= {
        "flops": flops,
        "width": W,
        "query_blocks": -(-T // qb),
        "dg_query_blocks": -(-T // qbw),
    }

    def tri_logits():  # step (a) of the op's Triton path, block by block
        for s in range(0, T, qb):
            pk.prefill_index_logits(q[s : s + qb], w[s : s + qb], ic, bt, pos[s : s + qb])

    def dg_logits(clean: bool):  # step (a) of the op's DeepGEMM path (clean: the logits op's)
        kv, sf = dpk.gather_index_keys(ic, bt)
        for s in range(0, T, qbw):
            e = min(T, s + qbw)
            dpk.prefill_scores(q[s:e], w[s:e], kv, sf, pos[s:e], W, clean)

    def whole(backend: str):
        return pk.prefill_indexer_topk_cuda(q, w, ic, bt, pos, a.index_topk, cfg, backend)

    timed_fns = {
        "logits_triton": tri_logits,
        "logits_deep_gemm": lambda: dg_logits(False),
        "logits_deep_gemm_clean": lambda: dg_logits(True),
        "gather_deep_gemm": lambda: dpk.gather_index_keys(ic, bt),
        "indexer_topk_triton": lambda: whole("triton"),
        "indexer_topk_deep_gemm": lambda: whole("deep_gemm"),
    }
    for name, fn in timed_fns.items():
        t = graph_time([fn], replays=a.dg_reps, warm=1)
        row[name + "_ms"] = t.median_us / 1e3
        if not name.startswith("gather"):
            row[name + "_tflop_s"] = flops / (t.median_us * 1e-6) / 1e12
        log(f"dg_indexer ctx {ctx} {name}: {row[name + '_ms']:.3f} ms")
    # information: the two backends round differently, so sets may part at near-ties
    same = (whole("triton") == whole("deep_gemm")).all(1)
    row["rows_identical_triton_vs_deep_gemm"] = float(same.float().mean())
    return row["indexer_topk_deep_gemm_ms"] < row["indexer_topk_triton_ms"]


def bench_dg_indexer(res: dict, a, dev: str) -> None:
    """Triton vs DeepGEMM prefill scores, and the whole indexer op by each, side by side."""
    out = res["dg_indexer"] = {"chunk": a.chunk, "heads": 64, "rows": []}
    why = dg_unavailable(dev)
    if why is not None:
        out["skipped"] = why
        log(f"dg_indexer skipped: {why}")
        return
    cfg = pk.PrefillIndexerConfig()
    faster: list[bool] = []
    for ctx in [int(x) for x in a.dg_ctx.split(",") if x]:
        row: dict = {"ctx": ctx}
        out["rows"].append(row)
        if time.monotonic() - START > a.budget_s:
            row["skipped"] = "over --budget-s"
            continue
        try:
            faster.append(_dg_times(row, a, ctx, cfg, dev))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        write(res, a.out)
    if faster:
        # select.PREFILL_AUTO_TABLE's rows (min chunk tokens, backend), from one chunk size
        out["prefill_auto_table"] = [[1, "deep_gemm" if all(faster) else "triton"]]
        out["note"] = (
            f"measured at a {a.chunk}-token chunk only; deep_gemm suggested only if its whole "
            "prefill_indexer_topk was faster at every --dg-ctx"
        )


def _cfg_dict(c) -> dict:
    return {k: v for k, v in c.__dict__.items() if not isinstance(v, ik.IndexerConfig)}


def check_kernels(res: dict, dev: str, small: bool) -> None:
    """Each prefill kernel against its reference on the device; PASS/FAIL into res."""
    out = res["correctness"] = {}
    gen = torch.Generator(device=dev).manual_seed(1)
    P, Hi, T, start = (5, 4, 40, 150) if small else (64, 64, 512, 3000)
    cfg = pk.PrefillIndexerConfig(score_elems=16 * P * PAGE) if small else pk.PrefillIndexerConfig()

    def case(name: str, fn) -> None:
        try:
            fn()
            out[name] = "PASS"
        except Exception as e:  # report and go on: one failure must not hide the timings
            out[name] = f"FAIL: {type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        log(f"check {name}: {out[name][:200]}")

    inp = make_prefill_inputs(P, Hi, T, start, 7, gen)
    topk = 32 if small else 2048

    def logits() -> None:
        ref = pf.prefill_index_logits_ref(**inp)
        check_scores(
            pk.prefill_index_logits(**inp, cfg=cfg), ref, magnitudes(inp), PREFILL_SCORE_REL
        )

    def select() -> None:
        s = pf.prefill_index_logits_ref(**inp)
        want = pf.prefill_topk_from_scores_ref(s, inp["positions"], topk)
        got = pk.prefill_topk_from_scores(s, inp["positions"], topk, cfg)
        assert torch.equal(got, want), "top-k differs from the reference on the same scores"
        # one program per row (the count pass skipped: the usual case at real prefill sizes)
        blk = ik.IndexerConfig().sel_block  # a chunk must be a multiple of it
        one = pk.PrefillIndexerConfig(
            select=ik.IndexerConfig(sel_chunk=-(-s.shape[1] // blk) * blk)
        )
        got = pk.prefill_topk_from_scores(s, inp["positions"], topk, one)
        assert torch.equal(got, want), "one-chunk top-k differs from the reference"

    def whole() -> None:
        want = pf.prefill_indexer_topk_ref(**inp, topk=topk)
        got = pk.prefill_indexer_topk_cuda(**inp, topk=topk, cfg=cfg)
        # the kernel's FP8 scores round differently: sets may part at near-ties of the k-th only
        ref = pf.prefill_index_logits_ref(**inp)
        out["indexer_rows_identical"] = check_selection_near_ties(
            got, want, ref, magnitudes(inp), PREFILL_SCORE_REL
        )

    def attention(fmt: str) -> None:
        Ta, H, L, K = (6, 4, 150, 48) if small else (256, 128, 8192, 2048)
        q = (torch.randn(Ta, H, 576, generator=gen, device=dev) * 0.3).bfloat16()
        rows = make_pool(L, fmt, gen)
        sel = torch.rand(Ta, L, generator=gen, device=dev).argsort(1)[:, :K].sort(1).values.int()
        sel[0, K // 2 :] = -1
        sel[1, 7 : K // 3] = -1  # unused entries inside the list
        ref = pf.sparse_mla_prefill_ref(q, rows, sel, 0.1352, fmt)
        # min_programs=1: the prefill kernel itself even at the small (dry-run) sizes
        outs = [pa.sparse_mla_prefill_attn(q, rows, sel, 0.1352, fmt, pa.PrefillAttnConfig(
            **{**c.__dict__, "min_programs": 1})) for c in ATTN_CFGS]  # fmt: skip
        old = pk.sparse_mla_prefill_decode_kernel(q, rows, sel, 0.1352, fmt)
        unsplit = ak.sparse_mla_decode_cuda(q, rows, sel, 0.1352, fmt, ak.MlaConfig(n_split=1))
        # information, not the contract: the same loop as the unsplit decode kernel
        out[f"attention_{fmt}_bit_equal_to_decode_unsplit"] = [torch.equal(o, unsplit)
                                                               for o in outs]  # fmt: skip
        attention_close(old, ref)
        for c, o in zip(ATTN_CFGS, outs):
            try:
                attention_close(o, ref)
            except AssertionError as e:
                raise AssertionError(f"config {_cfg_dict(c)}: {e}") from e

    if dg_unavailable(dev) is None:
        heads = 64  # DeepGEMM's SM90 kernel takes 32 or 64 (the bench model has 64)
        dg_in = inp if Hi in HEADS_DG else make_prefill_inputs(P, heads, T, start, 7, gen)

        def dg_logits() -> None:
            got = torch.ops.echo.dg_prefill_logits(*dg_in.values())
            ref = pf.prefill_index_logits_ref(**dg_in)
            L = ref.shape[1]
            dead = torch.isinf(ref)
            assert torch.equal(torch.isinf(got[:, :L]), dead), "-inf not exactly at t > p"
            assert bool((got[:, L:] == float("-inf")).all()), "columns past L not -inf"
            err = ((got[:, :L] - ref).abs() / magnitudes(dg_in).clamp(min=1e-30))[~dead]
            out["dg_prefill_logits_max_err"] = float(err.max())
            assert float(err.max()) <= DG_REL, f"error {float(err.max()):.2e} > 2^-10"

        def dg_whole() -> None:
            want = pf.prefill_indexer_topk_ref(**dg_in, topk=topk)
            got = pk.prefill_indexer_topk_cuda(
                **dg_in, topk=topk, cfg=cfg, logits_backend="deep_gemm"
            )
            ref = pf.prefill_index_logits_ref(**dg_in)
            out["dg_indexer_rows_identical"] = check_selection_near_ties(
                got, want, ref, magnitudes(dg_in), DG_REL
            )

        case("dg_prefill_logits", dg_logits)
        case("dg_prefill_indexer_topk", dg_whole)
    else:
        out["deep_gemm"] = f"skipped: {dg_unavailable(dev)}"
    case("prefill_index_logits", logits)
    case("prefill_topk_from_scores", select)
    case("prefill_indexer_topk", whole)
    case("sparse_mla_prefill_bf16", lambda: attention("bf16"))
    case("sparse_mla_prefill_fp8", lambda: attention("fp8"))

    def dequant() -> None:
        from custom_ops.kv_format import unpack_kv_rows

        rows = make_pool(300 if small else 100_000, "fp8", gen)
        got = pa.dequant_rows(rows).view(torch.bfloat16)
        assert torch.equal(got, unpack_kv_rows(rows, "fp8")), "dequantised rows differ"

    case("dequant_rows", dequant)


class Prefiller:
    """One request's prefill through the model, chunk by chunk (what the engine's eager prefill
    does, without the scheduler), on a cache sized for ``max_len`` tokens."""

    def __init__(
        self, model, max_len: int, fmt: str, chunk: int, dev: str, kernel_backend: str = "auto",
        buffer: bool = True,
    ):  # fmt: skip
        self.model, self.chunk, self.dev = model, chunk, dev
        c = model.config
        n = pages_for(max_len) * PAGE
        cc = CacheConfig(c.num_hidden_layers, n, max(c.index_topk, PAGE), c.index_topk, fmt,
                         offload=dev.startswith("cuda"), max_batch=1,
                         prefill_tokens=n if buffer else 0,
                         kernel_backend=kernel_backend,
                         index_heads=c.index_n_heads)  # fmt: skip
        self.cache = KVCache(cc, dev)
        self.vocab = c.vocab_size

    def meta(self, ids: torch.Tensor, s: int, e: int) -> ForwardMeta:
        d = self.dev
        n = e - s
        pages = pages_for(e)
        return ForwardMeta(
            ids[s:e],
            torch.arange(s, e, device=d),
            torch.arange(s, e, device=d),  # host slot = position: pages 0, 1, ... in order
            torch.arange(pages, dtype=torch.int32, device=d)[None],
            torch.tensor([e], dtype=torch.int32, device=d),
            torch.tensor([n - 1], device=d),
            is_decode=False,
        )

    def run(self, n_tokens: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator(device=self.dev).manual_seed(seed)
        ids = torch.randint(2, self.vocab, (n_tokens,), generator=g, device=self.dev)
        logits = None
        with torch.no_grad():
            for s in range(0, n_tokens, self.chunk):
                logits = self.model(self.meta(ids, s, min(n_tokens, s + self.chunk)), self.cache)
        return logits


@contextlib.contextmanager
def awq_pair_linears():
    """AWQ linears of any token count on the pair kernel: the large-M rule
    (``awq_pairs_kernels.uses_dequant``, dequantise once then cuBLAS) off, as before it."""
    from custom_ops import awq_pairs_kernels as PK

    saved, PK.DEQUANT_MIN_M = PK.DEQUANT_MIN_M, 1 << 62
    try:
        yield
    finally:
        PK.DEQUANT_MIN_M = saved


def bench_ttft(res: dict, model, a, dev: str) -> None:
    out = res["ttft"] = []
    lens = [int(x) for x in a.ttft.split(",") if x]
    old = {int(x) for x in a.old.split(",") if x}
    old_attn = {int(x) for x in a.old_attn.split(",") if x}
    dg_lens = {int(x) for x in a.dg_ttft.split(",") if x} if dg_unavailable(dev) is None else set()
    pre = Prefiller(model, max(lens + [a.tput_len, a.profile_ctx]), a.kv_format, a.chunk, dev,
                    a.kernel_backend)  # fmt: skip
    res["prefiller"] = pre  # reused below (not serialised)
    nb_lens = [n for n in (int(x) for x in a.no_buffer_ttft.split(",") if x) if n in lens]
    # EngineConfig.prefill_buffer=False: the same model on a cache without the buffer, whose
    # chunks copy only the rows their queries select from the host (prefill_indexer_topk_gather)
    pre_nb = (Prefiller(model, max(nb_lens), a.kv_format, a.chunk, dev, a.kernel_backend,
                        buffer=False) if nb_lens else None)  # fmt: skip
    res["prefill_plan"] = [list(r) for r in pre.cache.layers[0].prefill_plan]  # as resolved
    log("warm-up (Triton compiles)")
    pre.run(min(2 * a.chunk, max(lens)))
    if dg_lens:  # the two scores backends side by side, whatever --kernel-backend resolved to
        for by in ("triton", "deep_gemm"):
            with prefill_scores_by(pre.cache, by):
                pre.run(min(2 * a.chunk, max(lens)))
    if pre_nb is not None:  # warm-up, and its last logits against the buffered path's
        n = min(2 * a.chunk, max(nb_lens))
        same = torch.equal(pre_nb.run(n), pre.run(n))
        res["no_buffer_logits_equal"] = {n: same}
        if not same:  # recorded as the checks' failures are; the timings still run
            res.setdefault("errors", {})["no_buffer"] = f"logits differ at {n} tokens"
        log(f"no buffer: logits equal to the buffered path's at {n} tokens: {same}")
    with explicit_prefill_in(model):
        pre.run(min(a.chunk + 64, max(lens)))
    with old_attention():
        pre.run(min(2 * a.chunk, max(lens)))
    pair_lens = {int(x) for x in a.awq_pair_ttft.split(",") if x} if a.weights == "awq" else set()
    if pair_lens:
        with awq_pair_linears():
            pre.run(min(2 * a.chunk, max(lens)))
    for n in lens:
        paths = ["sparse"] + ["sparse_triton", "sparse_deep_gemm"] * (n in dg_lens)
        paths += ["sparse_awq_pair_linears"] * (n in pair_lens)
        paths += ["sparse_no_buffer"] * (n in nb_lens)
        paths += ["sparse_old_attention"] * (n in old_attn) + ["explicit"] * (n in old)
        for path in paths:
            row = {"tokens": n, "path": path, "chunk": a.chunk}
            if time.monotonic() - START > a.budget_s:
                row["skipped"] = "over --budget-s"
            else:
                try:
                    ctx = {"explicit": lambda: explicit_prefill_in(model),
                           "sparse_old_attention": old_attention,
                           "sparse_triton": lambda: prefill_scores_by(pre.cache, "triton"),
                           "sparse_deep_gemm": lambda: prefill_scores_by(pre.cache, "deep_gemm"),
                           "sparse_awq_pair_linears": awq_pair_linears,
                           }.get(path, contextlib.nullcontext)  # fmt: skip
                    p = pre_nb if path == "sparse_no_buffer" else pre
                    with ctx():
                        row["first_s"] = timed(lambda n=n, p=p: p.run(n), dev)
                        # the warm runs, while the budget allows them
                        if a.ttft_reps > 1 and (
                            time.monotonic() - START + row["first_s"] * (a.ttft_reps - 1)
                            < a.budget_s
                        ):
                            row["ttft_s"] = timed(lambda n=n, p=p: p.run(n), dev, a.ttft_reps - 1)
                        else:
                            row["ttft_s"] = row["first_s"]
                            row["note"] = "one run only (--ttft-reps 1 or the budget)"
                    row["tokens_per_s"] = n / row["ttft_s"]
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:2000]
                    traceback.print_exc()
            out.append(row)
            log(f"ttft {row}")
            write(res, a.out)


def bench_throughput(res: dict, a, dev: str) -> None:
    pre = res["prefiller"]
    row = res["throughput"] = {"prompts": a.tput, "tokens_each": a.tput_len}
    if time.monotonic() - START > a.budget_s:
        row["skipped"] = "over --budget-s"
        return
    t = timed(lambda: [pre.run(a.tput_len, seed=i) for i in range(a.tput)], dev)
    row |= {"seconds": t, "tokens_per_s": a.tput * a.tput_len / t}
    log(f"throughput {row}")


def _layer_flops(cfg, T: int, ctx_sum: int) -> dict[str, float]:
    """FLOPs of one layer's parts for T tokens whose causal lengths sum to ctx_sum."""
    D, H, Hi = cfg.hidden_size, cfg.num_attention_heads, cfg.index_n_heads
    ql, nope, rope, v = cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    K = cfg.index_topk
    proj = D * ql + ql * H * (nope + rope) + D * 576 + H * v * D  # MLA projections
    proj += ql * Hi * 128 + D * 128 + D * Hi  # indexer projections
    proj += H * nope * 512 + H * 512 * v  # absorption of kv_b_proj into q and o
    moe = (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * D * cfg.moe_intermediate_size
    return {
        "indexer": 2.0 * ctx_sum * Hi * 128,
        "attention": 2.0 * T * H * min(K, ctx_sum // T) * (576 + 512),
        "moe": 2.0 * T * moe,
        "projections_etc": 2.0 * T * proj,
    }


def bench_profile(res: dict, model, a, dev: str) -> None:
    """One chunk at the end of a profile_ctx context: each part alone, then the whole layer."""
    out = res["profile"] = {"ctx": a.profile_ctx, "chunk": a.chunk, "parts": {}}
    if time.monotonic() - START > a.budget_s:
        out["skipped"] = "over --budget-s"
        return
    pre = res["prefiller"]
    pre.run(a.profile_ctx)  # fills the cache: the chunk's context is real rows
    cfg = model.config
    T, n = a.chunk, a.profile_ctx
    s = n - T
    ids = torch.randint(2, cfg.vocab_size, (n,), device=dev)
    meta = pre.meta(ids, s, n)
    layer_id = min(cfg.first_k_dense_replace, cfg.num_hidden_layers - 1)  # an MoE layer
    block = model.model.layers[layer_id]
    cl = pre.cache.layers[layer_id]
    mla = block.self_attn
    x = (torch.randn(T, cfg.hidden_size, device=dev) * 0.5).bfloat16()
    cos, sin = model.model.rotary_emb(meta.positions)
    with torch.no_grad():
        qr = mla.q_a_layernorm(mla.q_a_proj(x))
        q_idx, w_idx, _ = mla.indexer(x, qr, cos, sin)
        q_u8 = q_idx.view(torch.uint8)
        bt, pos = meta.block_table, meta.positions
        rows_needed = pk.score_rows(bt.shape[1] * PAGE, T, pk.PrefillIndexerConfig().score_elems)
        qs = slice(T - rows_needed, T)  # the last query block (the longest contexts)
        scores = pk.prefill_index_logits(q_u8[qs], w_idx[qs], cl.index_k, bt, pos[qs])
        L_all = bt.shape[1] * PAGE
        rows_all = cl.read(torch.arange(L_all, device=dev), torch.arange(L_all, device=dev))
        sel = torch.ops.echo.prefill_indexer_topk(q_u8, w_idx, cl.index_k, bt, pos, cfg.index_topk)
        q = (torch.randn(T, mla.n_heads, 576, device=dev) * 0.3).bfloat16()
        n_blocks = -(-T // rows_needed)
        parts = {
            "indexer": lambda: pk.prefill_index_logits(
                q_u8[qs], w_idx[qs], cl.index_k, bt, pos[qs]
            ),
            "topk": lambda: pk.prefill_topk_from_scores(scores, pos[qs], cfg.index_topk),
            "attention": lambda: torch.ops.echo.sparse_mla_prefill(
                q, rows_all, sel, mla.softmax_scale, cl.fmt
            ),
            "attention_old": lambda: pk.sparse_mla_prefill_decode_kernel(
                q, rows_all, sel, mla.softmax_scale, cl.fmt
            ),
            "moe": lambda: block.mlp(x),
            "layer": lambda: block(x, None, cos, sin, meta, cl),
        }
        times = {k: timed(f, dev, reps=a.reps) for k, f in parts.items()}
    # the indexer and top-k ran for one query block: scale to the chunk's n_blocks blocks
    times["indexer"] *= n_blocks
    times["topk"] *= n_blocks
    # the layer ran the new attention: the old one is reported next to it, not subtracted
    times["projections_etc"] = times["layer"] - sum(
        times[k] for k in ("indexer", "topk", "attention", "moe")
    )
    ctx_sum = int((pos + 1).sum())
    flops = _layer_flops(cfg, T, ctx_sum)
    flops["attention_old"] = flops["attention"]
    for k, t in times.items():
        row = {"ms": t * 1e3}
        if k in flops and t > 0:
            row |= {"flops": flops[k], "tflop_s": flops[k] / t / 1e12}
        out["parts"][k] = row
    # launch configurations side by side (the logits default is the fastest of an earlier run)
    out["configs"] = []
    logit_cfgs = [
        pk.PrefillIndexerConfig(),
        pk.PrefillIndexerConfig(block_q=128, block_t=128, num_warps=8, num_stages=2),
        pk.PrefillIndexerConfig(block_q=128, block_t=64, num_warps=4, num_stages=2),
        pk.PrefillIndexerConfig(block_q=128, block_t=128, num_warps=8, num_stages=3),
    ]
    with torch.no_grad():
        # the layer timed above rewrote this chunk's indexer keys: a fresh default result
        base = pk.prefill_index_logits(q_u8[qs], w_idx[qs], cl.index_k, bt, pos[qs])
        for c in logit_cfgs:
            row = {"op": "prefill_index_logits", "config": _cfg_dict(c)}
            try:
                got = pk.prefill_index_logits(q_u8[qs], w_idx[qs], cl.index_k, bt, pos[qs], c)
                row["same_as_default"] = bool(torch.allclose(got, base, rtol=1e-5, atol=1e-6))
                row["ms"] = 1e3 * timed(
                    lambda c=c: pk.prefill_index_logits(
                        q_u8[qs], w_idx[qs], cl.index_k, bt, pos[qs], c
                    ),
                    dev,
                    reps=a.reps,
                )
                row["tflop_s"] = flops["indexer"] / n_blocks / (row["ms"] / 1e3) / 1e12
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            out["configs"].append(row)
            log(f"config {row}")
        o_def = torch.ops.echo.sparse_mla_prefill(q, rows_all, sel, mla.softmax_scale, cl.fmt)
        attn = [("sparse_mla_prefill", c, pa.sparse_mla_prefill_attn) for c in ATTN_CFGS]
        attn += [("sparse_mla_prefill_old", c, pk.sparse_mla_prefill_decode_kernel)
                 for c in OLD_ATTN_CFGS]  # fmt: skip
        for name, c, fn in attn:
            row = {"op": name, "config": _cfg_dict(c)}
            if time.monotonic() - START > a.budget_s:
                row["skipped"] = "over --budget-s"
                out["configs"].append(row)
                continue
            try:
                o = fn(q, rows_all, sel, mla.softmax_scale, cl.fmt, c)
                row["max_diff_vs_default"] = float((o.float() - o_def.float()).abs().max())
                row["bit_equal_to_default"] = bool(torch.equal(o, o_def))
                row["ms"] = 1e3 * timed(
                    lambda c=c, fn=fn: fn(q, rows_all, sel, mla.softmax_scale, cl.fmt, c),
                    dev,
                    reps=a.reps,
                )
                row["tflop_s"] = flops["attention"] / (row["ms"] / 1e3) / 1e12
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            out["configs"].append(row)
            log(f"config {row}")
            write(res, a.out)
        sel_def = pk.prefill_topk_from_scores(scores, pos[qs], cfg.index_topk)
        for sc in SELECT_CFGS:
            c = pk.PrefillIndexerConfig(select=sc)
            row = {"op": "prefill_topk_from_scores", "config": _cfg_dict(sc)}
            try:
                got = pk.prefill_topk_from_scores(scores, pos[qs], cfg.index_topk, c)
                row["same_as_default"] = bool(torch.equal(got, sel_def))  # exact: must be True
                row["ms_per_chunk"] = (
                    n_blocks
                    * 1e3
                    * timed(
                        lambda c=c: pk.prefill_topk_from_scores(scores, pos[qs], cfg.index_topk, c),
                        dev,
                        reps=a.reps,
                    )
                )
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            out["configs"].append(row)
            log(f"config {row}")
        # a long-context block (100K: 320 queries at the default score budget, so the select
        # runs two programs per row and six passes), against one program per row (five)
        Ls = pages_for(a.select_ctx) * PAGE
        rs = pk.score_rows(Ls, T, pk.PrefillIndexerConfig().score_elems)
        pos_s = torch.arange(Ls - rs, Ls, device=dev)
        s_long = torch.randn(rs, Ls, device=dev)
        s_long = s_long.masked_fill(torch.arange(Ls, device=dev)[None] > pos_s[:, None], -torch.inf)
        want = None
        for name, c in (
            ("default", pk.PrefillIndexerConfig()),
            ("one_per_row", pk.PrefillIndexerConfig(select_one_per_row=True)),
            ("one_per_row_8_warps", pk.PrefillIndexerConfig(
                select_one_per_row=True, select=ik.IndexerConfig(sel_warps=8))),
        ):  # fmt: skip
            row = {"op": "prefill_topk_long", "ctx": Ls, "rows": rs, "variant": name}
            try:
                got = pk.prefill_topk_from_scores(s_long, pos_s, cfg.index_topk, c)
                want = got if want is None else want
                row["same_as_default"] = bool(torch.equal(got, want))  # exact: must be True
                row["ms_per_block"] = 1e3 * timed(
                    lambda c=c: pk.prefill_topk_from_scores(s_long, pos_s, cfg.index_topk, c),
                    dev,
                    reps=a.reps,
                )
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            out["configs"].append(row)
            log(f"config {row}")
    out["note"] = (
        "indexer/topk timed on the last query block and scaled by the chunk's block count; "
        "projections_etc = layer - the other parts (projections, norms, rope, KV write-through)"
    )
    log(f"profile {out}")


def write(res: dict, path: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({k: v for k, v in res.items() if k != "prefiller"}, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/prefill_h200.json")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--kv-format", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    ap.add_argument("--ttft", default="8192,32768,100000", help="prompt lengths for TTFT")
    ap.add_argument("--old", default="8192", help="lengths also run with the explicit path")
    ap.add_argument(
        "--old-attn", default="32768", help="lengths also run with the old attention path"
    )
    ap.add_argument(
        "--ttft-reps", type=int, default=2, help="runs per TTFT length: a first, then warm ones"
    )
    ap.add_argument("--tput", type=int, default=8, help="prompts of the throughput run")
    ap.add_argument("--tput-len", type=int, default=32768)
    ap.add_argument("--profile-ctx", type=int, default=32768)
    ap.add_argument(
        "--select-ctx", type=int, default=100_000, help="context of the long top-k comparison"
    )
    ap.add_argument("--reps", type=int, default=5, help="runs per profiled part (median)")
    ap.add_argument(
        "--kernel-backend", choices=sel.BACKENDS, default=sel.DEFAULT_BACKEND,
        help="kernel_backend of the TTFT / throughput / profile runs (docs/backends.md)",
    )  # fmt: skip
    ap.add_argument("--dg-ctx", default="32768,100000", help="contexts of the DeepGEMM comparison")
    ap.add_argument("--dg-reps", type=int, default=10, help="graph replays per DeepGEMM timing")
    ap.add_argument("--dg-ttft", default="32768", help="TTFT lengths also run with DeepGEMM")
    ap.add_argument("--no-buffer-ttft", default="32768,100000",
                    help="TTFT lengths also run without the device prefill buffer "
                         "(EngineConfig.prefill_buffer=False), path sparse_no_buffer")  # fmt: skip
    ap.add_argument("--index-topk", type=int, default=2048, help="top-k of the DeepGEMM comparison")
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip what starts later")
    ap.add_argument("--weights", choices=("bf16", "awq", "fp8"), default="bf16",
                    help="the model's weights, quantised in memory as `echo-compile bench "
                         "--weights` does (TTFT and profile; the throughput run too)")
    ap.add_argument("--awq-pair-ttft", default="32768",
                    help="with --weights awq: TTFT lengths also run with every AWQ linear on the "
                         "pair kernel (the large-M dequantise rule off)")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="tiny preset, toy sizes, CPU")
    a = ap.parse_args(argv)
    dev = "cpu" if a.dry_run else "cuda"
    if a.dry_run:  # toy sizes through the interpreter: exercises every code path, no timings
        a.chunk, a.ttft, a.old, a.old_attn, a.tput, a.tput_len, a.profile_ctx, a.reps = (
            32,
            "48,80",
            "48",
            "80",
            1,
            48,
            80,
            1,
        )
        a.select_ctx = 128
        a.no_buffer_ttft = "80"
    elif not torch.cuda.is_available():
        print("bench_prefill: needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    res: dict = {"environment": environment(), "args": vars(a), "status": "running"}
    write(res, a.out)
    check_kernels(res, dev, small=a.dry_run)
    write(res, a.out)
    try:
        bench_dg_indexer(res, a, dev)
    except Exception as e:
        res.setdefault("errors", {})["dg_indexer"] = f"{type(e).__name__}: {e}"[:2000]
        traceback.print_exc()
    write(res, a.out)
    model = build_model("tiny" if a.dry_run else "bench", a.layers, a.experts, dev)
    res["quantized_modules"] = len(quantize_in_memory(model, a.weights))
    res["model"] = model.config.to_dict()
    for name, fn in (
        ("ttft", lambda: bench_ttft(res, model, a, dev)),
        # before the throughput run: the kernels side by side must not fall to the budget
        ("profile", lambda: bench_profile(res, model, a, dev)),
        ("throughput", lambda: bench_throughput(res, a, dev)),
    ):
        try:
            fn()
        except Exception as e:
            res.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        write(res, a.out)
    res["status"] = "done"
    res["seconds"] = time.monotonic() - START
    write(res, a.out)
    log(f"done in {res['seconds']:.0f} s: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
