#!/usr/bin/env bash
# The GPU checks of one short device lease, in the order they matter:
#   1. benchmarks/compare.py on CUDA, one model per process (a failure or a timeout costs one model);
#   2. benchmarks/cuda_check.py (plans measured on the GPU, run and no-run, verified there).
# PEAK_GAP=1 first runs benchmarks/peak_gap.py $PEAK_GAP_ARGS (where measured and predicted peaks
# part; e.g. PEAK_GAP_ARGS="--compare gpt2,cnn --batch-scale 32" for compare.py's models);
# CUDA_CHECK=0 skips step 2.
# It stops starting work once DEADLINE_S seconds have passed. Results: RESULTS.md sections and
# plots in this tree, packed with the logs into one archive, $OUT/gpu_check.tgz (OUT defaults to /tmp).
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh          # on a machine with a CUDA GPU
#
# compare.py's lower bound needs OR-Tools; where the GPU's Python lacks it and cannot fetch it,
# bring wheels for that Python (here 3.12) and put them first on its path:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       -d .whl ortools==9.15.6755 protobuf==6.33.6 immutabledict==4.3.1 absl-py==2.5.1
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp}
LOGS=/tmp/gpu_check_logs
DEADLINE_S=${DEADLINE_S:-480}
MODELS=${MODELS:-gpt llama gpt2 cnn vit bert}
BATCH_SCALE=${BATCH_SCALE:-32}
rm -rf "$LOGS"; mkdir -p "$LOGS" "$OUT"
started=$SECONDS
left() { echo $((DEADLINE_S - (SECONDS - started))); }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/gpu.txt"
"$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$LOGS/gpu.txt"
if [ "${PEAK_GAP:-0}" = 1 ]; then
    timeout 150 "$PYTHON" benchmarks/peak_gap.py ${PEAK_GAP_ARGS:-} > "$LOGS/peak_gap.log" 2>&1
    echo "peak_gap: exit $? after $((SECONDS - started)) s" | tee -a "$LOGS/status.txt"
fi
for model in $MODELS; do
    budget=$(left)
    if [ "$budget" -lt 60 ]; then echo "skipped compare $model: $budget s left" | tee -a "$LOGS/skipped.txt"; continue; fi
    [ "$budget" -gt 120 ] && budget=120
    timeout "$budget" "$PYTHON" benchmarks/compare.py --device cuda --batch-scale "$BATCH_SCALE" --rounds 15 \
        --models "$model" > "$LOGS/compare_$model.log" 2>&1
    echo "compare $model: exit $? after $((SECONDS - started)) s" | tee -a "$LOGS/status.txt"
done
budget=$(left)
if [ "${CUDA_CHECK:-1}" = 0 ]; then
    echo "cuda_check not asked for"
elif [ "$budget" -ge 60 ]; then
    timeout "$budget" "$PYTHON" benchmarks/cuda_check.py > "$LOGS/cuda_check.log" 2>&1
    echo "cuda_check: exit $? after $((SECONDS - started)) s" | tee -a "$LOGS/status.txt"
else
    echo "skipped cuda_check: $budget s left" | tee -a "$LOGS/skipped.txt"
fi
tar czf "$OUT/gpu_check.tgz" benchmarks/RESULTS.md benchmarks/results/*_cuda.png -C /tmp gpu_check_logs
tail -n 3 "$LOGS"/compare_*.log "$LOGS/cuda_check.log" 2>/dev/null
grep -v "^\[W" "$LOGS/peak_gap.log" 2>/dev/null
cat "$LOGS/status.txt"
