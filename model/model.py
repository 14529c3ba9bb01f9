"""DeepSeek-V3.2 in plain PyTorch, following the fixed DeepSeek reference (docs/model_notes.md,
"which reference") with the Hugging Face parameter names (docs/CONTRACTS.md).

Tokens are flat: a step carries ``T`` tokens of ``B`` requests (``ForwardMeta``). The KV cache is
the ``KVCache`` passed in; the model only calls its per-layer ``store``/``select``/``fetch``/
``read`` (and reads its ``index_k``) and the attention ops, so offloading changes no model code.

Attention runs in the absorbed (MQA) form, the form the serving kernels use, over the
``index_topk`` rows the indexer selects per query:
- prefill (one request, a chunk of ``T`` tokens): ``echo::prefill_indexer_topk`` selects for every
  query over its causal prefix, ``echo::sparse_mla_prefill`` attends over the request's rows;
- decode (``T == B``, one token per request): ``echo::indexer_topk``, ``echo::sparse_mla_decode``.
The reference's explicit form (keys and values expanded by ``kv_b_proj``) is model/prefill_ref.py,
what the tests compare with; it agrees up to bf16 rounding (tests/test_prefill_model.py).

The decode step is torch.compile(fullgraph=True, mode="reduce-overhead")-friendly: fixed shapes,
no host syncs, no Python branching on tensor values; per-step values come in through ``meta``.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from custom_ops import attention as _attention  # noqa: F401  (registers echo::sparse_mla_decode)
from custom_ops import prefill as _prefill_ops  # noqa: F401  (registers the echo:: prefill ops)
from custom_ops.cache.kv_cache import KVCache, LayerKV
from custom_ops.fp8 import act_quant, fp8_round_trip
from custom_ops.kv_format import (
    pack_index_k,
    pack_kv_rows,
)
from model.config import ModelConfig
from model.forward_meta import ForwardMeta
from model.fused_proj import fusable, fuse_linears
from model.moe import MLP, MoE
from model.rope import YarnRotary, apply_rope, hadamard_matrix, rotate_activation

DTYPE = torch.bfloat16
LAYERNORM_EPS = 1e-6  # the reference's LayerNorm default (indexer k_norm)


# ---- norms -------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x²) + eps) * weight`` in fp32 (weight held in fp32), output in x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def _norm(self, xf: torch.Tensor) -> torch.Tensor:
        var = xf.pow(2).mean(-1, keepdim=True)
        return self.weight * (xf * torch.rsqrt(var + self.eps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x.float()).to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's fused residual: ``residual = x + residual`` in fp32, normalise it;
        returns (normed, new residual), both in x's dtype."""
        xf = x.float() + residual.float()
        return self._norm(xf).to(x.dtype), xf.to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, fp32 math (the indexer's ``k_norm``, docs/model_notes.md)."""

    def __init__(self, dim: int, eps: float = LAYERNORM_EPS):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (self.dim,), self.weight, self.bias, self.eps).to(x.dtype)


def _linear(din: int, dout: int, dtype: torch.dtype = DTYPE) -> nn.Linear:
    return nn.Linear(din, dout, bias=False, dtype=dtype)


# ---- lightning indexer -------------------------------------------------------------------------


class Indexer(nn.Module):
    """DSA lightning indexer (docs/model_notes.md): FP8 queries of ``index_n_heads`` heads and one
    FP8 key per token, both Hadamard-rotated; head weights from ``weights_proj`` in fp32."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = _linear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = _linear(config.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim)
        # fp32 as in the fixed reference (the checkpoint stores bf16; docs/model_notes.md, indexer)
        self.weights_proj = _linear(config.hidden_size, self.n_heads, dtype=torch.float32)
        self.softmax_scale = self.head_dim**-0.5
        self.register_buffer("hadamard", hadamard_matrix(self.head_dim), persistent=False)

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.hadamard.copy_(hadamard_matrix(self.head_dim, device=self.hadamard.device))

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        wk_x: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, D]`` (attn-normed), ``qr [T, q_lora]`` -> (q e4m3 ``[T, Hi, 128]``, head weights
        fp32 ``[T, Hi]``, key rows uint8 ``[T, 132]`` for the indexer cache). ``wk_x``: ``wk(x)``
        when MLA's fused projection computed it (``wk`` is then None)."""
        t = x.shape[0]
        q = self.wq_b(qr).view(t, self.n_heads, self.head_dim)  # [T, Hi, 128]
        # rope FIRST in the indexer, and non-interleaved (docs/model_notes.md, rope layouts)
        q_pe, q_nope = torch.split(q, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q = torch.cat([apply_rope(q_pe, cos, sin, interleaved=False), q_nope], dim=-1)
        k = self.k_norm(self.wk(x) if wk_x is None else wk_x)  # [T, 128]
        k_pe, k_nope = torch.split(k, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k = torch.cat([apply_rope(k_pe, cos, sin, interleaved=False), k_nope], dim=-1)
        # Hadamard before FP8 spreads outliers; q·k is unchanged in exact arithmetic.
        q = rotate_activation(q, self.hadamard)
        k = rotate_activation(k, self.hadamard)
        q_fp8, q_scale = act_quant(q, self.head_dim, "ue8m0")  # [T, Hi, 128], [T, Hi, 1]
        k_fp8, k_scale = act_quant(k, self.head_dim, "ue8m0")  # [T, 128], [T, 1]
        w = self.weights_proj(x.float()) * self.n_heads**-0.5  # [T, Hi] fp32
        # fold q's dequantisation scale and the 128^-0.5 softmax scale into the head weights
        w = w * q_scale.squeeze(-1) * self.softmax_scale  # [T, Hi]
        return q_fp8, w, pack_index_k(k_fp8, k_scale)


# ---- MLA ---------------------------------------------------------------------------------------


class MLA(nn.Module):
    """Multi-head latent attention with the DSA indexer (docs/model_notes.md, MLA)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_head_dim
        self.v_head_dim = config.v_head_dim
        self.index_topk = config.index_topk
        self.q_lora_rank = config.q_lora_rank
        self.kv_a_dim = self.kv_lora_rank + self.qk_rope_head_dim  # 576: c_kv then k_pe
        self.softmax_scale = config.softmax_scale  # 192^-0.5 * YaRN mscale² (0.1352 for V3.2)
        d, h, eps = config.hidden_size, self.n_heads, config.rms_norm_eps
        self.q_a_proj = _linear(d, config.q_lora_rank)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps)
        self.q_b_proj = _linear(config.q_lora_rank, h * self.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(d, self.kv_a_dim)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = _linear(self.kv_lora_rank, h * (self.qk_nope_head_dim + self.v_head_dim))
        self.o_proj = _linear(h * self.v_head_dim, d)
        self.indexer = Indexer(config)
        # q_a_proj, kv_a_proj_with_mqa and (where it has their type) the indexer's wk as one
        # linear once fuse_a_projections() ran (they read the same x: one GEMM, and for FP8 one
        # activation quantisation); a_splits: its outputs' widths, in order
        self.qkv_a_proj: nn.Module | None = None
        self.a_splits: list[int] = []

    def fuse_a_projections(self) -> bool:
        """Replace ``q_a_proj``, ``kv_a_proj_with_mqa`` and, where it is a linear of their type,
        the indexer's ``wk`` by one linear ``[q_a | wk | kv_a]`` (``model.fused_proj``; wk in
        the middle keeps FP8's 128-row blocks whole; the parts then None). AWQ checkpoints keep
        the indexer 16-bit: there q_a and kv_a alone. False, changing nothing, where they cannot
        be fused (e.g. AWQ modules already repacked) or already are."""
        if self.qkv_a_proj is not None:
            return False
        three = [self.q_a_proj, self.indexer.wk, self.kv_a_proj_with_mqa]
        parts = three if fusable(three) else [self.q_a_proj, self.kv_a_proj_with_mqa]
        if not fusable(parts):
            return False
        self.qkv_a_proj = fuse_linears(parts)
        self.a_splits = [p.out_features for p in parts]
        self.q_a_proj = self.kv_a_proj_with_mqa = None
        if len(parts) == 3:
            self.indexer.wk = None
        return True

    def project_a(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``x [T, D]`` -> ``q_a_proj(x) [T, q_lora]``, ``kv_a_proj_with_mqa(x) [T, 576]``, and
        the indexer's ``wk(x) [T, 128]`` where the fused linear computes it (else None: the
        indexer does). One GEMM once fused."""
        if self.qkv_a_proj is None:
            return self.q_a_proj(x), self.kv_a_proj_with_mqa(x), None
        out = self.qkv_a_proj(x).split(self.a_splits, -1)
        return (out[0], out[2], out[1]) if len(out) == 3 else (out[0], out[1], None)

    def a_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The 16-bit weights of ``q_a_proj``, ``kv_a_proj_with_mqa`` and the indexer's ``wk``
        (row views of the fused one once fused), for code that edits them in place
        (model/locality.py)."""
        if self.qkv_a_proj is None:
            return self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight, self.indexer.wk.weight
        w = self.qkv_a_proj.weight.split(self.a_splits)
        return (w[0], w[2], w[1]) if len(w) == 3 else (w[0], w[1], self.indexer.wk.weight)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: ForwardMeta,
        cache_layer: LayerKV,
    ) -> torch.Tensor:
        """``x [T, D]`` (attn-normed) -> ``[T, D]``; writes the tokens' rows into the cache."""
        t = x.shape[0]
        q_a, kv, wk_x = self.project_a(x)  # [T, q_lora], [T, 576], [T, 128] or None
        qr = self.q_a_layernorm(q_a)  # [T, q_lora]: also the indexer's query input
        q = self.q_b_proj(qr).view(t, self.n_heads, self.qk_head_dim)  # [T, H, 192]
        # nope FIRST in MLA, rope interleaved (docs/model_notes.md, rope layouts)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, interleaved=True)  # [T, H, 64]
        c_kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        # the reference: the deployed cache is FP8, so the latent goes through FP8 and back before
        # it is cached or used; k_pe stays bf16.
        c_kv = fp8_round_trip(self.kv_a_layernorm(c_kv))  # [T, 512]
        k_pe = apply_rope(k_pe, cos, sin, interleaved=True)  # [T, 64]
        q_idx, w_idx, index_rows = self.indexer(x, qr, cos, sin, wk_x)
        rows = pack_kv_rows(c_kv, k_pe, cache_layer.fmt)  # [T, row] uint8
        # padding (slot -1) writes nothing; a prefill keeps its rows on the device for later chunks
        cache_layer.store(
            rows, index_rows, meta.out_slots, None if meta.is_decode else meta.positions
        )
        if meta.is_decode:
            o = self._decode(q_nope, q_pe, q_idx, w_idx, meta, cache_layer)
        else:
            o = self._prefill(q_nope, q_pe, q_idx, w_idx, meta, cache_layer)
        return self.o_proj(o.flatten(1))  # [T, D]

    def kv_b_weight(self) -> torch.Tensor:
        """``kv_b_proj``'s weight ``[H * (nope + v), 512]`` bf16, for weight absorption."""
        w = getattr(self.kv_b_proj, "weight", None)
        if not isinstance(w, torch.Tensor):
            raise ValueError(
                "MLA decode absorbs kv_b_proj into the query and output: kv_b_proj must expose a "
                "16-bit `weight` [H*(nope+v), kv_lora_rank] (dequantise AWQ kv_b_proj at load)"
            )
        return w.to(DTYPE)

    def _decode(
        self,
        q_nope: torch.Tensor,  # [B, H, nope]
        q_pe: torch.Tensor,  # [B, H, 64]
        q_idx: torch.Tensor,  # [B, Hi, 128] e4m3
        w_idx: torch.Tensor,  # [B, Hi] fp32
        meta: ForwardMeta,
        cache_layer: LayerKV,
    ) -> torch.Tensor:
        """Absorbed form: ``q = [q_nope·W_UK | q_pe]`` (576) against the selected latent rows,
        ``o = (P·c_kv)·W_UV``. Padded rows (seq_len 0) select nothing and get zeros."""
        w = self.kv_b_weight().view(self.n_heads, -1, self.kv_lora_rank)  # [H, nope+v, 512]
        w_uk = w[:, : self.qk_nope_head_dim]  # [H, nope, 512]
        w_uv = w[:, self.qk_nope_head_dim :]  # [H, v, 512]
        q_abs = _per_head("bhd,hdc->bhc", q_nope, w_uk)  # [B, H, 512] bf16
        q = torch.cat([q_abs, q_pe], dim=-1)  # [B, H, 576]
        host_slots, _kth = cache_layer.select(
            q_idx.view(torch.uint8), w_idx, meta.block_table, meta.seq_lens
        )  # [B, topk] int32, -1 pad
        pool, slots = cache_layer.fetch(host_slots)  # [N, row] uint8, [B, topk] int32
        o_lat = torch.ops.echo.sparse_mla_decode(
            q, pool, slots, self.softmax_scale, cache_layer.fmt
        )  # [B, H, 512] bf16
        return _per_head("bhc,hdc->bhd", o_lat, w_uv)  # [B, H, v]

    def _prefill(
        self,
        q_nope: torch.Tensor,  # [T, H, nope]
        q_pe: torch.Tensor,  # [T, H, 64]
        q_idx: torch.Tensor,  # [T, Hi, 128] e4m3
        w_idx: torch.Tensor,  # [T, Hi] fp32
        meta: ForwardMeta,
        cache_layer: LayerKV,
    ) -> torch.Tensor:
        """Sparse prefill in the absorbed form (this chunk's rows were stored first): each query's
        exact indexer top-k over its causal prefix (``echo::prefill_indexer_topk``, token
        positions), then ``echo::sparse_mla_prefill`` over those of the request's rows, the decode
        kernel's form and numerics. The explicit form is model/prefill_ref.py (tests only).

        The context is every position the block table covers (``P * 64``; the ops mask each
        query's positions past its own, so no host read of seq_len is needed)."""
        # [T, topk] int32 positions (-1 pad), the scores by the cache's kernel_backend, and the
        # request's rows by position [L, row] uint8 (every selected one: LayerKV.prefill_select)
        sel, rows = cache_layer.prefill_select(
            q_idx.view(torch.uint8), w_idx, meta.block_table, meta.positions
        )
        w = self.kv_b_weight().view(self.n_heads, -1, self.kv_lora_rank)  # [H, nope+v, 512]
        w_uk = w[:, : self.qk_nope_head_dim]  # [H, nope, 512]
        w_uv = w[:, self.qk_nope_head_dim :]  # [H, v, 512]
        q = torch.cat([torch.einsum("thd,hdc->thc", q_nope, w_uk), q_pe], dim=-1)  # [T, H, 576]
        o_lat = torch.ops.echo.sparse_mla_prefill(
            q, rows, sel, self.softmax_scale, cache_layer.fmt
        )  # [T, H, 512] bf16
        return torch.einsum("thc,hdc->thd", o_lat, w_uv)  # [T, H, v]


def _per_head(eq: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(eq, x, w)``: a matmul per head over the decode batch's B rows. On CPU one row
    is computed as two (the row twice, then the first): Inductor's CPU lowering of a bmm with one
    row is an elementwise product, each rounded to bf16 (``emulate_precision_casts``), and a sum
    (torch/_inductor/kernel/bmm.py), so the compiled batch-1 decode step differed from eager by up
    to 11% of the logits' max on the tiny model (tests/test_compile.py); with two rows both run
    the same GEMM. CUDA's lowering keeps such a bmm a GEMM, so it runs as written there."""
    if x.device.type == "cpu" and x.shape[0] == 1:
        return torch.einsum(eq, torch.cat([x, x]), w)[:1]
    return torch.einsum(eq, x, w)


# ---- blocks and the model ----------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm decoder layer: MLA, then the dense MLP (layer < first_k_dense_replace) or MoE."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = MLA(config)
        self.mlp: nn.Module = (
            MLP(d, config.intermediate_size) if not config.is_moe_layer(layer_id) else MoE(config)
        )
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: ForwardMeta,
        cache_layer: LayerKV,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h [T, D]`` the previous layer's output, ``residual [T, D]`` (None at layer 0)."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        x = self.self_attn(x, cos, sin, meta, cache_layer)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class DeepseekV32Model(nn.Module):
    """``embed_tokens``, ``layers``, ``norm`` (HF names); the MTP layer is not built."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=DTYPE)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = YarnRotary(config)  # non-persistent buffer only: no checkpoint name

    def forward(self, meta: ForwardMeta, cache: KVCache) -> torch.Tensor:
        """Final-normed hidden states of the tokens at ``meta.logits_indices``: ``[B, D]`` (a
        prefill may ask for K tokens: ``[K, D]``)."""
        h = self.embed_tokens(meta.input_ids)  # [T, D]
        cos, sin = self.rotary_emb(meta.positions)  # [T, 32] each, shared by MLA and indexer
        residual: torch.Tensor | None = None
        if meta.is_decode:  # per-step state of the indexer's library backend, shared by layers
            cache.begin_decode(meta.seq_lens)
        for layer, cache_layer in zip(self.layers, cache.layers, strict=True):
            h, residual = layer(h, residual, cos, sin, meta, cache_layer)
        assert residual is not None  # num_hidden_layers >= 1 (config validation)
        idx = meta.logits_indices
        # the final norm is per token: apply it to the B tokens that produce logits only
        return self.norm.add_and_norm(h[idx], residual[idx])[0]  # [B, D]


def check_meta(meta: ForwardMeta, cache: KVCache, config: ModelConfig) -> None:
    """Shape/dtype checks of one step's inputs (static: free under torch.compile)."""
    t = meta.input_ids.shape[0]
    if meta.input_ids.dim() != 1 or meta.positions.shape != (t,) or meta.out_slots.shape != (t,):
        raise ValueError(
            "ForwardMeta: input_ids, positions and out_slots must all be [T], got "
            f"{list(meta.input_ids.shape)}, {list(meta.positions.shape)}, "
            f"{list(meta.out_slots.shape)}"
        )
    if meta.block_table.dim() != 2 or meta.block_table.dtype != torch.int32:
        raise ValueError(
            f"ForwardMeta.block_table must be int32 [B, P], got {meta.block_table.dtype} "
            f"{list(meta.block_table.shape)}"
        )
    b = meta.block_table.shape[0]
    # a prefill may ask for the logits of several of its tokens (prompt_logprobs: all of them)
    k = meta.logits_indices.shape[0] if not meta.is_decode else b
    if meta.seq_lens.shape != (b,) or meta.logits_indices.shape != (k,) or k < 1:
        raise ValueError(
            f"ForwardMeta: seq_lens must be [B={b}] and logits_indices [B] (a prefill: [K >= 1]), "
            f"got {list(meta.seq_lens.shape)} and {list(meta.logits_indices.shape)}"
        )
    if meta.is_decode and t != b:
        raise ValueError(f"ForwardMeta: a decode step has one token per request, got T={t}, B={b}")
    if not meta.is_decode and b != 1:
        raise ValueError(f"ForwardMeta: a prefill step carries one request, got B={b}")
    if len(cache.layers) != config.num_hidden_layers:
        raise ValueError(
            f"KVCache has {len(cache.layers)} layers, the model {config.num_hidden_layers}"
        )
    if cache.config.topk != config.index_topk:
        raise ValueError(
            f"KVCache topk={cache.config.topk} differs from the model's "
            f"index_topk={config.index_topk}"
        )


class DeepseekV32ForCausalLM(nn.Module):
    """The served model: ``.model`` (``DeepseekV32Model``) and ``.lm_head``.

    Parameters are bf16 except the norms, ``indexer.weights_proj`` and
    ``gate.e_score_correction_bias`` (fp32). Build on the meta device, ``to_empty()``, load the
    weights, then call ``init_buffers()`` to compute the non-persistent buffers.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DeepseekV32Model(config)
        self.lm_head = _linear(config.hidden_size, config.vocab_size)

    def forward(self, meta: ForwardMeta, cache: KVCache) -> torch.Tensor:
        """One step: writes the step's KV rows into ``cache``; returns logits fp32 ``[B, V]`` of
        the tokens at ``meta.logits_indices``."""
        check_meta(meta, cache, self.config)
        h = self.model(meta, cache)  # [B, D] bf16
        w = self.lm_head.weight  # [V, D] bf16
        # The reference computes the head in fp32; bf16 x bf16 products are exact in fp32, so an
        # fp32-accumulating bf16 GEMM gives the same result without an fp32 copy of the weight.
        if h.is_cuda:
            return torch.mm(h, w.t(), out_dtype=torch.float32)  # [B, V]
        return F.linear(h.float(), w.float())  # [B, V]

    def fuse_a_projections(self) -> int:
        """Every layer's ``MLA.fuse_a_projections``, once the weights are final (what serves a
        model does it: ``runtime.model_runner.build_runner``); returns how many layers fused."""
        return sum(m.fuse_a_projections() for m in self.modules() if isinstance(m, MLA))

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute every non-persistent buffer (rope frequencies, Hadamard matrices) on the
        device it lives on: call after ``to_empty()`` from the meta device."""
        for m in self.modules():
            if isinstance(m, (YarnRotary, Indexer)):
                m.reset_buffers()

    @torch.no_grad()
    def random_init_(
        self, seed: int = 0, std: float = 0.02, locality: float = 0.0
    ) -> DeepseekV32ForCausalLM:
        """Deterministic random weights: N(0, std) for projections and embeddings, N(0, std/2)
        for the router correction bias, ones for norm weights, zeros for the LayerNorm bias.
        Each parameter draws from a generator on its own device seeded by (seed, name), so the
        values do not depend on the order of initialisation (they do differ between CPU and
        CUDA generators). Also initialises the buffers. ``locality`` > 0 then plants the bench's
        locality model (model/locality.py); 0 leaves the weights as drawn."""
        from model.locality import check_locality, plant_locality

        check_locality(locality)  # before any work
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                raise ValueError(
                    f"random_init_: {name} is on the meta device; call to_empty() first"
                )
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("norm.bias"):
                p.zero_()
            else:
                g = torch.Generator(device=p.device)
                g.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                s = std / 2 if name.endswith("e_score_correction_bias") else std
                p.normal_(0.0, s, generator=g)
        self.init_buffers()
        plant_locality(self, locality, seed, std)
        return self
