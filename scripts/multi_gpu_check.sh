#!/usr/bin/env bash
# Multi-GPU check on a host with >= 2 CUDA GPUs: train the same LoRA job on 1 GPU (in process)
# and on 2 GPUs (torchrun, the path a worker takes for a job with n_gpus=2: worker/engine/
# distributed.py), then write one JSON per model with the device, date, tokens/s of both runs,
# both loss curves and how far the two adapters are apart.
#
# Usage: scripts/multi_gpu_check.sh [OUTDIR]      (default: $OUT, else bench/results)
# Env:   MODELS="tiny-llama llama-1b"  STEPS=40  BATCH=8  SEQ=512  PYTHON=python3
#        DEVICE=cpu runs the same two trainings with 2 gloo ranks on CPU (a dry run of this script).
# Needs torch (CUDA), transformers, safetensors, tokenizers importable by $PYTHON; nvcc for the
# kernels (built first, as the worker image does).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench/results}}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export LORAQ_COMMIT="${LORAQ_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
models="${MODELS:-tiny-llama llama-1b}"
status=0

export DEVICE="${DEVICE:-cuda}"
if [ "$DEVICE" = cuda ]; then
  n_gpus=$($py -c "import torch; print(torch.cuda.device_count())") || exit 1
  if [ "$n_gpus" -lt 2 ]; then
    echo "multi_gpu_check: needs 2 CUDA GPUs, this host has $n_gpus" >&2
    exit 2
  fi
  echo "== build kernels"
  $py -m gpu_kernels.build || exit 1
fi

for model in $models; do
  echo "== $model: 1 GPU vs 2 GPUs (torchrun)"
  $py - "$model" "$out" <<'PY' || status=1
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from worker.engine import distributed, recipe
from worker.engine.types import LoraConfig, NullCallbacks, StepMetrics, TrainConfig

model, out = sys.argv[1], Path(sys.argv[2])
steps, batch, seq = int(os.environ.get("STEPS", "40")), int(os.environ.get("BATCH", "8")), int(os.environ.get("SEQ", "512"))


class Curve(NullCallbacks):
    def __init__(self) -> None:
        self.steps: list[StepMetrics] = []

    def on_step(self, metrics: StepMetrics) -> None:
        self.steps.append(metrics)


work = Path(tempfile.mkdtemp(prefix="loraq-mgpu-"))
rows = []
for i in range(4 * batch * 8):
    # 2 copies of up to seq/16 words of ~3 tokens each: every row fits max_seq_len, lengths vary
    words = " ".join(f"w{(i * 7 + j) % 97}" for j in range(4 + (i * 13) % (seq // 16)))
    rows.append({"messages": [{"role": "user", "content": f"Repeat item {i}: {words}"},
                              {"role": "assistant", "content": f"Item {i}: {words}"}]})
train_file = work / "train.jsonl"
train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))


def config(name: str) -> TrainConfig:
    return TrainConfig(
        model=model, train_file=train_file, output_dir=work / name, model_store=work / "models",
        lora=LoraConfig(r=16, alpha=32.0, dropout=0.0), max_seq_len=seq, batch_size=batch,
        max_steps=steps, learning_rate=1e-3, lr_scheduler="constant", seed=0, device=os.environ["DEVICE"],
    )


def summary(curve: Curve, wall: float) -> dict:
    tps = [m.tokens_per_s for m in curve.steps[3:]] or [m.tokens_per_s for m in curve.steps]
    return {
        "wall_seconds": round(wall, 2),
        "tokens_per_s_median": round(statistics.median(tps), 1),
        "loss_curve": [round(m.train_loss, 5) for m in curve.steps],
        "grad_norm_curve": [round(m.grad_norm, 5) for m in curve.steps],
        "steps_reported": [m.step for m in curve.steps],
    }


result = {
    "check": "multi_gpu", "model": model, "host": socket.gethostname(),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "commit": os.environ.get("LORAQ_COMMIT"), "torch": torch.__version__, "cuda": torch.version.cuda,
    "device": os.environ["DEVICE"],
    "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] or ["cpu"],
    "steps": steps, "batch_size": batch, "max_seq_len": seq,
}
try:
    one = Curve()
    t0 = time.monotonic()
    r1 = recipe.train(config("one"), one)
    result["one_gpu"] = summary(one, time.monotonic() - t0)

    two = Curve()
    t0 = time.monotonic()
    r2 = distributed.run_torchrun(config("two"), two, n_gpus=2, workdir=work / "two-run")
    result["two_gpus"] = summary(two, time.monotonic() - t0)

    a, b = load_file(str(r1.adapter_dir / "adapter_model.safetensors")), load_file(str(r2.adapter_dir / "adapter_model.safetensors"))
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    scale = max(float(a[k].abs().max()) for k in a)
    loss_rel = max(abs(x.train_loss - y.train_loss) / abs(x.train_loss) for x, y in zip(one.steps, two.steps))
    result["adapter_max_abs_diff"] = diff
    result["adapter_max_abs"] = scale
    result["loss_max_rel_diff"] = loss_rel
    result["speedup_tokens_per_s"] = round(result["two_gpus"]["tokens_per_s_median"] / result["one_gpu"]["tokens_per_s_median"], 3)
    # bf16 autocast on GPU: the two runs sum in different orders, so agreement is approximate.
    result["one_curve"] = result["two_gpus"]["steps_reported"] == list(range(1, steps + 1))
    result["consistent"] = result["one_curve"] and loss_rel < 0.05
    ok = result["consistent"]
except Exception as exc:  # record the failure in the JSON too
    result["error"] = f"{type(exc).__name__}: {exc}"
    ok = False
path = out / f"multi-gpu-{os.environ['DEVICE']}-{model}-{datetime.date.today().isoformat()}.json"
path.write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=2))
for k in ("one_gpu", "two_gpus"):
    if k in result:
        print(k, "tokens/s", result[k]["tokens_per_s_median"], "final loss", result[k]["loss_curve"][-1:])
print("wrote", path)
sys.exit(0 if ok else 1)
PY
done
exit $status
