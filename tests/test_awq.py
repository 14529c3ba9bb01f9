"""AWQ 4-bit: format, quantisation, op registrations, Triton kernels (interpreter) and modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from custom_ops import awq as ops
from custom_ops import awq_kernels as K
from custom_ops.awq import awq_dequantize_t, awq_unpack
from model.awq import AWQExperts, AWQLinear
from model.awq_convert import convert_to_awq, densify_awq
from model.awq_quant import awq_dequantize, awq_pack, awq_quantize
from model.quant_config import QuantConfig

SPEC_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # docs/model_notes.md, written out again on purpose


def _words(*shape: int, gen: torch.Generator) -> torch.Tensor:
    """Random int32 words over the full range (about half of them negative)."""
    return torch.randint(-(2**31), 2**31, shape, dtype=torch.int64, generator=gen).to(torch.int32)


def _spec_dequant_t(qweight, qzeros, scales) -> list[list[float]]:
    """W^T[k][n] from the format description alone: Python ints, one nibble at a time."""
    def unpack(words: torch.Tensor) -> list[list[int]]:
        rows = []
        for row in words.tolist():
            vals = [0] * (8 * len(row))
            for c, w in enumerate(row):
                w &= 0xFFFFFFFF  # the word's 32 bits, as unsigned
                for i in range(8):
                    vals[8 * c + SPEC_ORDER[i]] = (w >> (4 * i)) & 0xF
            rows.append(vals)
        return rows

    q, z, s = unpack(qweight), unpack(qzeros), scales.double().tolist()
    return [[(q[k][n] - z[k // 128][n]) * s[k // 128][n] for n in range(len(q[0]))]
            for k in range(len(q))]


# ---- format ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scales_dtype", [torch.float16, torch.bfloat16])
def test_dequantize_matches_format_spec_bit_for_bit(scales_dtype):
    g = torch.Generator().manual_seed(1)
    k, n = 256, 24
    qw, qz = _words(k, n // 8, gen=g), _words(k // 128, n // 8, gen=g)
    s = (torch.rand(k // 128, n, generator=g) * 0.02 + 1e-3).to(scales_dtype)
    spec = torch.tensor(_spec_dequant_t(qw, qz, s), dtype=torch.float64)  # [K, N]
    assert (qw < 0).any(), "the sample must contain negative words"
    assert torch.equal(awq_dequantize_t(qw, qz, s).double(), spec)
    assert torch.equal(awq_dequantize(qw, qz, s, torch.bfloat16), spec.t().to(torch.bfloat16))
    assert torch.equal(awq_dequantize(qw, qz, s, torch.float32), spec.t().float())


def test_negative_words_unpack():
    words = torch.tensor([[-1, -(2**31), 0x7654_3210, -0x1234_5679]], dtype=torch.int32)
    got = awq_unpack(words)
    assert got.shape == (1, 32)
    assert got[0, :8].tolist() == [15] * 8  # 0xFFFFFFFF
    assert got[0, 8:16].tolist() == [0, 0, 0, 0, 0, 0, 0, 8]  # 0x80000000: nibble 7 -> column 7
    # 0x76543210: nibble i = i sits at column SPEC_ORDER[i]
    expect = [0] * 8
    for i in range(8):
        expect[SPEC_ORDER[i]] = i
    assert got[0, 16:24].tolist() == expect
    w = -0x1234_5679 & 0xFFFFFFFF
    expect = [0] * 8
    for i in range(8):
        expect[SPEC_ORDER[i]] = (w >> (4 * i)) & 0xF
    assert got[0, 24:].tolist() == expect


def test_pack_unpack_round_trip_and_errors():
    g = torch.Generator().manual_seed(2)
    words = _words(3, 5, 4, gen=g)  # leading dims (experts) too
    assert torch.equal(awq_pack(awq_unpack(words)), words)
    vals = torch.randint(0, 16, (7, 40), generator=g)
    assert torch.equal(awq_unpack(awq_pack(vals)), vals.int())
    with pytest.raises(ValueError, match="0..15"):
        awq_pack(torch.full((2, 8), 16))
    with pytest.raises(ValueError, match="multiple of 8"):
        awq_pack(torch.zeros(2, 12, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        awq_unpack(torch.zeros(2, 3, dtype=torch.int64))


@pytest.mark.parametrize("scales_dtype", [torch.float16, torch.bfloat16])
def test_quantize_round_to_nearest_bound(scales_dtype):
    g = torch.Generator().manual_seed(3)
    n, k = 48, 512
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n).unsqueeze(1)  # varied ranges
    w[:, :128] = w[:, :128].abs() + 0.05  # all-positive groups: zero must still be representable
    w[:8, 128:256] = 0.0  # constant groups
    qw, qz, s = awq_quantize(w, scales_dtype)
    assert qw.shape == (k, n // 8) and qz.shape == (k // 128, n // 8) and s.shape == (k // 128, n)
    assert s.dtype == scales_dtype and (s > 0).all()
    w_hat = awq_dequantize_t(qw, qz, s).t()  # [N, K] fp32
    bound = s.float().repeat_interleave(128, dim=0).t() / 2  # [N, K]
    err = (w - w_hat).abs()
    assert (err <= bound * (1 + 1e-5)).all(), f"max excess {(err - bound).max()}"
    assert torch.equal(w_hat[:8, 128:256], torch.zeros(8, 128))
    # the bound is tight-ish: RTN with 16 levels uses the range (not, e.g., scales 10x too large)
    assert err.max() > 0.25 * bound.max()


def test_quantize_rejects_bad_shapes():
    with pytest.raises(ValueError, match="in % 128"):
        awq_quantize(torch.randn(16, 100))
    with pytest.raises(ValueError, match="2-D"):
        awq_quantize(torch.randn(2, 16, 128))
    with pytest.raises(ValueError, match="scales_dtype"):
        awq_quantize(torch.randn(16, 128), torch.float32)


# ---- ops: registration -----------------------------------------------------------------------


def _awq_weights(k: int, n: int, gen: torch.Generator, dtype=torch.float16, lead=()):
    qw = _words(*lead, k, n // 8, gen=gen)
    qz = _words(*lead, k // 128, n // 8, gen=gen)
    s = (torch.rand(*lead, k // 128, n, generator=gen) * 0.02 + 1e-3).to(dtype)
    return qw, qz, s


def _moe_inputs(t, e, topk, d, inter, gen, dtype=torch.bfloat16, scales_dtype=torch.float16):
    x = torch.randn(t, d, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(t)]).int()
    w = torch.rand(t, topk, generator=gen)
    w13 = _awq_weights(d, 2 * inter, gen, scales_dtype, (e,))
    w2 = _awq_weights(inter, d, gen, scales_dtype, (e,))
    return x, ids, w, w13, w2


def test_opcheck_w4a16_linear():
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(5, 256, generator=g).to(dtype)
        torch.library.opcheck(torch.ops.echo.w4a16_linear, (x, *_awq_weights(256, 32, g)))


def test_opcheck_moe():
    g = torch.Generator().manual_seed(5)
    x, ids, w, w13, w2 = _moe_inputs(4, 4, 2, 128, 128, g)
    torch.library.opcheck(torch.ops.echo.moe_w4a16, (x, ids, w, *w13, *w2))
    w13d = torch.randn(4, 256, 128, generator=g).bfloat16()
    w2d = torch.randn(4, 128, 128, generator=g).bfloat16()
    torch.library.opcheck(torch.ops.echo.moe_bf16, (x, ids.long(), w, w13d, w2d))


def test_ops_reject_bad_inputs():
    g = torch.Generator().manual_seed(6)
    qw, qz, s = _awq_weights(256, 32, g)
    x = torch.randn(3, 256).bfloat16()
    with pytest.raises(ValueError, match="qweight must have shape"):
        torch.ops.echo.w4a16_linear(torch.randn(3, 128).bfloat16(), qw, qz, s)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        torch.ops.echo.w4a16_linear(x.float(), qw, qz, s)
    with pytest.raises(ValueError, match="scales must have shape"):
        torch.ops.echo.w4a16_linear(x, qw, qz, s[:1])
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        K.w4a16_linear_triton(x.float(), qw, qz, s)
    xm, ids, w, w13, w2 = _moe_inputs(3, 4, 2, 128, 128, g)
    with pytest.raises(ValueError, match="topk_weights must match"):
        K.moe_w4a16_triton(xm, ids, w[:, :1], *w13, *w2)
    with pytest.raises(ValueError, match="w2"):
        K.moe_w4a16_triton(xm, ids, w, *w13, w2[0][:, :64], *w2[1:])


# ---- Triton kernels under the interpreter ----------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


LINEAR_CASES = [  # (M, K, N, x dtype, scales dtype, config); MAGIC: 16-bit magic-number dequant
    (1, 128, 32, torch.bfloat16, torch.float16, dict(BM=16, BN=32, BK=128, SPLIT_K=1)),
    (3, 256, 64, torch.bfloat16, torch.bfloat16, dict(BM=16, BN=32, BK=64, SPLIT_K=2)),
    (17, 384, 200, torch.float16, torch.float16, dict(BM=16, BN=64, BK=32, SPLIT_K=3, MAGIC=False)),
    (33, 256, 48, torch.bfloat16, torch.float16, dict(BM=32, BN=16, BK=128, SPLIT_K=1)),
    (5, 512, 96, torch.float16, torch.bfloat16, None),  # the launcher's own heuristic
]


@pytest.mark.parametrize("case", range(len(LINEAR_CASES)))
def test_w4a16_linear_kernel_matches_reference(case):
    m, k, n, dtype, sdtype, cfg = LINEAR_CASES[case]
    g = torch.Generator().manual_seed(100 + case)
    x = torch.randn(m, 2 * k, generator=g).to(dtype)[:, ::2]  # a strided view: the launcher copes
    qw, qz, s = _awq_weights(k, n, g, sdtype)
    if cfg is not None:
        cfg = {**cfg, "num_warps": 4, "num_stages": 1}
    y = K.w4a16_linear_triton(x, qw, qz, s, config=cfg)
    ref = ops.w4a16_linear_ref(x.contiguous(), qw, qz, s)
    assert y.dtype == dtype and y.shape == (m, n) and not y.isnan().any()
    # same fp32 products, another summation order: at most about one rounding of the output
    atol = 1e-3 * ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=atol)


MOE_CASES = [  # (T, E, k, D, I, x dtype, config BM/BN/BK/MAGIC)
    (1, 4, 2, 128, 128, torch.bfloat16, (16, 32, 128, True)),
    (6, 8, 3, 256, 128, torch.bfloat16, (16, 64, 64, False)),
    (20, 4, 2, 128, 256, torch.float16, (32, 32, 128, True)),
    (9, 4, 2, 256, 128, torch.bfloat16, None),  # the launcher's own heuristic
]


@pytest.mark.parametrize("case", range(len(MOE_CASES)))
def test_moe_kernels_match_reference(case):
    t, e, topk, d, inter, dtype, c = MOE_CASES[case]
    g = torch.Generator().manual_seed(200 + case)
    cfg = None if c is None else dict(BM=c[0], BN=c[1], BK=c[2], MAGIC=c[3], num_warps=4,
                                      num_stages=1)
    x, ids, w, w13, w2 = _moe_inputs(t, e, topk, d, inter, g, dtype)
    y = K.moe_w4a16_triton(x, ids, w, *w13, *w2, config=cfg)
    ref = ops.moe_w4a16_ref(x, ids, w, *w13, *w2)
    assert y.dtype == torch.float32 and y.shape == (t, d) and not y.isnan().any()
    # differences: fp32 summation order, then bf16 rounding flips of the intermediate h
    assert _rel(y, ref) < 2e-3
    w13d = (torch.randn(e, 2 * inter, d, generator=g) * 0.05).to(dtype)
    w2d = (torch.randn(e, d, inter, generator=g) * 0.05).to(dtype)
    y = K.moe_bf16_triton(x, ids.long(), w, w13d, w2d, config=cfg)
    assert _rel(y, ops.moe_bf16_ref(x, ids, w, w13d, w2d)) < 2e-3


def test_moe_align_groups_every_pair_once():
    g = torch.Generator().manual_seed(7)
    for t, e, topk, bm in [(1, 8, 2, 16), (13, 6, 3, 16), (40, 4, 4, 32)]:
        ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])
        p = t * topk
        sorted_ids, block_expert = K.moe_align(ids, e, bm)
        n_blocks = triton_cdiv(p, bm) + min(e, p)
        assert sorted_ids.shape == (n_blocks * bm,) and block_expert.shape == (n_blocks,)
        valid = sorted_ids[sorted_ids < p]
        assert sorted(valid.tolist()) == list(range(p))  # every pair exactly once
        assert ((sorted_ids == p) | (sorted_ids < p)).all()
        flat = ids.reshape(-1)
        for b in range(n_blocks):
            rows = sorted_ids[b * bm:(b + 1) * bm]
            rows = rows[rows < p]
            if block_expert[b] == e:
                assert rows.numel() == 0
            else:
                assert rows.numel() > 0 and (flat[rows.long()] == block_expert[b]).all()


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# ---- modules ---------------------------------------------------------------------------------


def test_awq_linear_matches_dense_bf16():
    g = torch.Generator().manual_seed(8)
    dense = nn.Linear(384, 96, bias=False)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(96, 384, generator=g) * 0.05)
    q = AWQLinear.from_linear(dense)
    x = torch.randn(2, 5, 384, generator=g).bfloat16()
    y = q(x)
    assert y.shape == (2, 5, 96) and y.dtype == torch.bfloat16
    ref = F.linear(x, q.dequantized_weight(torch.bfloat16))  # dense bf16 with the same weights
    # tolerance: the dense path rounds W to bf16 (2^-9 relative per element) and rounds in bf16
    assert _rel(y, ref) < 1e-2
    # and close to the original: 4-bit RTN of Gaussian weights costs about 10% (s ~ 0.37 sigma)
    assert _rel(y, F.linear(x.float(), dense.weight)) < 0.15


def _dense_moe(x, ids, w, w13, w2):
    """The bf16 MoE of model/moe.py written per token: down(silu(gate(x)) * up(x)), fp32 sum."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = F.linear(x[t], w13[e])  # [2I] bf16
            h = (F.silu(gu[:inter].float()) * gu[inter:].float()).to(x.dtype)
            out[t] += w[t, j] * F.linear(h, w2[e]).float()
    return out


def test_awq_experts_match_dense_bf16():
    g = torch.Generator().manual_seed(9)
    e, d, inter, t, topk = 4, 256, 128, 7, 2
    w13 = (torch.randn(e, 2 * inter, d, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(e, d, inter, generator=g) * 0.05).bfloat16()
    q = AWQExperts.from_dense(w13, w2)
    x = torch.randn(t, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])
    w = torch.rand(t, topk, generator=g)
    y = q(x, ids, w)
    assert y.shape == (t, d) and y.dtype == torch.float32
    ref = _dense_moe(x, ids, w, *q.dequantized_weights(torch.bfloat16))
    assert _rel(y, ref) < 1e-2  # bf16 rounding of the dense weights and of gate/up outputs
    # vs the original weights: about 10% per projection, compounded through silu(g) * u -> ~0.18
    assert _rel(y, _dense_moe(x, ids, w, w13, w2)) < 0.3


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.kv_b_proj = nn.Linear(128, 64, bias=False)
        self.o_proj = nn.Linear(128, 128, bias=False)
        self.indexer = nn.Module()
        self.indexer.wk = nn.Linear(128, 128, bias=False)


class _StackedExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w13_weight = nn.Parameter(torch.empty(4, 256, 128))
        self.w2_weight = nn.Parameter(torch.empty(4, 128, 128))


class _Layer(nn.Module):
    def __init__(self, moe: bool):
        super().__init__()
        self.self_attn = _Attn()
        self.mlp = nn.Module()
        if moe:
            self.mlp.gate = nn.Linear(128, 4, bias=False)  # the router: never quantised
            self.mlp.experts = _StackedExperts()
            self.mlp.shared_experts = nn.Module()
            self.mlp.shared_experts.down_proj = nn.Linear(128, 128, bias=False)
        else:
            self.mlp.gate_proj = nn.Linear(128, 256, bias=False)


def _toy_model() -> nn.Module:
    m = nn.Module()
    m.model = nn.Module()
    m.model.layers = nn.ModuleList([_Layer(i >= 1) for i in range(12)])
    m.lm_head = nn.Linear(128, 64, bias=False)
    return m


def test_convert_to_awq_follows_the_skip_list():
    q = QuantConfig(method="awq", modules_to_not_convert=(
        "mlp.gate.", "indexer", "model.layers.0.", "model.layers.1.", "model.layers.11."))
    with torch.device("meta"):
        model = _toy_model()
    done = convert_to_awq(model, q)
    layers = model.model.layers
    assert isinstance(layers[0].mlp.gate_proj, nn.Linear)  # dense layer 0 skipped
    assert isinstance(layers[1].self_attn.o_proj, nn.Linear)  # layer 1 skipped ...
    assert isinstance(layers[10].self_attn.o_proj, AWQLinear)  # ... but not layer 10
    assert isinstance(layers[11].mlp.experts, _StackedExperts)
    assert isinstance(layers[3].mlp.gate, nn.Linear) and isinstance(layers[3].self_attn.indexer.wk,
                                                                    nn.Linear)
    assert isinstance(layers[3].mlp.experts, AWQExperts)
    assert isinstance(layers[3].mlp.shared_experts.down_proj, AWQLinear)
    assert isinstance(model.lm_head, nn.Linear)
    assert "model.layers.3.self_attn.kv_b_proj" in done and len(done) == 9 * 4
    sd = model.state_dict()
    assert sd["model.layers.3.mlp.experts.w13_qweight"].shape == (4, 128, 32)
    assert sd["model.layers.3.mlp.experts.w2_scales"].shape == (4, 1, 128)
    assert sd["model.layers.3.self_attn.o_proj.qzeros"].dtype == torch.int32
    assert sd["model.layers.3.self_attn.o_proj.qweight"].device.type == "meta"
    with pytest.raises(ValueError, match="not 'awq'"):
        convert_to_awq(model, QuantConfig(method="fp8"))


def test_convert_rejects_unpackable_linear():
    """A linear AWQ cannot pack is named, and the error points at config.json's skip list (an
    AWQ config whose modules_to_not_convert leaves out a 16-bit module, e.g. the indexer's)."""
    m = nn.Module()
    m.proj = nn.Linear(100, 64, bias=False)
    want = r"proj: .*modules_to_not_convert must name it \(it names \['indexer'\]\)"
    with pytest.raises(ValueError, match=want):
        convert_to_awq(m, QuantConfig(method="awq", modules_to_not_convert=("indexer",)))


def test_densify_kv_b_proj_after_load():
    g = torch.Generator().manual_seed(10)
    attn = _Attn()
    convert_to_awq(attn, QuantConfig(method="awq", modules_to_not_convert=("indexer",)))
    qw, qz, s = awq_quantize(torch.randn(64, 128, generator=g))
    with torch.no_grad():  # what the loader does: copy checkpoint tensors by name
        sd = attn.state_dict()
        sd["kv_b_proj.qweight"].copy_(qw)
        sd["kv_b_proj.qzeros"].copy_(qz)
        sd["kv_b_proj.scales"].copy_(s)
    assert densify_awq(attn) == ["kv_b_proj"]
    assert type(attn.kv_b_proj) is nn.Linear and isinstance(attn.o_proj, AWQLinear)
    assert attn.kv_b_proj.weight.dtype == torch.bfloat16
    assert torch.equal(attn.kv_b_proj.weight, awq_dequantize(qw, qz, s))


def test_modules_compile_fullgraph():
    g = torch.Generator().manual_seed(11)
    lin = AWQLinear.from_linear(nn.Linear(128, 64, bias=False))
    exp = AWQExperts.from_dense(torch.randn(4, 256, 128, generator=g).bfloat16() * 0.05,
                                torch.randn(4, 128, 128, generator=g).bfloat16() * 0.05)

    def step(x, ids, w):
        return exp(x, ids, w) + lin(x).float().sum()

    x = torch.randn(3, 128, generator=g).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    w = torch.rand(3, 2, generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # no graph breaks
    torch.testing.assert_close(compiled(x, ids, w), step(x, ids, w))


def test_tiny_awq_checkpoint_loads_into_converted_model(tmp_path):
    """checkpoint.py (--awq) -> convert_to_awq -> loader.load_weights -> densify_awq: every
    tensor finds its parameter, and the modules compute what the bf16 weights they came from do."""
    from model.checkpoint import checkpoint_tensor_specs, init_tensor, make_checkpoint
    from model.config import ModelConfig
    from model.loader import load_weights
    from model.model import DeepseekV32ForCausalLM

    path = make_checkpoint(tmp_path / "awq", "tiny", awq=True)
    config = ModelConfig.from_json(path)
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config)
    converted = convert_to_awq(model, config.quantization)
    assert any(n.endswith("mlp.experts") for n in converted)
    load_weights(model, path, config)  # raises on any missing / unexpected / misshapen tensor
    assert densify_awq(model) == [n for n in converted if n.endswith("kv_b_proj")] != []
    specs = checkpoint_tensor_specs(config)
    g = torch.Generator().manual_seed(12)
    mods = dict(model.named_modules())
    for name in converted:
        if name.endswith("kv_b_proj"):
            w = init_tensor(name + ".weight", specs[name + ".weight"], config)
            assert type(mods[name]) is nn.Linear and _rel(mods[name].weight, w) < 0.15
        elif name.endswith("o_proj"):
            w = init_tensor(name + ".weight", specs[name + ".weight"], config)
            x = torch.randn(3, w.shape[1], generator=g).bfloat16()
            assert _rel(mods[name](x), F.linear(x, w)) < 0.15  # 4-bit RTN of Gaussian weights
