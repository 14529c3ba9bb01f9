"""FP8 weights served as FP8: ``echo::fp8_linear`` (reference, Triton kernel under the
interpreter), ``model.fp8_weights.FP8Linear`` and the loader's ``fp8_weights="fp8"`` path on the
tiny FP8 checkpoint."""

from __future__ import annotations

import pytest
import torch
from test_loader import last_logits
from torch import nn

from custom_ops import fp8_linear as F8
from custom_ops import fp8_linear_kernels as FK
from custom_ops import tile_counters as TC
from custom_ops.fp8 import act_dequant, act_quant
from model.checkpoint import resolve_model
from model.fp8_weights import FP8Experts, FP8Linear, weight_dequant_fp8, weight_quant_fp8
from model.loader import load_model


def _weights(n, k, gen, ue8m0=True):
    w = torch.randn(n, k, generator=gen) * 0.05
    return weight_quant_fp8(w, scale_fmt="ue8m0" if ue8m0 else None)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_round_up_pow2_is_exact():
    s = torch.tensor([1.0, 0.75, 2**-7, 2**-7 * (1 + 2**-23), 3.0, 448.0 / 448.0, 1e-4 / 448])
    got = F8.round_up_pow2(s)
    want = [1.0, 1.0, 2**-7, 2**-6, 4.0, 1.0]
    assert got[:6].tolist() == want
    assert got[6] >= s[6] and got[6] < 2 * s[6] and torch.frexp(got[6])[0] == 0.5


@pytest.mark.parametrize("ue8m0", [True, False])
def test_reference_is_dequantised_activations_times_dequantised_weights(ue8m0):
    """The per-block formula equals (x8 * s_x) @ (w8 * s_w)^T: the same products, another fp32
    summation order. The activations are quantised by the project's own act_quant (the
    indexer's), written separately."""
    g = torch.Generator().manual_seed(1)
    w8, ws = _weights(200, 384, g, ue8m0)
    x = (torch.randn(5, 384, generator=g) * torch.logspace(-2, 1, 384)).bfloat16()
    y = F8.fp8_linear_ref(x, w8, ws, ue8m0)
    q, s = act_quant(x, 128, "ue8m0" if ue8m0 else None)
    dense = act_dequant(q, s) @ weight_dequant_fp8(w8, ws).t()  # fp32
    assert y.dtype == torch.bfloat16 and y.shape == (5, 200)
    torch.testing.assert_close(y.float(), dense, rtol=2**-8, atol=1e-3 * dense.abs().max().item())
    # and FP8 activations really are used: bf16 activations give another answer
    exact = x.float() @ weight_dequant_fp8(w8, ws).t()
    assert (y.float() - exact).abs().max() > 1e-2 * exact.abs().max()


CASES = [  # (M, K, N, ue8m0, config)
    (1, 128, 64, True, dict(BM=16, BN=64, SPLIT_K=1)),
    (3, 256, 200, True, dict(BM=16, BN=128, SPLIT_K=2)),
    (20, 384, 128, False, dict(BM=16, BN=32, SPLIT_K=1)),
    (5, 512, 96, True, None),  # the launcher's heuristic
    (4, 384, 160, True, dict(BM=16, BN=64, SPLIT_K=3, PREQUANT=True)),  # x quantised first
    (17, 256, 64, False, dict(BM=32, BN=64, SPLIT_K=1, PREQUANT=True)),
    (6, 512, 200, True, dict(BM=16, BN=64, SPLIT_K=4, FUSED=True)),  # last split sums
    (2, 384, 96, True, dict(BM=16, BN=32, SPLIT_K=3, FUSED=True, PREQUANT=True)),
    (3, 256, 200, True, dict(BM=16, BN=64, SPLIT_K=2, SWAP=True)),  # the product transposed
    (6, 512, 200, False, dict(BM=16, BN=128, SPLIT_K=4, FUSED=True, SWAP=True)),
    (17, 256, 64, True, dict(BM=32, BN=64, SPLIT_K=1, PREQUANT=True, SWAP=True)),
    (24, 512, 200, False, None),  # the heuristic at M = 17-32: SWAP, x quantised in the loop
    (40, 512, 200, True, None),  # the heuristic at M = 33-128: x quantised first, split-K
    (70, 256, 72, False, None),  # the heuristic above M = 64: 128-row tiles, split-K
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case):
    m, k, n, ue8m0, cfg = CASES[case]
    g = torch.Generator().manual_seed(10 + case)
    w8, ws = _weights(n, k, g, ue8m0)
    x = (torch.randn(m, 2 * k, generator=g) * 3).bfloat16()[:, ::2]  # strided: the launcher copes
    if cfg is not None:
        cfg = {**cfg, "num_warps": 4, "num_stages": 1}
    y = FK.fp8_linear_triton(x, w8, ws, ue8m0, config=cfg)
    ref = F8.fp8_linear_ref(x.contiguous(), w8, ws, ue8m0)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # the same e4m3 operands (quantised in the prologue), fp32 sums in another order
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-3 * ref.abs().max())
    if cfg is not None and cfg.get("FUSED"):  # the same bits as the separate sum, counters reset
        assert torch.equal(y, FK.fp8_linear_triton(x, w8, ws, ue8m0, {**cfg, "FUSED": False}))
        assert not TC._COUNTERS[x.device].any()
    # x and the weight by tensor descriptors or pointer loads (the rule's cases too): the same bits
    base = cfg or FK.fp8_config(m, n, k, FK._num_sms(x.device))
    flip = {**base, "TMA": not base.get("TMA", False)}
    assert torch.equal(y, FK.fp8_linear_triton(x, w8, ws, ue8m0, flip))


def test_opcheck_and_bad_inputs():
    g = torch.Generator().manual_seed(2)
    w8, ws = _weights(64, 256, g)
    x = torch.randn(3, 256, generator=g).bfloat16()
    # NOTE: opcheck's schema test multiplies the inputs, which CPU torch cannot do in e4m3; the
    # other checks run, and the inputs are checked unchanged by hand (the op mutates nothing).
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    w8c, wsc = w8.clone(), ws.clone()
    torch.library.opcheck(torch.ops.echo.fp8_linear, (x, w8, ws, True), test_utils=utils)
    assert torch.equal(w8.view(torch.uint8), w8c.view(torch.uint8)) and torch.equal(ws, wsc)
    with pytest.raises(ValueError, match="multiple of 128"):
        torch.ops.echo.fp8_linear(torch.randn(3, 100).bfloat16(), w8[:, :100].contiguous(),
                                  ws, True)  # fmt: skip
    with pytest.raises(ValueError, match="w_scale must be float32"):
        torch.ops.echo.fp8_linear(x, w8, ws[:, :1].contiguous(), True)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        torch.ops.echo.fp8_linear(x, w8.float(), ws, True)
    with pytest.raises(ValueError, match="bad config"):
        FK.fp8_linear_triton(x, w8, ws, True, config=dict(BM=16, BN=256, SPLIT_K=1))


def test_fp8_linear_module_and_compile():
    g = torch.Generator().manual_seed(3)
    dense = nn.Linear(256, 96, bias=False)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(96, 256, generator=g) * 0.05)
    m = FP8Linear.from_linear(dense)
    x = torch.randn(2, 3, 256, generator=g).bfloat16()
    y = m(x)
    assert y.shape == (2, 3, 96) and m.weight.dtype == torch.float8_e4m3fn
    # FP8 weights and activations vs the bf16 linear: a few % (3 mantissa bits each)
    assert _rel(y, nn.functional.linear(x.float(), dense.weight)) < 0.08
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), y)


def test_tiny_fp8_served_as_fp8():
    """The loader keeps the FP8 linears FP8; logits: against an FP8-activation reference (the
    same model with each FP8Linear computed as dequantised activations x dequantised weights in
    fp32) within fp32 summation order, and against the dequantise-at-load model within the FP8
    activation error."""
    fp8, _ = load_model(resolve_model("tiny-fp8"), fp8_weights="fp8")
    bf16, _ = load_model(resolve_model("tiny-fp8"), fp8_weights="bf16")
    lins = {n: m for n, m in fp8.named_modules() if isinstance(m, FP8Linear)}
    experts = {n: m for n, m in fp8.named_modules() if isinstance(m, FP8Experts)}
    assert len(lins) >= 10 and not any("kv_b_proj" in n for n in lins) and len(experts) >= 2
    assert not any(isinstance(m, (FP8Linear, FP8Experts)) for m in bf16.modules())
    for n, m in lins.items():  # the stored FP8 tensors, as the bf16 model dequantised them
        assert torch.equal(m.dequantized_weight(), bf16.get_submodule(n).weight), n
    for n, m in experts.items():
        w13, w2 = m.dequantized_weights()
        assert torch.equal(w13, bf16.get_submodule(n).w13_weight)
        assert torch.equal(w2, bf16.get_submodule(n).w2_weight)
    prompts = ([0, 44, 73, 341, 83], [0, 264, 499, 315, 432, 18])
    got = [last_logits(fp8, p) for p in prompts]

    class ActFP8(nn.Module):
        def __init__(self, lin: FP8Linear):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            q, s = act_quant(x.reshape(-1, self.lin.in_features), 128, "ue8m0")
            w = weight_dequant_fp8(self.lin.weight, self.lin.weight_scale_inv)
            return (act_dequant(q, s) @ w.t()).to(x.dtype).view(*x.shape[:-1], -1)

    class ActFP8Experts(nn.Module):
        def __init__(self, ex: FP8Experts):
            super().__init__()
            self.w13, self.w2 = ex.dequantized_weights(torch.float32)
            self.inter = ex.inter_dim

        def forward(self, x, ids, wts):
            def lin(a, w):  # an FP8 linear: dequantised FP8 activations x dequantised weights
                q, s = act_quant(a, 128, "ue8m0")
                return (act_dequant(q, s) @ w.t()).to(a.dtype)

            out = torch.zeros(x.shape, dtype=torch.float32)
            for t in range(x.shape[0]):
                for j in range(ids.shape[1]):
                    e = int(ids[t, j])
                    gu = lin(x[t : t + 1], self.w13[e]).float()
                    h = torch.nn.functional.silu(gu[:, : self.inter]) * gu[:, self.inter :]
                    out[t] += wts[t, j] * lin(h.to(x.dtype), self.w2[e])[0].float()
            return out

    for n, m in [*lins.items(), *experts.items()]:
        parent, _, child = n.rpartition(".")
        new = ActFP8(m) if isinstance(m, FP8Linear) else ActFP8Experts(m)
        setattr(fp8.get_submodule(parent), child, new)
    ref = [last_logits(fp8, p) for p in prompts]
    deq = [last_logits(bf16, p) for p in prompts]
    for a, r, d in zip(got, ref, deq, strict=True):
        assert _rel(a, r) < 2e-2  # bf16 rounding of outputs in another order, over 4 layers
        # FP8 activations (ue8m0 scales: up to 2x coarser than amax / 448) in every linear of
        # 4 random-weight layers: measured 7-15% relative, correlation 0.990-0.997
        assert _rel(a, d) < 0.25 and float(torch.corrcoef(torch.stack([a, d]))[0, 1]) > 0.97
    with pytest.raises(ValueError, match="fp8_weights"):
        load_model(resolve_model("tiny-fp8"), fp8_weights="int8")
    with pytest.raises(ValueError, match="needs an FP8 checkpoint"):
        load_model(resolve_model("tiny"), fp8_weights="fp8")  # not silently ignored


def test_llm_serves_an_fp8_checkpoint_in_fp8():
    """The user-facing option (LLM / --fp8-weights) reaches the loader: FP8 modules, and the
    engine generates with them."""
    from echo_compile import LLM, SamplingParams
    from model.fp8_weights import FP8Linear

    llm = LLM("tiny-fp8", fp8_weights="fp8", device="cpu", compile=False, progress=False,
              max_batch=2, host_tokens=1024, gpu_tokens=256, max_model_len=256)  # fmt: skip
    assert any(isinstance(m, FP8Linear) for m in llm.engine.runner.model.modules())
    (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3  # (dp/tp/ep > 1 keep FP8 too: tests/test_distributed_units.py)


def _experts(e, n, k, gen):
    ws = [weight_quant_fp8(torch.randn(n, k, generator=gen) * 0.05, scale_fmt="ue8m0")
          for _ in range(e)]  # fmt: skip
    return torch.stack([w for w, _ in ws]), torch.stack([s for _, s in ws])


MOE_CASES = [  # (T, E, k, D, I, config)
    (1, 4, 2, 128, 128, dict(BM=16, BN=64)),
    (7, 8, 3, 256, 128, dict(BM=16, BN=128)),
    (20, 4, 2, 128, 128, dict(BM=32, BN=32)),
    (9, 4, 2, 128, 256, None),
    (2, 6, 3, 384, 256, dict(BM=16, BN=64, SPLIT_GU=3, SPLIT_DOWN=2)),  # split-K, last sums
    (3, 4, 2, 256, 384, dict(BM=16, BN=128, SPLIT_GU=2, SPLIT_DOWN=3)),
    (1, 4, 2, 512, 128, dict(BM=16, BN=64, SPLIT_GU=2)),  # two K blocks a split
    (1, 4, 2, 256, 128, None),  # one token: the heuristic's split 4, clamped to D's 2 blocks
]


@pytest.mark.parametrize("case", range(len(MOE_CASES)))
def test_moe_fp8_kernel_matches_reference(case):
    t, e, k, d, inter, cfg = MOE_CASES[case]
    g = torch.Generator().manual_seed(40 + case)
    w13, s13 = _experts(e, 2 * inter, d, g)
    w2, s2 = _experts(e, d, inter, g)
    x = torch.randn(t, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    if cfg is not None:
        cfg = {**cfg, "num_warps": 4, "num_stages": 1}
    y = FK.moe_fp8_triton(x, ids, w, w13, s13, w2, s2, True, config=cfg)
    ref = F8.moe_fp8_ref(x, ids, w, w13, s13, w2, s2, True)
    assert y.dtype == torch.float32 and y.shape == (t, d)
    # the same e4m3 operands and 16-bit roundings; fp32 order may flip a rounding of h rarely
    assert _rel(y, ref) < 2e-3
    if cfg is None and t == 1:  # the heuristic splits one token's gate/up pass (k = topk)
        assert FK.moe_fp8_config(t * k, e, k)["SPLIT_GU"] == 4
        assert FK.moe_fp8_config(2 * k, e, k).get("SPLIT_GU", 1) == 1
        assert not TC._COUNTERS[x.device].any()
    if cfg is not None and "SPLIT_GU" in cfg:
        assert not TC._COUNTERS[x.device].any()  # the last splits reset their counters
        if (cfg["SPLIT_GU"], cfg.get("SPLIT_DOWN", 1)) == (d // 128, inter // 128):
            # one K block a split: the unsplit pass's fp32 additions in its order, so its bits
            whole = {**cfg, "SPLIT_GU": 1, "SPLIT_DOWN": 1}
            y1 = FK.moe_fp8_triton(x, ids, w, w13, s13, w2, s2, True, config=whole)
            assert torch.equal(y, y1)
        with pytest.raises(ValueError, match=r"a split must be an int in 1\.\.\d"):
            FK.moe_fp8_triton(x, ids, w, w13, s13, w2, s2, True,
                              config={**cfg, "SPLIT_GU": d // 128 + 1})  # fmt: skip
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.echo.moe_fp8, (x, ids, w, w13, s13, w2, s2, True),
                          test_utils=utils)  # fmt: skip
    with pytest.raises(ValueError, match="w2_scale must be"):
        F8.moe_fp8_ref(x, ids, w, w13, s13, w2, s2[:1].contiguous(), True)


@pytest.mark.cuda
def test_moe_fp8_on_gpu_256_experts():
    gen = torch.Generator("cuda").manual_seed(5)
    e, d, inter, t = 256, 7168, 2048, 16

    def experts(n, k):
        w = torch.randn(e, n, k, device="cuda", generator=gen) * 0.02
        q = [weight_quant_fp8(w[j], scale_fmt="ue8m0") for j in range(e)]
        return torch.stack([a for a, _ in q]), torch.stack([b for _, b in q])

    w13, s13 = experts(2 * inter, d)
    w2, s2 = experts(d, inter)
    x = torch.randn(t, d, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(8, dim=-1).indices
    w = torch.rand(t, 8, device="cuda", generator=gen)
    ref = F8.moe_fp8_ref(x, ids, w, w13, s13, w2, s2, True)
    assert _rel(torch.ops.echo.moe_fp8(x, ids, w, w13, s13, w2, s2, True), ref) < 5e-3
    for split in ({"SPLIT_GU": 8}, {"SPLIT_GU": 4, "SPLIT_DOWN": 2, "num_warps": 8}):
        cfg = {**FK.moe_fp8_config(t * 8, e, 8), **split}  # the Triton kernel, split-K
        assert _rel(FK.moe_fp8_triton(x, ids, w, w13, s13, w2, s2, True, cfg), ref) < 5e-3
        assert not TC._COUNTERS[x.device].any()


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16, 32, 33, 64, 96, 128])  # SWAP at 32; the M = 33-128 rule
def test_kernel_on_gpu_at_v32_shapes(m):
    gen = torch.Generator("cuda").manual_seed(m)
    for k, n in ((7168, 4096), (16384, 7168), (7168, 2048), (2048, 7168), (7168, 576)):
        w8, ws = weight_quant_fp8(torch.randn(n, k, device="cuda", generator=gen) * 0.02,
                                  scale_fmt="ue8m0")  # fmt: skip
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        ref = F8.fp8_linear_ref(x, w8, ws, True)
        assert _rel(torch.ops.echo.fp8_linear(x, w8, ws, True), ref) < 5e-3  # fp8 MMA sums
        for pre in (False, True):  # the Triton kernel, x quantised in its loop or first
            cfg = {**FK.fp8_config(m, n, k, 132), "PREQUANT": pre, "TMA": False}
            y = FK.fp8_linear_triton(x, w8, ws, True, config=cfg)
            assert _rel(y, ref) < 5e-3
            assert torch.equal(y, FK.fp8_linear_triton(x, w8, ws, True, {**cfg, "TMA": True}))
            if cfg["SPLIT_K"] > 1:  # the last split's sum: the separate launch's bits, on the GPU
                whole = FK.fp8_linear_triton(x, w8, ws, True, config={**cfg, "FUSED": False})
                assert torch.equal(y, whole) and not TC._COUNTERS[x.device].any()


def test_dispatch_rules_at_v32_shapes():
    """Where the CUDA ops send V3.2's shapes (docs/quantization.md, "FP8 on the H200")."""
    assert F8.triton_first(1, 2048, 7168) and F8.triton_first(16, 576, 7168)  # narrow, deep
    assert F8.triton_first(4, 4096, 7168) and not F8.triton_first(8, 4096, 7168)
    assert not F8.triton_first(1, 7168, 2048)  # shallow: DeepGEMM at every M
    assert not F8.triton_first(64, 2048, 7168)
    assert F8.moe_triton_first(64 * 8, 256) and F8.moe_triton_first(128 * 8, 256)
    assert not F8.moe_triton_first(64 * 8, 16)  # 32 pairs an expert: DeepGEMM
    assert F8.moe_triton_first(32 * 8, 32) and F8.moe_triton_first(16 * 8, 16)  # 8 an expert
    assert not F8.moe_triton_first(64 * 8, 32) and not F8.moe_triton_first(32 * 8, 16)  # 16
    assert F8.moe_triton_first(8 * 32, 32) and not F8.moe_triton_first(8 * 32 + 1, 32)  # the edge
    # BN 64 on the narrow and the K = 16384 weights (x quantised first there), 128 elsewhere
    assert [FK.fp8_config(1, n, k, 132)["BN"] for n, k in ((576, 7168), (7168, 16384))] == [64, 64]
    assert FK.fp8_config(1, 2048, 7168, 132)["BN"] == 128
    assert FK.fp8_config(32, 7168, 16384, 132)["BM"] == 32  # M <= 32: the rule below it
    for m, split in ((64, 4), (128, 2)):  # M > 32 on K = 16384: 64 x 64, split-K 4 / 2
        deep = FK.fp8_config(m, 7168, 16384, 132)
        assert (deep["BM"], deep["BN"], deep["SPLIT_K"], deep["PREQUANT"]) == (64, 64, split, True)
        assert deep["TMA"]  # x and the weight by TMA at M = 33-64 and 128
    assert not FK.fp8_config(96, 7168, 16384, 132)["TMA"]  # slower at 96 on the H200
    assert FK.fp8_config(1, 7168, 16384, 132)["PREQUANT"]
    # decode rows on K < 16384: SWAP, one wave of programs of at most 8 K blocks (K x N: split)
    splits = {(7168, 4096): 8, (7168, 2048): 8, (2048, 7168): 4, (7168, 576): 16}
    for (k, n), split in splits.items():
        for m in (1, 16):
            cfg = FK.fp8_config(m, n, k, 132)
            assert cfg["SPLIT_K"] == split and cfg["SWAP"] and cfg["num_stages"] == 4, (k, n, cfg)
    # M = 17-32: SWAP on K < 16384 (gpu_session36), not on K = 16384
    assert FK.fp8_config(17, 4096, 7168, 132)["SWAP"] and FK.fp8_config(32, 576, 7168, 132)["SWAP"]
    assert FK.fp8_config(32, 4096, 7168, 132)["BM"] == 32
    assert not FK.fp8_config(32, 7168, 16384, 132).get("SWAP")
    assert not FK.fp8_config(1, 7168, 16384, 132).get("SWAP")
    # M = 33-128 on K < 16384: x quantised first, 64-column tiles, split-K (at most 8) to one
    # wave of 64-row tiles; above M = 64 128-row tiles on 8 warps
    splits = {(7168, 4096, 64): 4, (7168, 4096, 128): 2, (7168, 2048, 64): 8,
              (7168, 2048, 128): 4, (2048, 7168, 64): 2, (2048, 7168, 128): 1,
              (7168, 576, 64): 8, (7168, 576, 128): 8}  # fmt: skip
    for (k, n, m), split in splits.items():
        cfg = FK.fp8_config(m, n, k, 132)
        wide = m > 64
        got = (cfg["BM"], cfg["BN"], cfg["SPLIT_K"], cfg["PREQUANT"], cfg.get("SWAP", False),
               cfg["num_warps"], cfg["TMA"])  # fmt: skip
        assert got == (128 if wide else 64, 64, split, True, False, 8 if wide else 4, True), m
    assert not any(FK.fp8_config(m, 4096, 7168, 132).get("TMA") for m in (1, 16, 32, 129))
    assert FK.fp8_config(129, 4096, 7168, 132)["BN"] == 128  # above 128: the rule before


def test_split_k_configs_fit_the_tile_counters_at_every_m():
    """A split-K launch holds one tile counter per output tile (``tile_counters.COUNTERS``): no
    configuration splits more tiles than that, at decode, prefill-chunk or larger M (the
    K = 16384 rule split every M above 32, so 112 x 586 tiles at M = 37504 on 16384 x 7168
    raised in ``counters``)."""
    for n, k in ((7168, 16384), (7168, 4096), (2048, 7168), (576, 7168)):
        for m in (1, 16, 64, 128, 256, 2048, 16384, 37504, 65536):
            cfg = FK.fp8_config(m, n, k, 132)
            tiles = -(-m // cfg["BM"]) * -(-n // cfg["BN"])
            assert cfg["SPLIT_K"] == 1 or tiles <= TC.COUNTERS, (m, n, k, cfg)


def test_bench_fp8_help_on_cpu():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = [sys.executable, "-m", "benchmarks.bench_fp8"]
    out = subprocess.run([*run, "--help"], cwd=root, capture_output=True, text=True, check=True)
    assert "--configs" in out.stdout
    bad = subprocess.run([*run, "--out", "x.json", "--configs", "{"], cwd=root,
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode != 0 and "JSON list" in bad.stderr
