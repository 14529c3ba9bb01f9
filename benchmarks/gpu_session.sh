#!/usr/bin/env bash
# One device call (<= 10 minutes): the GPU checks and measurements of this tree, stage by stage,
# each under its own time limit so a slow or failing stage cannot starve the others. Logs and JSON
# results go to $OUT.   bash benchmarks/gpu_session.sh   (on the GPU machine, at the repo root)
# Phase 1 runs concurrently (correctness only: no timing): the lossless workload of
# tests/test_lossless_cuda.py in both row formats (benchmarks/diag_repro.py: offload vs GPU-only,
# every step's logits torch.equal) and the new kernels' cuda tests. Phase 2 times, one at a time.
# Not here: the DeepGEMM / FlashInfer backends (their JIT takes minutes on a fresh machine: a call
# of its own, see docs/backends.md) and the end-to-end bench (`echo-compile bench`, its own call).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/echo_out}
mkdir -p "$OUT"
log="$OUT/session.log"
stage() { # name seconds command...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s) $(date +%T)" | tee -a "$log"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name: exit $? in $((SECONDS - t0))s" | tee -a "$log"
  tail -n 4 "$OUT/$name.log" | tee -a "$log"
}
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee -a "$log"
D=benchmarks.diag_repro
(stage lossless_bf16 200 python -m $D --fmt bf16 --modes offload,gpu --out "$OUT/l_bf16.pt" \
  && python -m $D --compare "$OUT/l_bf16.pt:0" "$OUT/l_bf16.pt:1" | tee -a "$log") &
(stage lossless_fp8 200 python -m $D --fmt fp8 --modes offload,gpu --out "$OUT/l_fp8.pt" \
  && python -m $D --compare "$OUT/l_fp8.pt:0" "$OUT/l_fp8.pt:1" | tee -a "$log") &
stage cuda_tests 190 python -m pytest -q -m cuda -rf -p no:cacheprovider tests/test_prefill_cuda.py \
  tests/test_cache_cuda.py tests/test_awq_repack.py tests/test_fp8_linear.py tests/test_prefetch.py \
  tests/test_awq_moe_bf16.py
wait
rm -f "$OUT"/*.pt
stage bench_prefill 110 python -m benchmarks.bench_prefill --budget-s 90 --out "$OUT/prefill_h200.json"
stage bench_cache_ops 60 python -m benchmarks.bench_cache_ops --reps 5 --out "$OUT/cache_ops_h200.json"
stage bench_awq 60 python -m benchmarks.bench_awq --batches 1,8,32,128 --budget-s 40 --out "$OUT/awq_h200.json"
stage bench_fp8 40 python -m benchmarks.bench_fp8 --batches 1,16,128 --out "$OUT/fp8_h200.json"
stage bench_prefetch 60 python -m benchmarks.bench_prefetch --caps 64 --ratios "" --out "$OUT/prefetch_h200.json"
grep -E "^===|identical|differ|passed|failed|PASS|FAIL" "$log" | tail -60
