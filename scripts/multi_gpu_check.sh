#!/usr/bin/env bash
# Multi-GPU check on a host with >= 2 CUDA GPUs:
#   1. correctness: the job path on N GPUs under torchrun (one process per GPU, the packed step
#      captured with its gradient all_reduce inside the graph) against 1 GPU, loss within bf16
#      tolerance, no eager fallback (test_n_gpus_train_like_one in
#      tests/gpu_kernels/test_gpu_training.py, JSON in $OUT, default bench/results);
#   2. throughput: `bench/train_bench.py --job --n-gpus N` — per model the same job on 1 GPU and on
#      N, writing bench/results/multi-gpu-<gpu>-<date>.json (multi-gpu-x<N>-... for N > 2) with
#      device, date, command, both tokens/s per model and `ratios`.
#
# Usage: scripts/multi_gpu_check.sh [N_GPUS]      (default 2)
# Env:   PYTHON=python3  OUT=bench/results  PRESETS=smollm2-135m,llama-1b  (passed to --presets)
set -uo pipefail
cd "$(dirname "$0")/.."
n="${1:-2}"
py="${PYTHON:-python3}"
out="${OUT:-bench/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export LORAQ_COMMIT="${LORAQ_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
status=0

have=$($py -c "import torch; print(torch.cuda.device_count())") || exit 1
if [ "$have" -lt "$n" ]; then
  echo "multi_gpu_check: needs $n CUDA GPUs, this host has $have" >&2
  exit 2
fi
echo "== build kernels"
$py -m gpu_kernels.build ${LORAQ_KERNEL_CACHE:+--cache-dir "$LORAQ_KERNEL_CACHE"} || exit 1

echo "== $n GPUs vs 1: the job path's captured packed step, loss curve"
$py -m pytest -q -p no:cacheprovider -m gpu tests/gpu_kernels/test_gpu_training.py -k n_gpus_train_like_one \
  --n-gpus "$n" --gpu-results "$out/gpu-check-multi-x$n.json" || status=1

echo "== job-path throughput: 1 GPU vs $n"
$py bench/train_bench.py --job --n-gpus "$n" ${PRESETS:+--presets "$PRESETS"} || status=1
exit $status
