"""An independent, straightforward DeepSeek-V3.2 forward for golden logits of small checkpoints.

Written from the reference formulas (/work/shared/reference/dsv32_arch.md §2, the post-fix
DeepSeek inference demo), NOT from this project's model/ or custom_ops/: it imports neither (a
test scans its imports). It reads a Hugging Face checkpoint directory (config.json, sharded
safetensors with model.safetensors.index.json, bf16 weights) and computes the logits of every
position of one token sequence in the reference's prefill form: dense causal attention masked by
the indexer's top-k, no cache, no batching, nothing fused.

What it implements, section by section of the spec:
- §2.2 YaRN rope: frequency interpolation over the correction range; unit-magnitude cos/sin;
  MLA rope interleaved (pairs 2j, 2j+1), indexer rope non-interleaved (pairs j, j+32).
- §2.3 MLA: q via the q LoRA (RMSNorm), nope first then rope; the latent c_kv RMS-normed and
  round-tripped through FP8 (e4m3, one ue8m0 scale per 128 values) as the deployed cache does;
  keys/values expanded by kv_b_proj; softmax scale qk_head_dim^-0.5 * mscale^2.
- §2.4 indexer: q from qr, k from LayerNorm(x Wk) (weight and bias), rope first, Hadamard rotation,
  FP8 with ue8m0 scales, score = k_scale * sum_h w_h * ReLU(q_h . k), w from fp32 weights_proj
  times n_heads^-0.5 * q_scale * head_dim^-0.5; the top min(topk, p + 1) causal keys (ties to the
  earlier key, the selection convention this project documents).
- §2.5 MoE: sigmoid scores, bias-corrected selection, group-limited (sum of the top-2 per group,
  keep topk_group groups), unbiased weights normalised then scaled; shared expert unscaled;
  SwiGLU in fp32.
- §2.1 RMSNorm in fp32 with the fused residual add; fp32 lm head.

Activations are bf16 between ops (as in the reference), so results agree with an optimised
implementation up to bf16/FP8 rounding, not bit for bit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

BF16 = torch.bfloat16
FP8_MAX = 448.0


# ---- checkpoint -------------------------------------------------------------------------------


def load_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    index = json.loads((path / "model.safetensors.index.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        weights.update(load_file(str(path / shard)))
    return cfg, weights


# ---- small pieces ------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(BF16)


def add_rms_norm(x, residual, w, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's fused residual: the sum in fp32 is normalised (not its bf16 rounding);
    returns (normed bf16, new residual rounded to bf16)."""
    s = x.float() + residual.float()
    return rms_norm(s, w, eps), s.to(BF16)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-6):
    xf = x.float()
    mu = xf.mean(-1, keepdim=True)
    var = (xf - mu).pow(2).mean(-1, keepdim=True)
    return ((xf - mu) / torch.sqrt(var + eps) * w.float() + b.float()).to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.to(x.dtype).T


def fp8_quant(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per ``block`` values: scale = 2^ceil(log2(max(amax, 1e-4) / 448)), values clamp(x / s)
    in e4m3. Returns (e4m3 values, fp32 scales [..., n_blocks])."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    amax = xb.abs().amax(-1).clamp(min=1e-4)
    s = torch.pow(2.0, torch.ceil(torch.log2(amax / FP8_MAX)))
    y = (xb / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return y.reshape(shape), s


def fp8_dequant(y: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    shape = y.shape
    yb = y.float().reshape(*shape[:-1], shape[-1] // block, block)
    return (yb * s[..., None]).reshape(shape)


def hadamard(n: int) -> torch.Tensor:
    """Sylvester-ordered Walsh-Hadamard matrix of size n (a power of two), entries +-1."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def yarn_freqs(cfg: dict, rope_dim: int) -> tuple[torch.Tensor, float]:
    """Per-pair rotation frequencies [rope_dim / 2] and the attention mscale."""
    theta = float(cfg.get("rope_theta", 10000.0))
    freqs = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    rs = cfg.get("rope_scaling") or {}
    factor = float(rs.get("factor", 1.0))
    orig = int(rs.get("original_max_position_embeddings", cfg["max_position_embeddings"]))
    mscale = 1.0
    if rs and cfg["max_position_embeddings"] > orig:
        beta_fast, beta_slow = float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1))

        def corr_dim(rot: float) -> float:
            return rope_dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
        # the reference: mscale = 0.1 * mscale * ln(factor) + 1, squared into the softmax scale
        mscale = 0.1 * float(rs.get("mscale", 1.0)) * math.log(factor) + 1.0
    return freqs, mscale


def rope(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, interleaved: bool):
    """Rotate x [..., T, (heads,) d] by angle pos * freq; interleaved pairs (2j, 2j+1), else
    (j, j + d/2)."""
    ang = pos.float()[:, None] * freqs[None, :]  # [T, d/2]
    cos, sin = torch.cos(ang), torch.sin(ang)
    if x.dim() == 3:  # [T, H, d]
        cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        a, b = xf[..., :half], xf[..., half:]
        out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.to(x.dtype)


# ---- the model ---------------------------------------------------------------------------------


class IndependentDeepSeekV32:
    def __init__(self, path: str | Path):
        self.cfg, self.w = load_checkpoint(path)
        c = self.cfg
        self.eps = float(c["rms_norm_eps"])
        self.freqs, mscale = yarn_freqs(c, c["qk_rope_head_dim"])
        qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        self.softmax_scale = qk_head**-0.5 * mscale * mscale
        self.hadamard = hadamard(c["index_head_dim"])

    def p(self, name: str) -> torch.Tensor:
        return self.w[name]

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """fp32 logits [T, V] of every position of ``ids`` (prefill of the whole sequence)."""
        c = self.cfg
        pos = torch.arange(len(ids))
        h = self.p("model.embed_tokens.weight")[torch.tensor(ids)].to(BF16)  # [T, D]
        residual = None
        for layer in range(c["num_hidden_layers"]):
            pre = f"model.layers.{layer}."
            if residual is None:
                residual = h
                x = rms_norm(h, self.p(pre + "input_layernorm.weight"), self.eps)
            else:
                w_in = self.p(pre + "input_layernorm.weight")
                x, residual = add_rms_norm(h, residual, w_in, self.eps)
            h = self.attention(x, pos, pre + "self_attn.")
            w_post = self.p(pre + "post_attention_layernorm.weight")
            x, residual = add_rms_norm(h, residual, w_post, self.eps)
            if layer < c["first_k_dense_replace"]:
                h = self.swiglu(x, pre + "mlp.")
            else:
                h = self.moe(x, pre + "mlp.")
        final, _ = add_rms_norm(h, residual, self.p("model.norm.weight"), self.eps)
        return final.float() @ self.p("lm_head.weight").float().T

    # -- attention --
    def attention(self, x: torch.Tensor, pos: torch.Tensor, pre: str) -> torch.Tensor:
        c = self.cfg
        t, nh = x.shape[0], c["num_attention_heads"]
        dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        qr = rms_norm(linear(x, self.p(pre + "q_a_proj.weight")),
                      self.p(pre + "q_a_layernorm.weight"), self.eps)  # fmt: skip
        q = linear(qr, self.p(pre + "q_b_proj.weight")).view(t, nh, dn + dr)
        q_nope, q_pe = q[..., :dn], rope(q[..., dn:], pos, self.freqs, interleaved=True)
        kv = linear(x, self.p(pre + "kv_a_proj_with_mqa.weight"))
        c_kv = rms_norm(kv[:, : c["kv_lora_rank"]], self.p(pre + "kv_a_layernorm.weight"), self.eps)
        c_kv = fp8_dequant(*fp8_quant(c_kv)).to(BF16)  # the FP8 cache's precision (REF-NEW)
        k_pe = rope(kv[:, c["kv_lora_rank"] :], pos, self.freqs, interleaved=True)  # [T, dr]
        kvb = linear(c_kv, self.p(pre + "kv_b_proj.weight")).view(t, nh, dn + dv)
        k = torch.cat([kvb[..., :dn], k_pe[:, None, :].expand(t, nh, dr)], -1)  # [T, H, dn+dr]
        v = kvb[..., dn:]
        keep = self.index_mask(x, qr, pos, pre + "indexer.")  # [T, T] bool, causal built in
        qf = torch.cat([q_nope, q_pe], -1).float()
        scores = torch.einsum("qhd,khd->hqk", qf, k.float()) * self.softmax_scale
        scores = scores.masked_fill(~keep[None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(BF16)
        return linear(o.reshape(t, nh * dv), self.p(pre + "o_proj.weight"))

    def index_mask(self, x, qr, pos, pre: str) -> torch.Tensor:
        c = self.cfg
        t, nh, d, dr = x.shape[0], c["index_n_heads"], c["index_head_dim"], c["qk_rope_head_dim"]
        q = linear(qr, self.p(pre + "wq_b.weight")).view(t, nh, d)
        q = torch.cat([rope(q[..., :dr], pos, self.freqs, interleaved=False), q[..., dr:]], -1)
        k = layer_norm(linear(x, self.p(pre + "wk.weight")), self.p(pre + "k_norm.weight"),
                       self.p(pre + "k_norm.bias"))  # fmt: skip
        k = torch.cat([rope(k[..., :dr], pos, self.freqs, interleaved=False), k[..., dr:]], -1)
        # the transform, then its orthonormal scale d^-0.5 (H is symmetric), in fp32 -> bf16
        q = ((q.float() @ self.hadamard) * d**-0.5).to(BF16)
        k = ((k.float() @ self.hadamard) * d**-0.5).to(BF16)
        q8, q_s = fp8_quant(q)  # [T, nh, d], [T, nh, 1]
        k8, k_s = fp8_quant(k)  # [T, d], [T, 1]
        w = x.float() @ self.p(pre + "weights_proj.weight").float().T * nh**-0.5  # [T, nh]
        w = w * q_s[..., 0] * d**-0.5
        dots = torch.einsum("qhd,kd->qhk", q8.float(), k8.float()).relu()  # [T, nh, T]
        score = (dots * w[:, :, None]).sum(1) * k_s[:, 0][None, :]  # [T, T]
        causal = pos[None, :] <= pos[:, None]
        score = score.masked_fill(~causal, float("-inf"))
        keep = torch.zeros(t, t, dtype=torch.bool)
        for i in range(t):
            n = min(c["index_topk"], i + 1)
            # stable sort: among equal scores the earlier key wins
            order = sorted(range(i + 1), key=lambda j: (-float(score[i, j]), j))[:n]
            keep[i, order] = True
        return keep

    # -- feed-forward --
    def swiglu(self, x: torch.Tensor, pre: str) -> torch.Tensor:
        g = linear(x, self.p(pre + "gate_proj.weight")).float()
        u = linear(x, self.p(pre + "up_proj.weight")).float()
        return linear((torch.nn.functional.silu(g) * u).to(BF16), self.p(pre + "down_proj.weight"))

    def moe(self, x: torch.Tensor, pre: str) -> torch.Tensor:
        c = self.cfg
        n_exp, k = c["n_routed_experts"], c["num_experts_per_tok"]
        groups, keep_groups = c["n_group"], c["topk_group"]
        s = torch.sigmoid(x.float() @ self.p(pre + "gate.weight").float().T)  # [T, E]
        biased = s + self.p(pre + "gate.e_score_correction_bias").float()
        per_group = biased.view(-1, groups, n_exp // groups)
        group_score = per_group.topk(2, dim=-1).values.sum(-1)  # [T, G]
        top_groups = group_score.topk(keep_groups, dim=-1).indices
        gmask = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, top_groups, True)
        masked = per_group.masked_fill(~gmask[..., None], float("-inf")).view(-1, n_exp)
        idx = masked.topk(k, dim=-1).indices  # [T, k]
        wts = s.gather(1, idx)
        if c.get("norm_topk_prob", True):
            wts = wts / wts.sum(-1, keepdim=True)
        wts = wts * float(c["routed_scaling_factor"])
        y = torch.zeros(x.shape, dtype=torch.float32)
        for ti in range(x.shape[0]):
            for j in range(k):
                e = int(idx[ti, j])
                y[ti] += wts[ti, j] * self.swiglu(x[ti : ti + 1], f"{pre}experts.{e}.")[0].float()
        y += self.swiglu(x, pre + "shared_experts.").float()
        return y.to(BF16)
