"""Tensor-parallel feed-forward blocks for multi-GPU serving (docs/multi_gpu.md).

Attention, embeddings, norms and the LM head stay whole on every rank (data-parallel attention:
each DP rank keeps whole requests and its own KV cache). The dense MLPs, the shared experts and
every routed expert are split by TP over the intermediate dimension: ``gate_proj`` / ``up_proj``
by output rows (column parallel), ``down_proj`` by input columns (row parallel), so each rank
computes a partial ``[T, D]`` that a sum over the ranks completes.

Two ways tokens meet the sharded weights, fixed by ``TPGroup.gather``:
- ``gather=True`` (dp == tp): every rank holds different tokens (its own requests). The block
  all-gathers the ``T`` rows of every rank (``[tp * T, D]``), runs the router and its weight
  shards on all of them, and reduce-scatters the fp32 partial sums back to its own ``T`` rows.
  Every rank must call with the same ``T``: the runtime pads each step to a bucket agreed by all
  ranks (runtime/distributed/step_sync.py), so that the decode step, collectives included, has
  fixed shapes and is one CUDA graph per bucket.
- ``gather=False`` (dp == 1): every rank holds the same tokens; the partial sums are all-reduced.

The collectives are ``torch.ops._c10d_functional`` ops: traceable by dynamo and capturable in
CUDA graphs with NCCL; the same ops run over gloo on CPU (the tests). The router is replicated and
sees the same gathered rows on every rank, so all ranks route every token alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.moe import MLP, Experts, MoE

_fc = torch.ops._c10d_functional


@dataclass(frozen=True)
class TPGroup:
    """The TP process group a sharded block reduces over (passed in: no process-wide state)."""

    rank: int
    size: int
    group_name: str  # ProcessGroup.group_name of the group (the functional collectives' key)
    gather: bool  # True: each rank has its own tokens (DP attention); False: all share them

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup: rank {self.rank} is not in a group of size {self.size}")


# Features a quantised checkpoint's shard keeps together: an FP8 weight's 128 x 128 scale block, an
# AWQ group of 128 input rows (model/shard_loader.py reads shards in them)
QUANT_BLOCK = 128


def split_block(config: ModelConfig) -> int:
    """The features a shard of ``config``'s feed-forward must hold whole: 1 unless quantised."""
    return QUANT_BLOCK if config.quantization is not None else 1


def whole_splits(total: int, block: int = 1) -> list[int]:
    """The rank counts that split ``total`` features in whole ``block``s: the divisors of
    ``total / block`` (none when ``block`` does not divide ``total``)."""
    if total % block:
        return []
    n = total // block
    return [d for d in range(1, n + 1) if n % d == 0]


def _counts(counts: list[int], shown: int = 12) -> str:
    more = ", ..." if len(counts) > shown else ""
    return ", ".join(map(str, counts[:shown])) + more if counts else "none"


def shard_dim(
    total: int, tp: int, what: str, block: int = 1, counts: list[int] | None = None
) -> int:
    """``total / tp``, or a ValueError naming ``what`` and the rank counts that work when the
    split is not even (in whole ``block``s of features: a quantised checkpoint's,
    ``split_block``): ``counts``, the model's (``ffn_rank_counts``), else ``total``'s own."""
    if tp < 1 or total % (tp * block):
        how = f"in whole blocks of {block}" if block > 1 else "evenly"
        valid = whole_splits(total, block) if counts is None else counts
        raise ValueError(
            f"{what}={total} cannot be split {how} over {tp} feed-forward ranks (tp or ep); "
            f"the counts that work: {_counts(valid)}"
        )
    return total // tp


def ffn_dims(config: ModelConfig, ep: bool = False) -> list[tuple[str, int, int]]:
    """``(what, features, block)`` of every dimension ``parallelize_ffn`` splits over the
    feed-forward ranks (``ep``: the routed experts by expert)."""
    block, moe = split_block(config), config.moe_intermediate_size
    dims = []
    if any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        dims.append(("intermediate_size", config.intermediate_size, block))
    if not ep:
        dims.append(("moe_intermediate_size", moe, block))
    else:
        dims.append(("n_routed_experts", config.n_routed_experts, 1))
        if config.n_shared_experts > 0:
            dims.append(("shared experts' features", config.n_shared_experts * moe, block))
    return dims


def ffn_rank_counts(config: ModelConfig, ep: bool = False) -> list[int]:
    """The feed-forward rank counts (tp, or ep with ``ep``) that split every dimension of
    ``ffn_dims`` whole."""
    common = None
    for _, total, block in ffn_dims(config, ep):
        ok = set(whole_splits(total, block))
        common = ok if common is None else common & ok
    return sorted(common) if common is not None else [1]


def check_ffn_split(config: ModelConfig, ranks: int, ep: bool = False) -> None:
    """A ValueError naming the first dimension ``ranks`` feed-forward ranks cannot split and the
    counts that split them all (before any layer is built)."""
    counts = ffn_rank_counts(config, ep)
    for what, total, block in ffn_dims(config, ep):
        shard_dim(total, ranks, what, block, counts)


def all_gather_rows(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """``[T, ...]`` of every rank, concatenated in rank order: ``[size * T, ...]``."""
    return _fc.wait_tensor(_fc.all_gather_into_tensor(x.contiguous(), g.size, g.group_name))


def reduce_scatter_rows(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """The sum over ranks of ``x [size * T, ...]``, this rank's ``T`` rows."""
    return _fc.wait_tensor(_fc.reduce_scatter_tensor(x.contiguous(), "sum", g.size, g.group_name))


def all_reduce_sum(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    return _fc.wait_tensor(_fc.all_reduce(x.contiguous(), "sum", g.group_name))


def _tp_ffn(x: torch.Tensor, g: TPGroup, partial) -> torch.Tensor:
    """Gather (or not) the rows, compute the rank's fp32 partial sum, reduce it; ``x``'s dtype."""
    if g.size == 1:
        return partial(x).to(x.dtype)
    if g.gather:
        y = partial(all_gather_rows(x, g))  # [size * T, D] fp32 partial
        return reduce_scatter_rows(y, g).to(x.dtype)  # [T, D]
    return all_reduce_sum(partial(x), g).to(x.dtype)


class TPMLP(MLP):
    """``MLP`` with ``inter_dim / tp`` of the intermediate features on this rank (same parameter
    names, so the checkpoint loads by name with the rows/columns of this rank's shard)."""

    def __init__(self, dim: int, inter_dim: int, g: TPGroup, block: int = 1):
        super().__init__(dim, shard_dim(inter_dim, g.size, "intermediate_size", block))
        self.tp = g

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``down(silu(gate(x)) * up(x))``, fp32 ``[T, D]``."""
        h = F.silu(self.gate_proj(x).float()) * self.up_proj(x).float()  # [T, I/tp] fp32
        return self.down_proj(h.to(x.dtype)).float()  # [T, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tp_ffn(x, self.tp, self.partial)


class TPMoE(MoE):
    """``MoE`` with every routed expert and the shared experts TP-split over the intermediate
    dimension; the router (``gate``) is whole on every rank."""

    def __init__(self, config: ModelConfig, g: TPGroup):
        super().__init__(config)
        d = config.hidden_size
        inter = shard_dim(
            config.moe_intermediate_size, g.size, "moe_intermediate_size", split_block(config)
        )
        self.experts = Experts(config.n_routed_experts, d, inter)
        self.shared_experts = (
            MLP(d, config.n_shared_experts * inter) if config.n_shared_experts > 0 else None
        )
        self.tp = g

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x)  # [T, k] fp32, [T, k]: the same on every rank
        y = self.experts(x, indices, weights).float()  # [T, D] this rank's share
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).float()
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tp_ffn(x, self.tp, self.partial)


class EPMoE(MoE):
    """``MoE`` with the routed experts split by expert (expert parallel): this rank holds experts
    ``[rank * E/ep, (rank + 1) * E/ep)`` whole and computes only the picks that fall on them; the
    shared experts are TP-split as in ``TPMoE``. The same collectives as TP (every rank's rows
    gathered, fp32 partial sums reduce-scattered): fixed shapes, no token counts exchanged.

    A pick of another rank's expert becomes the skip id ``n_local`` (one past this rank's
    experts), which the MoE ops' grouping (``custom_ops.moe_align``) gives no slot:
    each rank's grouped GEMMs run its own experts' (token, expert) pairs only, the ``tp x T``
    gathered rows times the share of picks landing here (on average 1/ep of all picks), not all
    of them. What is not saved: the rows still travel by all-gather and reduce-scatter (volume
    ``tp x T x D``), where an all-to-all would send each row only to the ranks of its experts.
    """

    def __init__(self, config: ModelConfig, g: TPGroup):
        super().__init__(config)
        d, inter = config.hidden_size, config.moe_intermediate_size
        self.n_local = shard_dim(config.n_routed_experts, g.size, "n_routed_experts")
        self.first = g.rank * self.n_local
        self.experts = Experts(self.n_local, d, inter)
        shared = shard_dim(
            config.n_shared_experts * inter, g.size, "shared experts' features", split_block(config)
        )
        self.shared_experts = MLP(d, shared) if config.n_shared_experts > 0 else None
        self.tp = g

    def local_picks(
        self, indices: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Global expert ids ``[T, k]`` -> this rank's local ids (``n_local``: skip) and weights
        (0 where skipped, so no kernel can weigh a foreign pick in)."""
        local = indices - self.first
        mine = (local >= 0) & (local < self.n_local)  # [T, k] picks of this rank's experts
        ids = torch.where(mine, local, torch.full_like(local, self.n_local))
        return ids, torch.where(mine, weights, torch.zeros_like(weights))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x)  # [T, k] fp32, [T, k] global expert ids
        ids, w = self.local_picks(indices, weights)
        y = self.experts(x, ids, w).float()  # [T, D] this rank's experts' share
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).float()
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tp_ffn(x, self.tp, self.partial)


def parallelize_ffn(model: nn.Module, config: ModelConfig, g: TPGroup, ep: bool = False) -> None:
    """Replace, in place, every block's ``mlp`` of ``model`` (``DeepseekV32ForCausalLM``, built
    on the meta device before loading) by its TP version for group ``g`` (``ep``: the routed
    experts split by expert instead, ``EPMoE``)."""
    check_ffn_split(config, g.size, ep)
    for i, block in enumerate(model.model.layers):
        if config.is_moe_layer(i):
            block.mlp = EPMoE(config, g) if ep else TPMoE(config, g)
        else:
            block.mlp = TPMLP(config.hidden_size, config.intermediate_size, g, split_block(config))
