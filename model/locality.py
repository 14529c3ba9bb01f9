"""The bench's locality model: a persistent component planted in random weights so the real
indexer's selections have temporal locality (docs/prefetch.md, "Locality model").

Random weights make every decode query new: consecutive-step top-k sets barely overlap, so the
GPU-pool hit rates of a random-weight bench say nothing about a real model's. Real
DeepSeek-V3.2's consecutive-step top-2048 overlap is ~35-50% on deep layers and ~1-2% on layers
0-1 (TensorRT-LLM, SWE-Bench 64K). The model here, with one knob ``locality`` = λ in [0, 1):

- **A protected channel**: hidden coordinate ``D - 1`` of every token's embedding is ``std`` (the
  weights' own scale, so the RMSNorms barely change) and no random weight reads or writes it
  (that column of every reader of the residual stream and that row of every writer are zero), so
  the residual stream carries the same value on that coordinate at every layer, for every token.
- **Read by the indexers of layers >= ``FIRST_LOCAL_LAYER``** (2; layers 0-1 read nothing, as the
  published 1-2% says they have no locality): ``q_a_proj``'s column on the channel is a fixed
  random direction ``f`` of the query latent, so every indexer head gets a fixed query part
  through the random ``wq_b`` (MLA's ``q_b_proj`` has ``f`` projected out: a fixed part in every
  MLA query makes the greedy next token repeat, which is locality at layers 0-1 too), and
  ``indexer.weights_proj``'s column is the same positive value for every head (a fixed, positive
  head weighting).
- So a token's index score is ``Σ_h w_h relu(q_h · k)`` with ``q_h = q̄_h + q'_h(step)``,
  ``w_h = w̄ + w'_h(step)``: the fixed part ``Σ_h w̄ relu(q̄_h · k)`` is a **persistent per-token
  importance** (how well that token's key, injected or computed, aligns with the fixed queries),
  the rest is the query-dependent part. λ is the fixed part's share of the energy of those two
  inputs (query latent before its RMSNorm, head weights), set per layer from a measurement at
  init (a few random tokens through the embedding and the MLPs; attention left out): amplitude
  ratio fixed / step-dependent = sqrt(λ / (1 - λ)).

What the overlap and hit rates come to is measured, never set: the indexer selects on these
weights (``benchmarks/calibrate_locality.py`` measures overlap per layer against λ). λ = 0 leaves
the weights untouched (bit for bit).
"""

from __future__ import annotations

import math

import torch

# the first layer whose indexer reads the persistent channel (layers 0-1: ~1-2% published overlap)
FIRST_LOCAL_LAYER = 2
# The bench preset's default knob (echo-compile bench --locality): the λ whose deep-layer overlap
# is the published ~0.42, interpolated by `python -m benchmarks.calibrate_locality` on the H200
# (benchmarks/results/calibrate_locality_h200.json: 0.80 -> 0.31, 0.93 -> 0.54; 0.862)
BENCH_LOCALITY = 0.86
_PROBE_TOKENS = 16  # random tokens of the init-time scale measurement


def check_locality(locality: float) -> float:
    if not isinstance(locality, (int, float)) or not 0.0 <= locality < 1.0:
        raise ValueError(f"locality must be a number in [0, 1), got {locality!r}")
    return float(locality)


def _readers(model) -> list[torch.Tensor]:
    """Every weight that reads the residual stream (hidden size on its last dim)."""
    out = [model.lm_head.weight]
    for block in model.model.layers:
        a = block.self_attn
        out += list(a.a_weights())  # q_a_proj's, kv_a_proj_with_mqa's, wk's (views once fused)
        out += [a.indexer.weights_proj.weight]
        mlps = [block.mlp]
        if hasattr(block.mlp, "experts"):  # MoE
            out += [block.mlp.gate.weight, block.mlp.experts.w13_weight]
            mlps = [block.mlp.shared_experts] if block.mlp.shared_experts is not None else []
        for m in mlps:
            out += [m.gate_proj.weight, m.up_proj.weight]
    return out


def _writers(model) -> list[tuple[torch.Tensor, int]]:
    """Every weight that writes the residual stream, with its hidden-size dimension."""
    out = []
    for block in model.model.layers:
        out.append((block.self_attn.o_proj.weight, 0))
        if hasattr(block.mlp, "experts"):
            out.append((block.mlp.experts.w2_weight, 1))
            if block.mlp.shared_experts is not None:
                out.append((block.mlp.shared_experts.down_proj.weight, 0))
        else:
            out.append((block.mlp.down_proj.weight, 0))
    return out


def _check_plain(model) -> None:
    for p in _readers(model) + [w for w, _ in _writers(model)]:
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            raise ValueError("locality: needs plain 16/32-bit weights (not AWQ/FP8-packed)")


@torch.no_grad()
def _scales(model, channel: int, seed: int) -> list[tuple[float, float, float]]:
    """Per layer (channel value after input_layernorm, rms of q_a_proj's output, rms of
    weights_proj's output) over a few random tokens, attention left out (small next to the MLPs
    at random init); the channel is already protected, so the outputs are the step-dependent part
    alone."""
    emb = model.model.embed_tokens.weight
    g = torch.Generator(device=emb.device)
    g.manual_seed(seed * 7919 + 17)
    ids = torch.randint(0, emb.shape[0], (_PROBE_TOKENS,), generator=g, device=emb.device)
    res = emb[ids]
    out = []
    for block in model.model.layers:
        x = block.input_layernorm(res)
        a = block.self_attn
        qa = a.project_a(x)[0].float().pow(2).mean().sqrt().item()
        wp = a.indexer.weights_proj(x.float()).pow(2).mean().sqrt().item()
        out.append((x[:, channel].float().mean().item(), qa, wp))
        y = block.mlp(block.post_attention_layernorm(res))
        res = (res.float() + y.float()).to(res.dtype)
    return out


@torch.no_grad()
def plant_locality(model, locality: float, seed: int = 0, std: float = 0.02) -> None:
    """Plant the locality model (module docstring) into ``model``'s random weights, in place.
    ``locality`` = 0 changes nothing. Idempotent for a given model: planting again with another
    λ > 0 rewrites only the planted entries (the protected channel's zeros stay)."""
    locality = check_locality(locality)
    if locality == 0.0:
        return
    _check_plain(model)
    cfg = model.config
    channel = cfg.hidden_size - 1
    for w in _readers(model):
        w[..., channel] = 0
    for w, dim in _writers(model):
        w.select(dim, channel).zero_()
    model.model.embed_tokens.weight[:, channel] = std
    ratio = math.sqrt(locality / (1.0 - locality))  # fixed / step-dependent amplitude
    scales = _scales(model, channel, seed)
    g = torch.Generator(device="cpu")
    g.manual_seed(seed * 1_000_003 + 4242)
    for i, block in enumerate(model.model.layers):
        if i < FIRST_LOCAL_LAYER:
            continue
        chan, qa_rms, wp_rms = scales[i]
        a = block.self_attn
        f = torch.randn(cfg.q_lora_rank, generator=g)
        f = f / f.norm()
        # |column * chan| = ratio * |step-dependent part| (rms * sqrt(dim))
        col = f * (ratio * qa_rms * math.sqrt(cfg.q_lora_rank) / chan)
        wa = a.a_weights()[0]  # q_a_proj's
        wa[:, channel] = col.to(wa)
        # MLA's query does not read f (only the indexer's wq_b does): a fixed part in every MLA
        # query makes the model's output, so its greedy next token, repeat step after step, and a
        # repeated input token is locality at layers 0-1 too (measured on the tiny preset: 0.03
        # -> 0.13 at λ 0.93 with it)
        wb = a.q_b_proj.weight
        fd = f.to(wb.device)
        wb.copy_((wb.float() - torch.outer(wb.float() @ fd, fd)).to(wb.dtype))
        a.indexer.weights_proj.weight[:, channel] = ratio * wp_rms / chan
