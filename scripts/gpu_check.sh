#!/usr/bin/env bash
# GPU correctness check for gpu_kernels, on a CUDA host: build the kernels, compare every op and
# its gradients with the reference (fp32 + bf16, several shapes), run compute-sanitizer memcheck
# on a small case, train tiny-llama 50 steps on the compiled and the reference path, and check the
# packed job step (per-example losses in a packed row equal the examples alone; no leakage).
# Usage: scripts/gpu_check.sh [OUTDIR]   (logs and JSON land in OUTDIR, default bench/results)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export LORAQ_COMMIT="${LORAQ_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
status=0

echo "== build"
$py -m gpu_kernels.build ${LORAQ_KERNEL_CACHE:+--cache-dir "$LORAQ_KERNEL_CACHE"} || exit 1

echo "== ops vs reference"
$py scripts/gpu_check.py ops --json "$out/gpu-check-ops.json" || status=1

echo "== tiny-llama 50 steps, compiled vs reference"
$py scripts/gpu_check.py train --steps 50 --json "$out/gpu-check-train.json" || status=1

echo "== engine recipe on the GPU, compiled vs reference path (tiny-llama 20 steps)"
$py scripts/gpu_check.py recipe --steps 20 --json "$out/gpu-check-recipe.json" || status=1

echo "== packed job step (bf16): per-example loss and gradients in a packed row vs alone, isolation"
$py scripts/gpu_check.py packed --json "$out/gpu-check-packed.json" || status=1

echo "== compute-sanitizer memcheck (small shapes)"
if command -v compute-sanitizer >/dev/null; then
  # no caching allocator: every tensor is its own allocation, so an overrun is seen
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZER_TIMEOUT:-240}" compute-sanitizer --tool memcheck \
    --error-exitcode 3 --print-limit 20 $py scripts/gpu_check.py ops --small >"$out/gpu-check-sanitizer.txt" 2>&1
  rc=$?
  tail -n 3 "$out/gpu-check-sanitizer.txt"
  echo "sanitizer exit code: $rc"
  [ "$rc" -eq 0 ] || status=1
  # the packed job step end to end (varlen attention, gathered loss) on tiny-llama
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZER_TIMEOUT:-240}" compute-sanitizer --tool memcheck \
    --error-exitcode 3 --print-limit 20 $py scripts/gpu_check.py packed --small >"$out/gpu-check-sanitizer-packed.txt" 2>&1
  rc=$?
  tail -n 3 "$out/gpu-check-sanitizer-packed.txt"
  echo "sanitizer (packed step) exit code: $rc"
  [ "$rc" -eq 0 ] || status=1
else
  echo "compute-sanitizer not found: skipped"
fi
exit $status
