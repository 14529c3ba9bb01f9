#!/usr/bin/env bash
# Deterministic mode's fill of every torch.empty (echo_compile/settings.py, FILL_UNINITIALIZED)
# off against on, end to end: the B = 64 bench step of each weight format, profiled from its own
# CUDA graphs, one process per (format, fill) so that no run is its process's second model.
#   bash benchmarks/bench_fill.sh OUTDIR FORMAT...      e.g. OUTDIR=$OUT fp8 bf16
#   ROUNDS=2 bash benchmarks/bench_fill.sh ...          round 2 runs on before off, and so on
# Writes OUTDIR/fill_<format>_<off|on>[_r<round>].{json,log} as each run finishes (no suffix in
# round 1).
set -u
export PYTHONUNBUFFERED=1
out=$1
shift
mkdir -p "$out"
for round in $(seq 1 "${ROUNDS:-1}"); do
  order="off on" && [ $((round % 2)) = 0 ] && order="on off"
  sfx="" && [ "$round" -gt 1 ] && sfx="_r$round"
  for wf in "$@"; do
    for fill in $order; do
      flag=False && [ "$fill" = on ] && flag=True
      name="fill_${wf}_$fill$sfx"
      python -c "import sys; from echo_compile import settings
settings.FILL_UNINITIALIZED = $flag
from echo_compile.cli import main
sys.exit(main(sys.argv[1:]))" bench --rates '' --breakdown-steps 8 --breakdown-graphs \
        --gpu-pools 200000 --eager-pools 200000 --systems offload --weights "$wf" \
        --out "$out/$name.json" > "$out/$name.log" 2>&1
      echo "$name: exit $? $(grep -m1 'median step' "$out/$name.log")"
    done
  done
done
