#!/usr/bin/env bash
# The GPU checks of one short device lease, one process per step, in the order STEPS gives:
#   a model name: benchmarks/compare.py on CUDA for that model (a failure or a timeout costs one model);
#   cuda_check: benchmarks/cuda_check.py (plans measured on the GPU, run and no-run, verified there);
#   peak_gap: benchmarks/peak_gap.py $PEAK_GAP_ARGS, at most 180 s (where measured and predicted peaks part; e.g.
#             PEAK_GAP_ARGS="--device cuda --compare gpt2,cnn --batch-scale 32" for compare.py's models).
# It stops starting steps once DEADLINE_S seconds have passed (a compare step gets at most 120 s; its lower
# bound's program 5 s per budget: GPT's took most of 120 s at compare's default).
# Results: RESULTS.md sections and plots in this tree, packed with the logs into one archive,
# $OUT/gpu_check.tgz (OUT defaults to /tmp).
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh          # on a machine with a CUDA GPU
#   STEPS="gpt cuda_check" OUT=/tmp/out bash benchmarks/gpu_check.sh
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
# In a 15-minute lease, 520 s (run with the device's timeout at 590 s) left 343 s for a second,
# warm call (2026-11-27: the machine's start took about 35 s).
DEADLINE_S=${DEADLINE_S:-520}
# The order of the fifth lease's plan: first where BERT's and ViT's predicted peaks part from the
# measured ones on CUDA (BERT's graph read +37% in the third and fourth leases; peak_gap got no time
# in either), then Llama, whose step-read per-tensor figure stayed high in the fourth (compare.py now
# logs the fit's rows), then ViT (no time in the fourth), then the rest (GPT's compare needs more
# than 120 s). 9 rounds: at 15, GPT-2's and Llama's runs took about 150 s (2026-11-27 19:14).
STEPS=${STEPS:-peak_gap llama vit gpt2 cnn bert cuda_check gpt}
PEAK_GAP_ARGS=${PEAK_GAP_ARGS:---device cuda --compare bert,vit --batch-scale 32}
BATCH_SCALE=${BATCH_SCALE:-32}
rm -rf "$LOGS"; mkdir -p "$LOGS" "$OUT"
started=$SECONDS
left() { echo $((DEADLINE_S - (SECONDS - started))); }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/gpu.txt"
"$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$LOGS/gpu.txt"
for step in $STEPS; do
    budget=$(left)
    if [ "$budget" -lt 60 ]; then echo "skipped $step: $budget s left" | tee -a "$LOGS/skipped.txt"; continue; fi
    case $step in
        cuda_check) timeout "$budget" "$PYTHON" benchmarks/cuda_check.py > "$LOGS/cuda_check.log" 2>&1 ;;
        peak_gap) [ "$budget" -gt 180 ] && budget=180
                  timeout "$budget" "$PYTHON" benchmarks/peak_gap.py $PEAK_GAP_ARGS > "$LOGS/peak_gap.log" 2>&1 ;;
        *) [ "$budget" -gt 120 ] && budget=120
           timeout "$budget" "$PYTHON" benchmarks/compare.py --device cuda --batch-scale "$BATCH_SCALE" --rounds 9 \
               --bound-time-limit 5 --models "$step" > "$LOGS/compare_$step.log" 2>&1 ;;
    esac
    echo "$step: exit $? after $((SECONDS - started)) s" | tee -a "$LOGS/status.txt"
done
tar czf "$OUT/gpu_check.tgz" benchmarks/RESULTS.md benchmarks/results/*_cuda.png benchmarks/results/*_cuda.json -C /tmp gpu_check_logs
tail -n 3 "$LOGS"/compare_*.log "$LOGS/cuda_check.log" 2>/dev/null
grep -v "^\[W" "$LOGS/peak_gap.log" 2>/dev/null
cat "$LOGS/status.txt"
