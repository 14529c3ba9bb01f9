#!/usr/bin/env bash
# One device call: every GPU check and measurement, stage by stage, each under its own time limit
# so a slow or failing stage cannot starve the others. Logs and JSON results go to $OUT.
# The end-to-end bench at its default settings (three pool sizes, a rate sweep, 64 requests, 4
# layers) is a call of its own: `python -m echo_compile.cli bench --out $OUT/e2e_h200.json`
# (issue 7: <= 10 minutes).
#   bash benchmarks/gpu_session.sh            (on the GPU machine, from the repository root)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/echo_out}
mkdir -p "$OUT"
log="$OUT/session.log"
stage() { # name seconds command...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s) $(date +%T)" | tee -a "$log"
  local t0=$SECONDS
  timeout "$secs" "$@" >>"$log" 2>&1
  echo "=== $name: exit $? in $((SECONDS - t0))s" | tee -a "$log"
}
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee -a "$log"
stage "cuda tests: lossless + compile gates" 110 python -m pytest -q -m cuda tests/test_lossless.py tests/test_compile_cuda.py
stage "step time eager vs compiled" 270 python -m benchmarks.bench_step --out "$OUT/step_h200.json"
stage "cuda tests: decode kernels" 60 python -m pytest -q -m cuda tests/test_decode_kernels_cuda.py
stage "cuda tests: cache ops" 50 python -m pytest -q -m cuda tests/test_cache_cuda.py
stage "decode kernels bench" 45 python -m benchmarks.bench_decode_kernels --out "$OUT/decode_kernels_h200.json"
stage "cache ops bench" 180 python -m benchmarks.bench_cache_ops --reps 10 --out "$OUT/cache_ops_h200.json"
grep -E "^===|passed|failed|error|tok/s" "$log" | tail -40
