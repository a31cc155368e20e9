#!/usr/bin/env bash
# Multi-adapter serving check on a CUDA host:
#   1. build the kernels;
#   2. correctness: `pytest -m gpu` of the multi-adapter LoRA op (compiled kernel vs reference,
#      fp32 + bf16, edge and large shapes, graph replay, dispatch) and of the serving engine on
#      CUDA (KV cache + CUDA graphs vs transformers on the CPU);
#   3. bench/serve_bench.py: Loraq serving vs HF generate + PEFT, 32 streams over 8 adapters;
#   4. compute-sanitizer memcheck of the op's small shapes (`gpu and not slow`), last: it is the
#      slowest part, and SANITIZER_TIMEOUT bounds it.
# Usage: scripts/serve_check.sh [OUTDIR]   (logs and JSON land in OUTDIR, default bench/results)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results}"
mkdir -p "$out"
py="${PYTHON:-python3}"
status=0
# the GPU's model in the file name: "NVIDIA H100 80GB HBM3" -> h100
gpu=$($py -c "import re, torch; print(re.search(r'\b[A-Z]+\d{2,4}\b', torch.cuda.get_device_name(0)).group().lower())" 2>/dev/null || echo gpu)
date=$(date -u +%F)

echo "== build"
$py -m gpu_kernels.build ${LORAQ_KERNEL_CACHE:+--cache-dir "$LORAQ_KERNEL_CACHE"} || exit 1

echo "== correctness: pytest -m gpu (multi-adapter LoRA op, serving engine)"
$py -m pytest -q -p no:cacheprovider --timeout 300 -m gpu tests/gpu_kernels/test_op_lora_multi.py \
  tests/gpu_kernels/test_gpu_serving.py --gpu-results "$out/serve-check-tests.json" 2>&1 | tee "$out/serve-check-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== serving benchmark"
timeout "${BENCH_TIMEOUT:-400}" $py bench/serve_bench.py --out "$out/serve-$gpu-$date.json" >"$out/serve-bench.txt" 2>&1 || status=1
tail -n 80 "$out/serve-bench.txt"

# Left out under memcheck (marker no_memcheck): graph capture (it needs the caching allocator,
# which memcheck runs without) and the profiler-based dispatch test.
echo "== compute-sanitizer memcheck (test_op_lora_multi.py, gpu and not slow and not no_memcheck)"
if command -v compute-sanitizer >/dev/null; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool memcheck \
    --error-exitcode 3 --print-limit 20 $py -m pytest -q -p no:cacheprovider -m "gpu and not slow and not no_memcheck" \
    tests/gpu_kernels/test_op_lora_multi.py >"$out/serve-check-sanitizer.txt" 2>&1
  rc=$?
  echo "sanitizer exit code $rc ($(tail -n 1 "$out/serve-check-sanitizer.txt"))"
  [ "$rc" -eq 0 ] || status=1
else
  echo "compute-sanitizer not found: skipped"
fi

exit $status
