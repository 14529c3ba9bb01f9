#!/usr/bin/env bash
# One device call (<= 10 minutes) on the H200, at the repo root:
#   bash benchmarks/gpu_session.sh verify [NAME ...]  # every cuda-marked test, in concurrent groups (or
#                                           # the NAMEd ones: lossless_bf16 lossless_fp8 lossless engines
#                                           # compile prefill_prefetch kernels release backends prefill_dg auto_step)
#   bash benchmarks/gpu_session.sh time [NAME ...]   # the kernel benchmarks (or the NAMEd ones: backends
#                                           # fixup overlap prefill prefill_gather prefix_cache cache_ops row_stride fused_proj release awq awq_pairs awq_parts sampling fp8 calibrate
#                                           # prefetch staged_recall step)
#   bash benchmarks/gpu_session.sh tests FILE ...     # some cuda tests, one process per FILE group
#   bash benchmarks/gpu_session.sh e2e [NAME ...]     # end-to-end benches (full decode backends quant async prefetch;
#                                           # env FULL_SYSTEMS, PREFETCH_POINTS, WEIGHTS_FORMATS: some runs)
#   bash benchmarks/gpu_session.sh multi [NAME ...]   # issue 21 on a multi-GPU kind: tests (the NCCL
#                                           # tests), dpN (the bench on N GPUs under torchrun), one per call
# Each stage runs under its own time limit so a slow or failing stage cannot starve the others.
# The device returns at most 8 files from $OUT, so stage logs and JSON results are written under
# $OUT/work and packed into $OUT/results.tgz after every stage (a call cut short still returns
# what finished); $OUT/session.log holds each stage's exit status and last lines.
# With .whl carried (docs/backends.md) the DeepGEMM / FlashInfer wheels are installed first and the
# backend stages run too; their JIT caches go to $OUT/jit.tgz, and a later call that carries them
# back as .jit (`mkdir -p .jit && tar xzf jit.tgz -C .jit`) skips the minutes of compiling.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/echo_out}
W="$OUT/work"
mkdir -p "$W"
log="$OUT/session.log"
pack() { local t="$OUT/.results.$BASHPID"; tar czf "$t" -C "$W" . && mv "$t" "$OUT/results.tgz"; }
stage() { # name seconds command...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s) $(date +%T)" | tee -a "$log"
  local t0=$SECONDS
  echo "+ $*" > "$W/$name.log"  # the command, so a log says what ran
  timeout "$secs" "$@" >> "$W/$name.log" 2>&1
  echo "=== $name: exit $? in $((SECONDS - t0))s" | tee -a "$log"
  tail -n 6 "$W/$name.log" | tee -a "$log"
  pack
}
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee -a "$log"
BACKENDS=0
if [ -d /tmp/site/deep_gemm ]; then  # installed by an earlier invocation of this call
  export PYTHONPATH=/tmp/site && BACKENDS=1
  mkdir -p .jit/dg .jit/fi
  export DG_JIT_CACHE_DIR=$PWD/.jit/dg FLASHINFER_WORKSPACE_BASE=$PWD/.jit/fi
elif ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && BACKENDS=1
  # FlashInfer's JIT is a ninja build: sources fresh from pip are newer than the carried objects,
  # so without this it rebuilds (~5 minutes) although the objects match
  find /tmp/site -exec touch -h -d '2000-01-01' {} +
  # JIT caches under one folder so they can be packed and carried to the next call
  mkdir -p .jit/dg .jit/fi
  export DG_JIT_CACHE_DIR=$PWD/.jit/dg FLASHINFER_WORKSPACE_BASE=$PWD/.jit/fi
fi
echo "backends installed: $BACKENDS" | tee -a "$log"
packjit() { [ "$BACKENDS" = 1 ] && tar czf "$OUT/jit.tgz" -C .jit . ; }
T="python -m pytest -q -m cuda -rfEs -p no:cacheprovider"

mode=${1:-verify}
[ $# -gt 0 ] && shift
names=" $* "  # the stages (verify, time, e2e) to run; none named: all of them
on() { [ "$names" = "  " ] || [[ "$names" == *" $1 "* ]]; }
case "$mode" in
verify)
  # All groups at once ran past 10 minutes on the H200 of gpu_session44 (kernels and
  # prefill_prefetch were cut at 420 s beside the others): name some groups per call then, e.g.
  # `verify kernels prefill_prefetch` and `verify lossless_bf16 lossless_fp8 lossless engines compile`.
  # the lossless group in three processes: in one it ran past 420 s beside the other groups
  long=tests/test_lossless_cuda.py::test_compiled_offload_equals_gpu_only_long_prompts
  on lossless_bf16 && (stage cuda_lossless_bf16 420 $T "$long[bf16]") &
  on lossless_fp8 && (stage cuda_lossless_fp8 420 $T "$long[fp8]") &
  # the compiled engines in processes of their own: with the lossless tests in one process they
  # ran past 420 s on a fresh machine (three tests of theirs alone took 310 s, gpu_session22)
  on lossless && (stage cuda_lossless 420 $T tests/test_lossless_cuda.py -k "not long_prompts" \
     tests/test_lossless.py tests/test_lossless_short.py) &
  on engines && (stage cuda_engines 420 $T tests/test_engines_cuda.py) &
  on compile && (stage cuda_compile 420 $T tests/test_compile_cuda.py tests/test_dynamic_decode.py) &
  on prefill_prefetch && (stage cuda_prefill_prefetch 420 $T tests/test_prefill_cuda.py tests/test_prefill_gather.py tests/test_prefix_cache.py tests/test_prefetch.py \
     tests/test_prefetch_engine.py tests/test_sampling_controls_cuda.py tests/test_prompt_kv.py \
     tests/test_prefill_sharing.py tests/test_prompt_logprobs.py tests/test_locality.py \
     tests/test_bench_weights.py) &
  on kernels && (stage cuda_kernels 420 $T tests/test_cache_cuda.py tests/test_awq_dispatch.py \
     tests/test_fp8_linear.py tests/test_awq_moe_bf16.py tests/test_awq_cuda.py tests/test_awq_pairs.py \
     tests/test_decode_kernels_cuda.py tests/test_attended_set.py tests/test_model.py \
     tests/test_sampler.py tests/test_cuda_timer.py tests/test_distributed_cuda.py \
     tests/test_distributed_ep.py tests/test_ties_fixup.py tests/test_cache_ops.py \
     tests/test_decode_kernels.py) &
  # a finish's release in every layer (one launch) and no JIT compile while serving after warm-up
  on release && (stage cuda_release 300 $T tests/test_release_layers.py tests/test_warm_kernels_cuda.py) &
  if [ "$BACKENDS" = 1 ]; then
    on backends && (stage cuda_backends 480 $T tests/test_backends_cuda.py tests/test_fp8_deep_gemm.py; packjit) &
    # DeepGEMM's prefill scores (fp8_mqa_logits): vs the reference, exact sets, a compiled engine
    on prefill_dg && (stage cuda_prefill_dg 300 $T tests/test_prefill_deep_gemm_cuda.py) &
    # the compiled decode step with kernel_backend=auto (B = 64), errors reported where they occur
    on auto_step && (stage auto_step 480 env CUDA_LAUNCH_BLOCKING=1 python -m benchmarks.bench_backends --no-ops \
       --step-batches "${STEP_BATCHES-64}" --step-backends auto --out "$W/auto_step.json") &
  fi
  wait
  ;;
time)
  if [ "$BACKENDS" = 1 ] && on backends; then
    stage bench_backends 165 python -m benchmarks.bench_backends --step-batches "${STEP_BATCHES-64}" \
      --out "$W/backends_h200.json"
    packjit
  fi
  # without FlashInfer it times the fix-up alone
  on fixup && stage bench_topk_fixup 90 python -m benchmarks.bench_topk_fixup --budget-s 70 \
    --out "$W/topk_fixup_h200.json"
  on overlap && stage bench_prefill_overlap 60 python -m benchmarks.bench_prefill_overlap \
    --out "$W/prefill_overlap_h200.json"
  on prefill && stage bench_prefill 150 python -m benchmarks.bench_prefill --budget-s 125 --out "$W/prefill_h200.json"
  on prefill && packjit  # DeepGEMM's fp8_mqa_logits kernels, when the wheels are carried
  on prefill_gather && stage bench_prefill_gather 120 python -m benchmarks.bench_prefill_gather \
    --out "$W/prefill_gather_h200.json"
  on prefix_cache && stage bench_prefix_cache 300 python -m benchmarks.bench_prefix_cache \
    --out "$W/prefix_cache_h200.json"
  on cache_ops && stage bench_cache_ops 280 python -m benchmarks.bench_cache_ops --reps 5 --out "$W/cache_ops_h200.json"
  on row_stride && stage bench_row_stride 120 python -m benchmarks.bench_row_stride --out "$W/row_stride_h200.json"
  on fused_proj && stage bench_fused_proj 150 python -m benchmarks.bench_fused_proj --out "$W/fused_proj_h200.json"
  on release && stage bench_release 120 python -m benchmarks.bench_release --out "$W/release_h200.json"
  # (150 s: on a fresh machine the kernels' compiles ran it past 60, gpu_session25)
  on awq && stage bench_awq 150 python -m benchmarks.bench_awq --batches 1,8,32,128 --budget-s 110 --out "$W/awq_h200.json"
  on sampling && stage bench_sampling_backends 240 python -m benchmarks.bench_sampling_backends \
    --out "$W/sampling_backends_h200.json"
  # AWQ_PAIRS_ARGS: other sections / sizes (e.g. --no-sweeps --batches ...)
  on awq_pairs && stage bench_awq_pairs 330 python -m benchmarks.bench_awq_pairs --budget-s 250 \
    ${AWQ_PAIRS_ARGS-} --out "$W/awq_pairs_h200.json"
  on awq_parts && stage bench_awq_parts 150 python -m benchmarks.bench_awq_parts \
    --moe-batches 1,2,4,8,16 --sweep-batches 1,2 --batches '' --ab-rounds 3 --budget-s 120 \
    --out "$W/awq_parts_h200.json"
  # FP8_ARGS: other sizes (e.g. --batches 1,2,4,8,16,128 --experts 0); FP8_LIMIT: the stage's limit
  on fp8 && stage bench_fp8 "${FP8_LIMIT-300}" python -m benchmarks.bench_fp8 --batches 1,16,128 --moe-batches 1,8,64 \
    --budget-s 250 ${FP8_ARGS-} --out "$W/fp8_h200.json"
  on calibrate && stage calibrate_locality 100 python -m benchmarks.calibrate_locality \
    --knobs "${KNOBS-0.8,0.93,0.97}" --budget-s 70 --out "$W/calibrate_locality_h200.json"
  on prefetch && stage bench_prefetch 240 python -m benchmarks.bench_prefetch --caps 64 \
    --ratios "${PF_RATIOS-0.002,0.004,0.006}" --margins "${PF_MARGINS-1,2,3,4}" --variants "${PF_VARIANTS-early}" \
    --pf-rows 8 --out "$W/prefetch_h200.json"
  on staged_recall && stage bench_staged_recall 150 python -m benchmarks.bench_staged_recall \
    --out "$W/staged_recall_h200.json"
  # the decode step's cache-management share at B = 1 / 16 / 64 (compiled offload vs GPU-only),
  # one batch size per stage: the three did not fit one 300 s stage (2026-12-01 22:13)
  for b in ${STEP_BATCH_LIST-1 16 64}; do
    on step && stage "bench_step_b$b" 240 python -m benchmarks.bench_step --batches "$b" \
      --out "$W/step_b${b}_h200.json"
  done
  ;;
e2e)  # the end-to-end bench (echo-compile bench), one run per stage, in this order; all of them
  # take ~15 minutes, more than a call: name the ones to run
  B="python -m echo_compile.cli bench --rates '' --breakdown-steps 0"
  at32k="--min-ctx 32000 --max-ctx 32000 --gpu-pools 200000"
  # full: prefill included; each system alone (the prefill graphs' warm-up is ~150 s a system);
  # FULL_SYSTEMS / PREFETCH_POINTS pick some of the runs
  for sys in ${FULL_SYSTEMS-offload gpu-only}; do
    on full && stage "e2e_full_32k_$sys" 270 bash -c \
      "$B --mode full $at32k --systems $sys --out '$W/e2e_full_32k_${sys}_h200.json'"
  done
  on decode && stage e2e_decode_32k 120 bash -c \
    "$B $at32k --systems offload,gpu-only --out '$W/e2e_decode_32k_h200.json'"
  for kb in triton auto; do
    on backends && [ "$BACKENDS" = 1 ] && stage "e2e_$kb" 90 bash -c \
      "$B --gpu-pools 200000 --systems offload --kernel-backend $kb --out '$W/e2e_backend_${kb}_h200.json'"
  done
  # quant: the bench model's weights as bf16, AWQ and FP8 checkpoints serve them (--weights), one
  # model per stage; the pool of the backends runs
  for wf in ${WEIGHTS_FORMATS-bf16 awq fp8}; do  # bf16 is the backends runs' auto command
    on quant && stage "e2e_weights_$wf" 100 bash -c \
      "$B --gpu-pools 200000 --systems offload --weights $wf --out '$W/e2e_weights_${wf}_h200.json'"
  done
  # async: the synchronous loop beside asynchronous scheduling (docs/design.md, "Scheduling"),
  # in one process: each weights format off, then on, at the pool of the backends runs
  on async && stage e2e_async 400 bash -c "$B --gpu-pools 200000 --systems offload \
    --weights ${ASYNC_WEIGHTS-bf16,fp8} --async-scheduling off,on --out '$W/e2e_async_h200.json'"
  # pool rows per request of ~1.5x, ~4x and ~10x top-k (2048): 200000/64, 262144/32, 327680/16;
  # triton pinned: prefetch runs the indexer in Triton, so off vs on compares prefetch alone;
  # PF_ARGS: other staging limits (e.g. --prefetch-cap 2048 --prefetch-ratio 0.016), PF_TAG: a
  # suffix of those runs' stage and file names (so they do not overwrite the default limits');
  # PF_LIMIT: each run's time limit (a breakdown per mode, PF_ARGS="--breakdown-steps 8
  # --breakdown-graphs", adds ~30 s a mode)
  for rp in ${PREFETCH_POINTS-64:200000 32:262144 16:327680}; do
    on prefetch && stage "e2e_prefetch_${rp%%:*}${PF_TAG-}" "${PF_LIMIT-170}" bash -c "$B --systems offload \
      --kernel-backend triton --prefetch ${PF_MODES-off,request,global} ${PF_ARGS-} --requests ${rp%%:*} \
      --gpu-pools ${rp##*:} --out '$W/e2e_prefetch_${rp%%:*}req${PF_TAG-}_h200.json'"
  done
  ;;
multi)  # issue 21 (docs/multi_gpu.md): the NCCL tests, then the end-to-end bench with DP attention
  # and TP MoE on N GPUs (dpN: N = 1 is the one-GPU baseline of the scaling), offload and GPU-only,
  # the pools of the paper's three GPUs per rank (POOLS); each dpN stage alone takes most of a call.
  # NVLink multicast stays off (the device documentation, KINDS.md), in every process torchrun starts.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
  echo "GPUs: $ngpu" | tee -a "$log"
  for name in "${@:-tests}"; do
    case "$name" in
    tests) stage multi_nccl_tests 500 $T tests/test_distributed_cuda.py ;;
    dp*)
      n=${name#dp}
      if [ "$n" -gt "$ngpu" ]; then echo "skip $name: $ngpu GPUs" | tee -a "$log"; continue; fi
      stage "multi_e2e_dp$n" 540 torchrun --nproc-per-node "$n" -m echo_compile.cli bench \
        --dp "$n" --tp "$n" --rates '' --breakdown-steps 0 --gpu-pools "${POOLS-325000,200000,110000}" \
        --systems offload,gpu-only ${MULTI_ARGS-} --out "$W/multi_e2e_dp${n}_h200.json" ;;
    *) echo "unknown multi stage $name" | tee -a "$log" ;;
    esac
  done
  ;;
tests)  # groups separated by ',': tests a.py b.py , c.py  -> two concurrent processes
  i=0; group=()
  run_group() { i=$((i + 1)); (stage "tests_$i" "${TESTS_LIMIT-400}" $T "${group[@]}"; packjit) & group=(); }
  for a in "$@"; do
    if [ "$a" = "," ]; then run_group; else group+=("$a"); fi
  done
  [ ${#group[@]} -gt 0 ] && run_group
  wait
  ;;
esac
grep -E "^===|passed|failed|PASS|FAIL|Error" "$log" | tail -60
