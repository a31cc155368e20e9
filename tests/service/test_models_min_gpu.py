"""/v1/models (and `loraq models list`) say, per base and precision, the smallest common GPU the
base's default job trains on (service/gpu_fit.py). The figures are checked against the engine's
memory plan called here with the service's default job settings, never against numbers written in
the test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from service.gpu_fit import COMMON_GPUS
from service.settings import get_settings
from tests.conftest import ApiClient
from tests.engine.tiny_families import save_tiny_family
from worker.engine.catalog import PRESET_SHAPES, PRETRAINED, SHAPE_OF_PRETRAINED, register_local_model
from worker.engine.memory_plan import GGUF_BITS, GIB, ModelDims, plan_memory
from worker.engine.training_config import AUTO_BATCH_SIZE, LoraConfig, TrainingOptions


def models(api: ApiClient) -> dict[str, dict[str, Any]]:
    r = api.get("/v1/models")
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def expected(dims: ModelDims, quantization: str | None, gguf_bits: float | None = None) -> dict[str, Any]:
    """The first GPU whose plan, for a job left to the service's defaults, fits; and that plan."""
    lora = LoraConfig()
    plans = [
        (
            gpu,
            plan_memory(
                dims,
                rank=lora.r,
                targets=lora.target_modules,
                rows=AUTO_BATCH_SIZE,
                seq=TrainingOptions().max_seq_len,
                gpu_bytes=gpu.memory_bytes,
                quantization=quantization,
                gguf_bits=gguf_bits,
                allow_offload=False,  # the captured step keeps its activations on the GPU
            ),
        )
        for gpu in COMMON_GPUS
    ]
    fitting = [(gpu, plan) for gpu, plan in plans if plan.fits]
    gpu, plan = fitting[0] if fitting else (None, plans[-1][1])
    return {
        "memory_gb": gpu.memory_gb if gpu else None,
        "gpu": f"{gpu.memory_gb} GB ({gpu.cards})" if gpu else "none: more than 141 GB (H200)",
        "predicted_peak_gib": round(plan.peak_bytes / GIB, 2),
        "micro_batch_rows": plan.choice.micro_rows,
        "activation_checkpointing": plan.choice.checkpointing,
        "fits": plan.fits,
    }


def shown(entry: dict[str, Any], precision: str) -> dict[str, Any]:
    found = entry["min_gpu"][precision]
    plan = found["plan"]
    assert entry["min_gpu_memory_gb"][precision] == found["memory_gb"]  # the flat field agrees
    return {
        "memory_gb": found["memory_gb"],
        "gpu": found["gpu"],
        "predicted_peak_gib": plan["predicted_peak_gib"],
        "micro_batch_rows": plan["micro_batch_rows"],
        "activation_checkpointing": plan["activation_checkpointing"],
        "fits": plan["fits"],
    }


def test_every_builtin_base_says_its_smallest_gpu_per_precision(api: ApiClient) -> None:
    listed = models(api)
    for name in [*PRETRAINED, *PRESET_SHAPES]:
        entry = listed[name]
        dims = ModelDims.from_config(PRESET_SHAPES[SHAPE_OF_PRETRAINED.get(name, name)].config_kwargs())
        precisions = {"bf16": None, "nf4": "nf4", "int8": "int8"}
        if name in PRETRAINED:  # a GGUF base may also keep its file's blocks (Q4_1: 5 bits a weight)
            precisions["gguf"] = "gguf"
        assert sorted(entry["min_gpu"]) == sorted(precisions) == sorted(entry["min_gpu_memory_gb"])
        for precision, quantization in precisions.items():
            bits = GGUF_BITS[PRETRAINED[name].filename.split(".")[-2]] if quantization == "gguf" else None
            assert shown(entry, precision) == expected(dims, quantization, bits), (name, precision)
    # what the fields are for: an 8B base needs a larger GPU dense than on a 4-bit base
    eight = listed["llama-8b"]["min_gpu_memory_gb"]
    assert eight["nf4"] < eight["bf16"]
    assert listed["llama-8b"]["min_gpu"]["bf16"]["gpu"].startswith(f"{eight['bf16']} GB (")
    # and the single-model route says the same
    assert api.get("/v1/models/llama-8b").json()["min_gpu"] == listed["llama-8b"]["min_gpu"]


def test_a_local_base_is_planned_from_its_config_and_one_gone_says_nothing(
    api: ApiClient, tmp_path: Path
) -> None:
    store = get_settings().model_store
    directory = save_tiny_family("Qwen3ForCausalLM", tmp_path / "qwen")
    register_local_model("tiny-qwen3", directory, store)
    entry = models(api)["tiny-qwen3"]
    dims = ModelDims.from_config(json.loads((directory / "config.json").read_text()))
    assert sorted(entry["min_gpu"]) == ["bf16", "int8", "nf4"]  # no gguf: not a GGUF file
    for precision, quantization in {"bf16": None, "nf4": "nf4", "int8": "int8"}.items():
        assert shown(entry, precision) == expected(dims, quantization)
    shutil.rmtree(directory)  # its shape cannot be read any more: no figure rather than a guess
    entry = models(api)["tiny-qwen3"]
    assert (entry["min_gpu"], entry["min_gpu_memory_gb"]) == (None, None)


def test_the_cli_lists_the_same_sizes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAQ_")}
    out = subprocess.run(
        [sys.executable, "-m", "service.cli", "models", "list", "--wide"],
        env={**env, "LORAQ_DATA_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.split()[:1] == ["llama-8b"]]
    dims = ModelDims.from_config(PRESET_SHAPES["llama-8b"].config_kwargs())
    sizes = {
        p: expected(dims, q)["memory_gb"] for p, q in {"bf16": None, "nf4": "nf4", "int8": "int8"}.items()
    }
    assert f"bf16 {sizes['bf16']} GB, nf4 {sizes['nf4']} GB, int8 {sizes['int8']} GB" in row
