#!/usr/bin/env bash
# Deterministic mode's fill of every torch.empty (echo_compile/settings.py, FILL_UNINITIALIZED)
# off against on, end to end: the B = 64 bench step of each weight format, profiled from its own
# CUDA graphs, one process per (format, fill) so that no run is its process's second model.
#   bash benchmarks/bench_fill.sh OUTDIR FORMAT...      e.g. OUTDIR=$OUT fp8 bf16
# Writes OUTDIR/fill_<format>_<off|on>.{json,log} as each run finishes.
set -u
export PYTHONUNBUFFERED=1
out=$1
shift
mkdir -p "$out"
for wf in "$@"; do
  for fill in off on; do
    flag=False && [ "$fill" = on ] && flag=True
    python -c "import sys; from echo_compile import settings
settings.FILL_UNINITIALIZED = $flag
from echo_compile.cli import main
sys.exit(main(sys.argv[1:]))" bench --rates '' --breakdown-steps 8 --breakdown-graphs \
      --gpu-pools 200000 --eager-pools 200000 --systems offload --weights "$wf" \
      --out "$out/fill_${wf}_$fill.json" > "$out/fill_${wf}_$fill.log" 2>&1
    echo "$wf fill $fill: exit $? $(grep -m1 'median step' "$out/fill_${wf}_$fill.log")"
  done
done
