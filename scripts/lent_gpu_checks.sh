#!/usr/bin/env bash
# The checks to run on a lent one-GPU machine, in one command (docs/gpu.md):
#   1. the GPU tests (`-m gpu`: SDPA vs Megatron's attention in bf16, the runtime's parity
#      with Megatron's schedule on CUDA, the profiler on CUDA; the plugin's 4-rank parity
#      cases need 4 GPUs and skip on fewer);
#   2. a computation-only profile of one Llama-8B-shaped layer with SDPA attention
#      (`dhelix profile --comp-only`), the input of the emulated GPU cluster;
#   3. scripts/bench_gpu.py at 4 Llama-8B-shaped layers (stock local spec, stock SDPA spec,
#      --dhelix sequential, --dhelix dp planned from that profile), then one traced step of
#      each row (kernels, GPU busy time, host synchronisation).
# Each step has its own time limit and writes its log under $OUT (the device tool brings it
# back), so a step that fails or runs long leaves the others' results.
#
#   bash scripts/lent_gpu_checks.sh            # on the GPU machine, repository root
#   QUICK=1 bash scripts/lent_gpu_checks.sh    # tiny model, CPU: the script's own smoke test
#   STEPS=bench PROFILE=configs/profiles/h100_llama8b_layer_sdpa_comp_only.json \
#       bash scripts/lent_gpu_checks.sh        # the benchmark alone, planned from a profile
#
# Needs megatron-core (a wheel under .whl/ or importable) and, for the cluster step, ip/tc
# (or the .deb files under .debs/): scripts/lent_host_tools.sh provides both.
set -u
OUT=${OUT:-/tmp/lent_gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
source scripts/lent_host_tools.sh || exit 1
export PYTHONUNBUFFERED=1
TESTS_S=${TESTS_S:-200} PROFILE_S=${PROFILE_S:-120} BENCH_S=${BENCH_S:-300} CLUSTER_S=${CLUSTER_S:-300}
REPS=${REPS:-8}

step() {  # step NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, print the exit code
    local name=$1 limit=$2; shift 2
    local started=$SECONDS
    timeout --kill-after 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "[lent_gpu_checks] $name: exit $rc after $((SECONDS - started)) s" | tee -a "$OUT/summary.txt"
    tail -n 30 "$OUT/$name.log"
}

$PY -m dhelix env 2>&1 | tee "$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$OUT/summary.txt"

if [ -n "${QUICK:-}" ]; then
    MODEL=$($PY -c "from dhelix.bench.systems import tiny_model; print(' '.join(tiny_model(num_layers=2, global_batch_size=4)))")
    BENCH_MODEL=(--quick)
else
    MODEL=$($PY -c "from scripts.bench_gpu import DEFAULT_MODEL; print(' '.join(DEFAULT_MODEL))")
    BENCH_MODEL=()
fi
RUN_ARGS=$($PY -c "from dhelix.bench.systems import RUN_ARGS; print(' '.join(RUN_ARGS))")

STEPS=${STEPS:-tests profile bench}
if [ -z "${QUICK:-}" ] && [[ " $STEPS " == *" tests "* ]]; then
    step gpu_tests "$TESTS_S" $PY -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS:-\
        tests/test_sdpa_attention.py tests/test_runtime_cuda.py \
        tests/profiler/test_profile_cuda.py tests/test_megatron_lm_parity.py}
fi
PROFILE=${PROFILE:-$OUT/llama8b_layer_sdpa_comp_only_profile.json}
# shellcheck disable=SC2086 (the argument strings split into words on purpose)
[[ " $STEPS " == *" profile "* ]] && step profile_sdpa "$PROFILE_S" $PY -m dhelix profile --comp-only --no-progress --overwrite \
    --no-heatmap $RUN_ARGS $MODEL --dhelix-attention sdpa -o "$PROFILE"
PLANNED=()
[ -s "$PROFILE" ] && PLANNED=(--dhelix-profile "$PROFILE")
# the traces stay on the machine (the table of kernels is in the log) but two
[[ " $STEPS " == *" bench "* ]] && step bench_gpu "$BENCH_S" $PY scripts/bench_gpu.py "${BENCH_MODEL[@]}" --reps "$REPS" \
    --warmup 2 "${PLANNED[@]}" --trace /tmp/lent_gpu_traces --json "$OUT/bench_gpu.json"
for row in stock_sdpa dhelix_sequential; do
    trace=/tmp/lent_gpu_traces/$row.trace.json.gz
    [ -f "$trace" ] && [ "$(stat -c %s "$trace")" -lt 15000000 ] && cp "$trace" "$OUT/"
done
if [[ " $STEPS " == *" cluster "* ]]; then
    # --out first: CLUSTER_ARGS may end with `-- <Megatron model arguments>`
    # shellcheck disable=SC2086 (CLUSTER_ARGS splits into words on purpose)
    CUDA_VISIBLE_DEVICES= step cluster_bench "$CLUSTER_S" $PY scripts/bench_systems.py \
        --out "$OUT/cluster" ${CLUSTER_ARGS:---configs a --reps 4}
fi
cat "$OUT/summary.txt"
