"""On the GPU: the sparse prefill kernels against their references at real sizes (64 index heads,
top-2048, 128 heads), and a compiled prefill under a context limit above the old 16K compile
limit: no recompile after warm-up, zero cudagraph skips, offloading on/off identical."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.cuda


def test_prefill_kernels_match_references_at_real_sizes():
    from custom_ops import indexer_kernels as ik
    from custom_ops import prefill as pf
    from custom_ops import prefill_attn_kernels as pa
    from custom_ops import prefill_kernels as pk
    from tests.test_decode_kernels import attention_close, check_scores, make_pool
    from tests.test_prefill_ops import (
        PREFILL_SCORE_REL,
        check_selection_near_ties,
        magnitudes,
        make_prefill_inputs,
    )

    gen = torch.Generator(device="cuda").manual_seed(0)
    # a 512-query chunk at positions 3000.. of a 4096-token request, 7 padding rows
    inp = make_prefill_inputs(64, 64, 512, 3000, 7, gen)
    cfg = pk.PrefillIndexerConfig(score_elems=128 * 4096)  # 4 query blocks
    ref = pf.prefill_index_logits_ref(**inp)
    mag = magnitudes(inp)
    check_scores(pk.prefill_index_logits(**inp, cfg=cfg), ref, mag, PREFILL_SCORE_REL)
    sel_ref = pf.prefill_topk_from_scores_ref(ref, inp["positions"], 2048)
    assert torch.equal(pk.prefill_topk_from_scores(ref, inp["positions"], 2048, cfg), sel_ref)
    one = pk.PrefillIndexerConfig(select=ik.IndexerConfig(sel_chunk=ref.shape[1]))  # C = 1
    assert torch.equal(pk.prefill_topk_from_scores(ref, inp["positions"], 2048, one), sel_ref)
    whole = pk.prefill_indexer_topk_cuda(**inp, topk=2048, cfg=cfg)
    want = pf.prefill_indexer_topk_ref(**inp, topk=2048)
    # the kernel's scores round differently: sets may part at near-ties of the k-th score only
    check_selection_near_ties(whole, want, ref, mag, PREFILL_SCORE_REL)
    for fmt in ("bf16", "fp8"):
        T, H, L, K = 128, 128, 8192, 2048
        q = (torch.randn(T, H, 576, generator=gen, device="cuda") * 0.3).bfloat16()
        rows = make_pool(L, fmt, gen)
        sel = torch.rand(T, L, generator=gen, device="cuda").argsort(1)[:, :K].sort(1).values
        sel = sel.int()
        sel[3, 100:] = -1
        sel[5] = torch.where(
            torch.arange(K, device="cuda") <= 700, torch.arange(K, device="cuda"), -1
        ).int()  # a causal prefix (position 700), -1 padded: skipped blocks
        ref_o = pf.sparse_mla_prefill_ref(q, rows, sel, 0.1352, fmt)
        attention_close(pk.sparse_mla_prefill_cuda(q, rows, sel, 0.1352, fmt), ref_o)
        # the prefill kernel's other configurations (the bench times them) and the old path
        for c in (pa.PrefillAttnConfig(dequant_first=False), pa.PrefillAttnConfig(block_k=32)):
            attention_close(pa.sparse_mla_prefill_attn(q, rows, sel, 0.1352, fmt, c), ref_o)
        attention_close(pk.sparse_mla_prefill_decode_kernel(q, rows, sel, 0.1352, fmt), ref_o)


def test_compiled_prefill_above_the_old_16k_limit():
    from torch._dynamo.utils import counters

    from echo_compile import LLM, SamplingParams

    counters.clear()
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (700, 90)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = []
    for offload in (True, False):
        llm = LLM("tiny", max_batch=2, host_tokens=20480, gpu_tokens=2 * 32, kv_format="fp8",
                  offload=offload, max_model_len=20480, prefill_chunk=64,
                  progress=False)  # fmt: skip
        runner = llm.engine.runner
        assert [k for k, _, _ in runner.compiled] == ["decode", "prefill"]
        outs.append([r.token_ids for r in llm.generate(prompts, params)])  # frozen: no recompile
        del llm
    assert outs[0] == outs[1]
    assert [len(t) for t in outs[0]] == [6, 6]
    assert counters["inductor"]["cudagraph_skips"] == 0
