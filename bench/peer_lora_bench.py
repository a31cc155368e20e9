"""One peer-baseline cell: HF transformers + PEFT LoRA (optionally + Liger or torch.compile).

Our adaptation of the script behind ../shared/PEERS.md: the model shapes come from the engine's
catalog presets and the step is the one bench/train_bench.py times, so a standalone peer number
and a side-by-side one are the same measurement. Run one cell per process (Liger patches
transformers globally):

    python bench/peer_lora_bench.py llama-1b peft 4 2048      # variants: peft, liger, compile
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import train_bench


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[1] not in ("peft", "liger", "compile"):
        print(__doc__, file=sys.stderr)
        return 2
    preset, variant, batch, seq = argv[0], argv[1], int(argv[2]), int(argv[3])
    peak = train_bench.matmul_peak_tflops()
    row = train_bench.run_cell(preset, variant, batch, seq, steps=15, warmup=5, profile_dir=None)
    row["tflops"] = round(train_bench.flops_per_token(preset, seq) * row["tok_s"] / 1e12, 1)
    row["mfu"] = round(100 * row["tflops"] / peak, 1)
    row["peak_tflops"] = round(peak)
    print("ROW " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
