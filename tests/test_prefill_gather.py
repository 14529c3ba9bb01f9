"""Prefill without the device prefill buffer: ``echo::prefill_indexer_topk_gather``
(custom_ops/prefill_gather.py) against its definition, its Triton kernels (under the interpreter on
CPU) against the reference, and the engine with ``prefill_buffer=False`` against the engine with
the buffer and against GPU-only, bit for bit (docs/prefetch.md, "Prefill")."""

from __future__ import annotations

import pytest
import torch

from custom_ops import prefill as pf
from custom_ops import prefill_gather as pg
from custom_ops import prefill_gather_kernels as pgk
from custom_ops import prefill_kernels as pk
from custom_ops.kv_format import PAGE
from model.checkpoint import resolve_model
from model.loader import load_model
from model.presets import preset_config
from runtime.engine import Engine
from runtime.engine_config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.tokenizer import Tokenizer
from tests.test_lossless import _record_logits
from tests.test_prefill_ops import SMALL, make_prefill_inputs

# many copy programs' strides, partial word tiles (164-word fp8 rows over 64-word loads)
GATHER = pgk.GatherConfig(copy_progs=3, block_rows=4, block_words=64)


def _host(n_pages: int, row: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n_pages * PAGE, row), dtype=torch.uint8, generator=gen)


def test_reference_gathers_exactly_the_selected_rows():
    gen = torch.Generator().manual_seed(3)
    inp = make_prefill_inputs(4, 4, 24, 100, 2, gen)
    host = _host(7, 656, gen)
    sel, rows, copied = torch.ops.echo.prefill_indexer_topk_gather(**inp, topk=16, host_kv=host)
    assert torch.equal(sel, torch.ops.echo.prefill_indexer_topk(**inp, topk=16))
    bt = inp["block_table"][0].long()
    picked = set(sel[sel >= 0].tolist())
    for p in range(rows.shape[0]):
        want = host[bt[p // PAGE] * PAGE + p % PAGE] if p in picked else torch.zeros(656)
        assert torch.equal(rows[p], want.to(torch.uint8)), p
    assert copied.tolist() == [0, len(picked)]


def _check_kernel(P, n_heads, T, start, n_pad, topk, row, fuse, seed):
    gen = torch.Generator().manual_seed(1000 * P + 10 * T + seed)
    inp = make_prefill_inputs(P, n_heads, T, start, n_pad, gen)
    host = _host(P + 3, row, gen)
    sel, rows, copied = pgk.prefill_indexer_topk_gather_cuda(
        **inp, topk=topk, host_kv=host, cfg=SMALL, gather=GATHER, fuse=fuse
    )
    # the same selection as the indexer's own kernel (the same scores and select launches)
    assert torch.equal(sel, pk.prefill_indexer_topk_cuda(**inp, topk=topk, cfg=SMALL))
    want_rows, want_copied = pg.gather_selected_ref(host, inp["block_table"], sel)
    assert torch.equal(rows, want_rows)
    # the split: block i's new rows are copied under block i + 1's scores (fused), the last
    # block's after its selection
    qb = pk.score_rows(P * PAGE, T, SMALL.score_elems)
    before_last = int(pg.selected_positions(sel[: (T - 1) // qb * qb], P * PAGE).sum())
    n = int(want_copied[1])
    assert copied.tolist() == ([before_last, n - before_last] if fuse else [0, n])


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize(
    ("P", "n_heads", "T", "start", "n_pad", "topk", "row"),
    [
        (3, 4, 40, 0, 0, 8, 656),  # the first chunk: causal prefixes shorter than top-k
        (5, 16, 48, 150, 5, 16, 1152),  # a later chunk, padding, bf16 rows
        (6, 8, 64, 260, 0, 32, 656),  # four query blocks of SMALL's 16 rows
        (2, 4, 20, 60, 0, 200, 656),  # top-k over the whole context: every row selected
        (8, 4, 96, 400, 0, 4, 656),  # six blocks, few rows each
    ],
)
def test_kernel_matches_reference(monkeypatch, fuse, P, n_heads, T, start, n_pad, topk, row):
    """The scores-and-copy and copy kernels under the interpreter; the radix select (tested
    against its reference in test_prefill_ops.py, and slow interpreted) is the reference's."""
    ref_select = pf.prefill_topk_from_scores_ref
    monkeypatch.setattr(
        pk, "prefill_topk_from_scores", lambda s, p, k, cfg=None: ref_select(s, p, k)
    )
    for seed in range(3):  # fresh inputs
        _check_kernel(P, n_heads, T, start, n_pad, topk, row, fuse, seed)


def test_kernel_with_the_radix_select():
    """One case whole: the Triton select as the op runs it."""
    _check_kernel(3, 4, 40, 0, 0, 8, 656, True, 0)


def test_opcheck():
    gen = torch.Generator().manual_seed(5)
    inp = make_prefill_inputs(3, 4, 16, 64, 0, gen)
    args = (*inp.values(), 8, _host(6, 656, gen))
    torch.library.opcheck(torch.ops.echo.prefill_indexer_topk_gather, args)


def test_bad_host_pool_is_refused_by_name():
    gen = torch.Generator().manual_seed(6)
    inp = make_prefill_inputs(3, 4, 16, 64, 0, gen)
    with pytest.raises(ValueError, match="host_kv must be contiguous uint8"):
        torch.ops.echo.prefill_indexer_topk_gather(**inp, topk=8, host_kv=_host(6, 650, gen))
    with pytest.raises(ValueError, match="host_kv must be contiguous"):
        wide = _host(6, 672, gen)[:, :656]  # a strided view: rows 672 bytes apart
        torch.ops.echo.prefill_indexer_topk_gather(**inp, topk=8, host_kv=wide)
    with pytest.raises(ValueError, match="not whole pages"):
        host = torch.zeros(6 * PAGE - 1, 656, dtype=torch.uint8)
        torch.ops.echo.prefill_indexer_topk_gather(**inp, topk=8, host_kv=host)


def test_engine_config_prefill_buffer():
    mc = preset_config("tiny")
    assert EngineConfig().cache_config(mc).prefill_tokens > 0
    assert EngineConfig(prefill_buffer=False).cache_config(mc).prefill_tokens == 0
    with pytest.raises(ValueError, match="prefill_buffer must be True or False"):
        EngineConfig(prefill_buffer="no")


def _run(model, tok, offload: bool, buffer: bool, fmt: str, lens: list[int], steps: int):
    topk = model.config.index_topk
    n = len(lens)
    cfg = EngineConfig(
        max_batch=n, host_tokens=64 * (sum(-(-(x + steps) // 64) for x in lens) + n),
        gpu_tokens=n * topk, kv_format=fmt, offload=offload, max_model_len=max(lens) + steps + 64,
        prefill_chunk=64, prefill_buffer=buffer,
    )  # fmt: skip
    eng = Engine(model, model.config, tok, cfg)
    log = _record_logits(eng)
    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i, n_tok in enumerate(lens):
        ids = torch.randint(2, model.config.vocab_size, (n_tok,), generator=gen).tolist()
        eng.add_request(f"r{i}", ids, params)
    while eng.has_unfinished():
        eng.step()
    return eng, log


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_engine_without_prefill_buffer_is_lossless(fmt):
    """Logits at every prefill chunk and decode step equal, bit for bit, with the device prefill
    buffer, without it, and without it on the GPU-only policy; the prefills read from the host
    only rows their queries select (fewer than the whole context)."""
    path = resolve_model("tiny")
    model, _ = load_model(path, device="cpu")
    tok = Tokenizer.from_dir(path)
    lens, steps = [150, 231], 8
    assert min(lens) > 2 * model.config.index_topk  # sparse selections
    runs = [_run(model, tok, off, buf, fmt, lens, steps)
            for off, buf in ((True, True), (True, False), (False, False))]  # fmt: skip
    (_, ref), *others = runs
    assert sum(1 for d, _, _ in ref if not d) >= 5  # several chunks a prompt
    for _, log in others:
        assert [(d, ids) for d, ids, _ in log] == [(d, ids) for d, ids, _ in ref]
        for (d, ids, a), (_, _, b) in zip(log, ref):
            assert torch.equal(a, b), f"logits differ at a {'decode' if d else 'prefill'} of {ids}"
    with_buffer = runs[0][0].metrics()
    assert with_buffer["prefill_host_rows"] == 0.0
    for eng, _ in runs[1:]:
        m = eng.metrics()
        # each chunk read at most its context's rows, on each layer, and some were selected
        layers = model.config.num_hidden_layers
        dense = layers * sum(sum(min(e, n) for e in range(64, n + 64, 64)) for n in lens)
        assert 0 < m["prefill_host_rows"] < dense
        assert m["prefill_copy_overlap"] == 0.0  # the CPU reference copies after the selection


# ---- on the GPU --------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("logits_backend", ["triton", "deep_gemm"])
def test_kernel_at_real_sizes_from_pinned_memory_cuda(logits_backend):
    """A 2048-query chunk at positions 30000.. of a 32K-token request, 64 index heads, top-2048,
    fp8 rows in pinned host memory (UVA reads): the op's selection is the indexer's own, its rows
    the host rows of exactly that selection, its split the blocks' (fused and not)."""
    from custom_ops.cache.host_pool import allocate_host_rows

    if logits_backend == "deep_gemm":
        pytest.importorskip("deep_gemm")
    gen = torch.Generator(device="cuda").manual_seed(0)
    P, T, topk = 512, 2048, 2048
    inp = make_prefill_inputs(P, 64, T, 30000, 7, gen)
    (host,) = allocate_host_rows(1, (P + 3) * PAGE, 656, torch.device("cuda"), pinned=True)
    host.copy_(_host(P + 3, 656, torch.Generator().manual_seed(1)).cuda())
    cfg = pk.PrefillIndexerConfig(score_elems=256 * P * PAGE)  # blocks of 256 queries
    want_sel = pk.prefill_indexer_topk_cuda(
        **inp, topk=topk, cfg=cfg, logits_backend=logits_backend
    )
    qb = pk.score_rows(P * PAGE, T, cfg.score_elems)
    assert T // qb >= 4  # several blocks: copies under the scoring
    for fuse in (True, False):
        sel, rows, copied = pgk.prefill_indexer_topk_gather_cuda(
            **inp, topk=topk, host_kv=host, cfg=cfg, logits_backend=logits_backend, fuse=fuse
        )
        assert torch.equal(sel, want_sel)
        want_rows, want_copied = pg.gather_selected_ref(host, inp["block_table"], sel)
        assert torch.equal(rows, want_rows)
        assert int(copied.sum()) == int(want_copied[1])
        if fuse and logits_backend == "triton":
            before_last = int(pg.selected_positions(sel[: (T - 1) // qb * qb], P * PAGE).sum())
            assert copied.tolist() == [before_last, int(want_copied[1]) - before_last]
        else:
            assert int(copied[0]) == 0


@pytest.mark.cuda
def test_compiled_engine_without_prefill_buffer_cuda():
    """Compiled prefill and decode in CUDA graphs without the prefill buffer: the graph gates
    hold, and decode logits equal the buffer's, offloading and GPU-only, bit for bit."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tests.test_compile import drive, make_engine

    path = resolve_model("tiny")
    model, _ = load_model(path, device="cuda")
    tiny = (model, Tokenizer.from_dir(path))
    torch._dynamo.reset()
    counters.clear()
    logs = {}
    for offload, buffer in ((True, True), (True, False), (False, False)):
        eng = make_engine(tiny, offload, compiled=True, strict=True, compile_prefill=True,
                          prefill_buffer=buffer)  # fmt: skip
        eng.runner.warmup(calls=3, progress=False)
        with torch.compiler.set_stance("fail_on_recompile"):
            logs[offload, buffer] = drive(eng)
        if not buffer:
            assert eng.metrics()["prefill_host_rows"] > 0
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["inductor"].get("cudagraph_partitions", 0) == 0
    assert dict(counters["graph_break"]) == {}
    ref = logs[True, True]
    assert len(ref) >= 12
    for key in ((True, False), (False, False)):
        assert len(logs[key]) == len(ref)
        for a, b in zip(logs[key], ref):
            assert torch.equal(a, b), key
