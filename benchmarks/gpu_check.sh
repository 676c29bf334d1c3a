#!/usr/bin/env bash
# The GPU checks of one short device lease, one process per step, in the order STEPS gives:
#   a model name: benchmarks/compare.py on CUDA for that model, every plan made with the default call
#                 (a failure or a timeout costs one model);
#   cuda_check: benchmarks/cuda_check.py (plans made with the default call and without running, on the
#               real models and the grouped-query Llama, verified on the GPU);
#   cuda_autocast: benchmarks/cuda_autocast_check.py (plans for bfloat16 autocast made on the GPU and in a
#               process without CUDA, CUDA's casts applied on its CPU, verified on the GPU under autocast);
#   peak_gap: benchmarks/diagnostics/peak_gap.py $PEAK_GAP_ARGS, at most 180 s (where measured and predicted peaks part; e.g.
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
# A 15-minute lease: 520 s with the device's timeout at 590 s leaves time for a second, warm call.
DEADLINE_S=${DEADLINE_S:-520}
# The default-call plans and the grouped-query Llama first (cuda_check), then the compare models.
STEPS=${STEPS:-cuda_check cuda_autocast llama gpt2 vit cnn bert peak_gap gpt}
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
        cuda_check) timeout "$budget" "$PYTHON" -m benchmarks.cuda_check --results > "$LOGS/cuda_check.log" 2>&1 ;;
        cuda_autocast) [ "$budget" -gt 150 ] && budget=150
                       timeout "$budget" "$PYTHON" -m benchmarks.cuda_autocast_check --results \
                           > "$LOGS/cuda_autocast.log" 2>&1 ;;
        peak_gap) [ "$budget" -gt 180 ] && budget=180
                  timeout "$budget" "$PYTHON" -m benchmarks.diagnostics.peak_gap $PEAK_GAP_ARGS > "$LOGS/peak_gap.log" 2>&1 ;;
        *) [ "$budget" -gt 120 ] && budget=120
           timeout "$budget" "$PYTHON" -m benchmarks.compare --device cuda --batch-scale "$BATCH_SCALE" --rounds 9 \
               --bound-time-limit 5 --models "$step" > "$LOGS/compare_$step.log" 2>&1 ;;
    esac
    echo "$step: exit $? after $((SECONDS - started)) s" | tee -a "$LOGS/status.txt"
done
tar czf "$OUT/gpu_check.tgz" benchmarks/RESULTS.md benchmarks/results/*cuda* -C /tmp gpu_check_logs
tail -n 3 "$LOGS"/compare_*.log "$LOGS/cuda_check.log" "$LOGS/cuda_autocast.log" 2>/dev/null
grep -v "^\[W" "$LOGS/peak_gap.log" 2>/dev/null
cat "$LOGS/status.txt"
