#!/usr/bin/env bash
# The emulated GPU cluster's compute-rich configuration in one command (docs/benchmark.md,
# "Emulated GPU cluster"): configuration (a), TP=2 across 2 emulated nodes, one Llama-8B
# layer (seq 2048, micro-batch 2, global batch 16), every compute kernel at the H100
# profile's time x S, a 150 Gbit/s GPU link emulated at 150/S Gbit/s; DHelix planned from
# a profile taken on the same emulated cluster first; Megatron, the comm-free bound, the
# sequential operator path, Domino-, Wavelet-style and DHelix, repetitions interleaved.
#
#   bash scripts/bench_emulated_gpu.sh                   # root; S=100 (the 2-core machine)
#   S=50 REPS=3 OUT=/tmp/emu bash scripts/bench_emulated_gpu.sh
#   SETUP_ONLY=1 bash scripts/bench_emulated_gpu.sh    # ip/tc and megatron-core found? exit
#   bash scripts/bench_emulated_gpu.sh -- <Megatron model arguments>   # replace the model
#
# On a machine without iproute2 (the lent 16-core machine: no GPU used) it unpacks the .deb
# files under .debs/ (`apt-get download iproute2 <its libraries>`, docs/benchmark.md) into
# /tmp/iproute2 and puts them on PATH / LD_LIBRARY_PATH; megatron-core comes from a wheel
# under .whl/ (installed into /tmp/site) when it is not importable. CUDA_VISIBLE_DEVICES is
# emptied: the ranks are CPU processes. Writes $OUT/results.{md,json,png} and $OUT/raw/.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench_emulated_gpu}
S=${S:-100}
LINK=${LINK:-150gbit}
REPS=${REPS:-3}
WARMUP=${WARMUP:-1}
PROFILE=${PROFILE:-configs/profiles/h100_llama8b_layer_comp_only.json}
SYSTEMS=${SYSTEMS:-megatron,commfree,ops_sequential,domino,wavelet,dhelix}
if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi

NEED_IPROUTE=1 source scripts/lent_host_tools.sh || exit 2
export CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1
echo "[bench_emulated_gpu] $(nproc) cores, S=$S, link $LINK, reps $REPS, out $OUT;" \
    "ip $(command -v ip), tc $(command -v tc)"
if [ -n "${SETUP_ONLY:-}" ]; then $PY -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__)"; exit $?; fi
exec $PY scripts/bench_systems.py --configs a --systems "$SYSTEMS" --bandwidth "$LINK" \
    --gpu-emulation "$PROFILE" --time-scale "$S" --reps "$REPS" --warmup "$WARMUP" \
    --timeout 3000 --out "$OUT" "$@"
