#!/usr/bin/env bash
# GPU check for gpu_kernels, on a CUDA host:
#   1. build the kernels;
#   2. correctness: `pytest -m gpu tests/gpu_kernels` — every op forward and backward against its
#      reference (fp32 + bf16, edge and large shapes: test_op_<op>.py), a graphed step vs eager,
#      tiny-llama 50 steps and the recipe on the compiled vs the reference path, the packed job
#      step in bf16 (each example in a packed row vs alone, isolation) (test_gpu_training.py); every
#      family's fused captured step vs the plain path (test_gpu_families.py), and each op's family
#      variants (q/k norm and partial rotary in rope, RMSNorm offset, GeGLU, varlen windows);
#   3. compute-sanitizer memcheck of `pytest -m "gpu and not slow and not no_memcheck"` (the small
#      shapes of every op and its family variants, the packed step on tiny-llama, every tiny
#      family's fused packed loss fwd + bwd; no graph capture, no profiler);
#   4. measuring: op timings, compiled vs eager torch (scripts/gpu_check.py bench).
# Usage: scripts/gpu_check.sh [OUTDIR]   (logs and JSON land in OUTDIR, default bench/results)
# Needs pytest and pytest-timeout next to the CUDA torch (pip install pytest pytest-timeout).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results}"
mkdir -p "$out"
py="${PYTHON:-python3}"
status=0

$py -m pytest --version >/dev/null 2>&1 || { echo "gpu_check: pytest is missing: pip install pytest pytest-timeout" >&2; exit 2; }

echo "== build"
$py -m gpu_kernels.build ${LORAQ_KERNEL_CACHE:+--cache-dir "$LORAQ_KERNEL_CACHE"} || exit 1

echo "== correctness: pytest -m gpu (ops vs reference, training paths)"
$py -m pytest -q -p no:cacheprovider -m gpu tests/gpu_kernels --gpu-results "$out/gpu-check-tests.json" \
  2>&1 | tee "$out/gpu-check-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== compute-sanitizer memcheck (pytest -m 'gpu and not slow and not no_memcheck')"
if command -v compute-sanitizer >/dev/null; then
  # One sanitizer process per test file, SANITIZER_JOBS at a time: memcheck is bound by the host
  # CPU, so the files run side by side on one GPU. No caching allocator: every tensor is its own
  # allocation, so an overrun is seen.
  export out py
  ls tests/gpu_kernels/test_*.py | xargs -P "${SANITIZER_JOBS:-8}" -I{} sh -c '
    name=$(basename {} .py)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZER_TIMEOUT:-900}" compute-sanitizer --tool memcheck \
      --error-exitcode 3 --print-limit 20 $py -m pytest -q -p no:cacheprovider -m "gpu and not slow and not no_memcheck" {} \
      >"$out/sanitizer-$name.txt" 2>&1
    rc=$?
    [ "$rc" -eq 5 ] && rc=0  # pytest: no test of the file selected
    echo "$rc" >"$out/sanitizer-$name.rc"'
  : >"$out/gpu-check-sanitizer.txt"
  for rcfile in "$out"/sanitizer-*.rc; do
    name=$(basename "$rcfile" .rc)
    rc=$(cat "$rcfile")
    { echo "=== $name: exit code $rc"; grep -m 60 "^=========" "$out/$name.txt"; tail -n 3 "$out/$name.txt"; } >>"$out/gpu-check-sanitizer.txt"
    echo "$name: sanitizer exit code $rc ($(tail -n 1 "$out/$name.txt"))"
    [ "$rc" -eq 0 ] || status=1
    rm -f "$rcfile" "$out/$name.txt"
  done
else
  echo "compute-sanitizer not found: skipped"
fi

echo "== op timings: compiled vs eager torch"
$py scripts/gpu_check.py bench --json "$out/gpu-check-opbench.json" || status=1
exit $status
