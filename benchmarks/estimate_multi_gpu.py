"""A simulated 8-GPU decode throughput for DeepSeek-V3.2 (dp = tp = N): an ESTIMATE built from
measured single-GPU step times plus the communication volume, not a measurement.

    python -m benchmarks.estimate_multi_gpu --out benchmarks/results/estimate_8gpu.json

Inputs: ``--step`` (benchmarks/bench_step.py's results: compiled step times of the 4-layer,
16-expert bench model on one H200 at a given context, offload and GPU-only, and an eager
profile's time by category). The model of one rank's decode step at B requests per rank:
- attention side (MLA, indexer, cache management, norms, projections: every category but
  ``moe`` and ``dense mlp``, less the LM head), per layer, from the measured step at that B,
  times 61 layers, plus the head once; the eager profile's split scaled to the compiled step;
- feed-forward (58 MoE layers, 3 dense), memory bound: bytes of the rank's weight shard that the
  step touches (each of the 256 experts is touched if any of the N x B tokens picks it, 8 picks
  per token, taken as uniform) at the HBM bandwidth the measured MoE achieved; an FP8 checkpoint
  as served (``--fp8-weights``, LLM's option: by default kept FP8, one byte a weight and an fp32
  scale per 128x128 block; ``bf16``: dequantised at load);
- communication per feed-forward layer: all-gather of the N x B rows (bf16) and reduce-scatter of
  the fp32 partial sums, ring volume (N-1)/N of each, at ``--link-gbs`` plus ``--latency-us`` per
  collective (assumptions, flags);
- no overlap of communication with compute (conservative).
Throughput = N x B / step time. Also the effective batch each policy can hold per rank at a
context (GPU-only: KV + indexer rows in the GPU memory the plan leaves; offload: B x topk <=
the GPU pool, host memory for the KV), from runtime.distributed.plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from model.fp8_weights import BLOCK, FP8_WEIGHTS, resolve_fp8_weights

LAYERS, MOE_LAYERS, DENSE_LAYERS = 61, 58, 3
EXPERTS, PICKS, HIDDEN, MOE_INTER, DENSE_INTER = 256, 8, 7168, 2048, 18432
ATTN_SIDE = ("attention", "indexer", "cache management", "other")


def expert_bytes(quant: str, fp8_weights: str = "fp8") -> float:
    """Bytes per weight element as resident: bf16 2; FP8 kept (``fp8_weights`` as
    ``resolve_fp8_weights`` resolves it) 1 + an fp32 scale per 128x128 block, dequantised 2;
    AWQ 4 bits + fp16 scale/zero per 128."""
    fp8 = 1.0 + 4.0 / BLOCK**2 if fp8_weights == "fp8" else 2.0
    return {"bf16": 2.0, "fp8": fp8, "awq": 0.5 + 2.5 / 128}[quant]


def touched(tokens: int) -> float:
    """Expected experts picked by at least one of ``tokens`` tokens (uniform routing)."""
    return EXPERTS * (1.0 - (1.0 - PICKS / EXPERTS) ** tokens)


def calibrated_bandwidth(row: dict, model: dict) -> float:
    """Bytes/s the measured MoE achieved: every expert of the bench model runs on every token
    (model/moe.py's Experts), so each MoE layer reads all its weights once per step."""
    n_moe = model["num_hidden_layers"] - model["first_k_dense_replace"]
    per_expert = 3 * model["moe_intermediate_size"] * model["hidden_size"] * 2
    experts = model["n_routed_experts"] + model["n_shared_experts"]
    return n_moe * experts * per_expert / (row["breakdown"]["ms_per_step"]["moe"] * 1e-3)


def estimate_row(row: dict, model: dict, n: int, per_elem: float, a: argparse.Namespace) -> dict:
    """One measured row's estimate on ``n`` ranks, the feed-forward at ``per_elem`` bytes a
    weight (``expert_bytes``)."""
    b = row["batch"]
    bd = row["breakdown"]["ms_per_step"]
    bw = calibrated_bandwidth(row, model)
    # "other" holds the LM head (and embedding), once per step, not per layer: take the head's
    # weight read out of it at the calibrated bandwidth
    head_ms = model["vocab_size"] * model["hidden_size"] * 2 / bw * 1e3
    per_layer = (sum(bd[k] for k in ATTN_SIDE) - head_ms) / model["num_hidden_layers"]
    t_tokens = n * b
    moe_bytes = (touched(t_tokens) + 1) * 3 * MOE_INTER * HIDDEN * per_elem / n  # + shared
    dense_bytes = 3 * DENSE_INTER * HIDDEN * per_elem / n
    ffn_ms = (MOE_LAYERS * moe_bytes + DENSE_LAYERS * dense_bytes) / bw * 1e3
    gather = t_tokens * HIDDEN * 2 * (n - 1) / n
    scatter = t_tokens * HIDDEN * 4 * (n - 1) / n
    per_layer_comm = (gather + scatter) / (a.link_gbs * 1e9) * 1e3 + 2 * a.latency_us * 1e-3
    comm_ms = (MOE_LAYERS + DENSE_LAYERS) * per_layer_comm if n > 1 else 0.0
    out = {"batch_per_rank": b, "tokens_per_step": t_tokens, "calibrated_hbm_tbs": bw / 1e12}
    for mode, ms in row["step_ms"].items():
        if mode.endswith("eager"):
            continue
        # the profile is eager kernel time: scale it to this compiled step's time
        attn_ms = (per_layer * LAYERS + head_ms) * ms / sum(bd.values())
        step = attn_ms + ffn_ms + comm_ms
        out[mode] = {
            "attention_side_ms": attn_ms,
            "ffn_ms": ffn_ms,
            "comm_ms": comm_ms,
            "step_ms": step,
            "tokens_per_s": t_tokens / step * 1e3,
        }
    return out


def effective_batch(quant: str, n: int, ctx: int, a: argparse.Namespace) -> dict:
    """Requests per rank each policy can hold at ``ctx`` tokens (plan-based)."""
    from custom_ops.kv_format import INDEX_ROW_BYTES, ROW_BYTES
    from runtime.distributed.plan import GIB, memory_plan, plan_engine, v32_config

    cfg = v32_config(quant)
    # a host pool of one context: the plan's prefill buffer is then sized for ``ctx`` tokens
    eng = plan_engine(n, n, a.gpu_tokens, -(-ctx // 64) * 64, 64, a.kv_format, True, ctx)
    plan = memory_plan(cfg, eng, a.gpu_mem_gib, None, a.reserve_gib, fp8_weights=a.fp8_weights)
    fixed = plan.gpu_gib["weights"] + plan.gpu_gib["prefill buffer"] + a.reserve_gib
    per_req_gpu = ctx * LAYERS * (ROW_BYTES[a.kv_format] + INDEX_ROW_BYTES) / GIB
    per_req_off = ctx * LAYERS * INDEX_ROW_BYTES / GIB  # the indexer cache stays on the GPU
    free = a.gpu_mem_gib - fixed
    pool = plan.gpu_gib["gpu kv pools"] + plan.gpu_gib["metadata"]
    host = a.host_mem_gib / n / (ctx * LAYERS * ROW_BYTES[a.kv_format] / GIB)
    return {
        "ctx": ctx,
        "gpu_free_for_kv_gib": free,
        "gpu_only": max(0, int(free // per_req_gpu)),
        "offload": max(
            0,
            int(min(a.gpu_tokens // 2048, (free - pool) // per_req_off, host)),
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--step", default="benchmarks/results/step_h200.json")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--quant", choices=("awq", "bf16", "fp8"), default="awq")
    ap.add_argument("--fp8-weights", choices=FP8_WEIGHTS, default="auto",
                    help="an FP8 checkpoint's weights as LLM's option serves them")  # fmt: skip
    ap.add_argument("--link-gbs", type=float, default=300.0, help="achieved NVLink GB/s per GPU")
    ap.add_argument("--latency-us", type=float, default=15.0, help="per collective")
    ap.add_argument("--gpu-mem-gib", type=float, default=139.8)
    ap.add_argument("--host-mem-gib", type=float, default=1800.0, help="per node")
    ap.add_argument("--gpu-tokens", type=int, default=200_000)
    ap.add_argument("--kv-format", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument("--reserve-gib", type=float, default=8.0)
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.gpus < 1 or a.link_gbs <= 0:
        print("estimate_multi_gpu: --gpus and --link-gbs must be positive", file=sys.stderr)
        return 2
    from runtime.distributed.plan import v32_config

    try:
        served = resolve_fp8_weights(a.fp8_weights, v32_config(a.quant), f"--quant {a.quant}")
    except ValueError as e:
        print(f"estimate_multi_gpu: {e}", file=sys.stderr)
        return 2
    try:
        meas = json.loads(Path(a.step).read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"estimate_multi_gpu: cannot read --step {a.step}: {e}", file=sys.stderr)
        return 2
    res = {
        "kind": "ESTIMATE (not measured): measured 1-GPU step times + modelled FFN and comm",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "source": a.step,
        "source_environment": meas.get("environment"),
        "measured_ctx": meas["ctx"],
        "assumptions": {k: v for k, v in vars(a).items() if k != "out"},
        "rows": {},
        "effective_batch": [],
    }
    per_elem = expert_bytes(a.quant, served)
    for n in sorted({1, a.gpus}):
        res["rows"][str(n)] = [estimate_row(r, meas["model"], n, per_elem, a) for r in meas["rows"]]
    for ctx in (int(c) for c in a.contexts.split(",")):
        res["effective_batch"].append(effective_batch(a.quant, a.gpus, ctx, a))
    for n, rows in res["rows"].items():
        for r in rows:
            modes = "  ".join(
                f"{m}: {r[m]['step_ms']:.2f} ms {r[m]['tokens_per_s']:.0f} tok/s"
                for m in ("offload", "gpu_only")
                if m in r
            )
            print(f"{n} GPU(s), B={r['batch_per_rank']}/rank: {modes}")
    for e in res["effective_batch"]:
        print(f"ctx {e['ctx']}: effective batch per rank gpu-only {e['gpu_only']}, "
              f"offload {e['offload']}")  # fmt: skip
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
