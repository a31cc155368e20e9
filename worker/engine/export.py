"""Adapter export in PEFT's layout, and merged-model export.

PEFT layout (a directory):
    adapter_model.safetensors   {"base_model.model.<module path>.lora_A.weight": (r, in) fp32,
                                 "base_model.model.<module path>.lora_B.weight": (out, r) fp32}
    adapter_config.json         peft_type LORA, task_type CAUSAL_LM, base_model_name_or_path = the
                                base's upstream hub id (`catalog.upstream_id`: the catalog name
                                where it has none; never a path of this machine), r, lora_alpha,
                                lora_dropout, target_modules, use_rslora, bias "none"

`export_merged` folds W ← W + s·B·A into a copy of the base model and writes a plain Hugging Face
model directory (safetensors + config.json + tokenizer) loadable by AutoModelForCausalLM.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save
from torch import nn

from worker.engine.catalog import catalog_name, is_hub_id, upstream_id
from worker.engine.lora import (
    apply_lora,
    load_lora_state_dict,
    lora_modules,
    lora_state_dict,
    merge_lora,
    multimodal_of,
    target_leaf_names,
)
from worker.engine.types import LoraConfig, ModelError

if TYPE_CHECKING:
    from worker.engine.models import LoadedModel

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def adapter_config(model: nn.Module, cfg: LoraConfig, model_name: str) -> dict[str, Any]:
    """adapter_config.json's content for a base of catalog name `model_name`. target_modules lists
    the leaf names actually wrapped, so PEFT wraps exactly the same layers ("all-linear" is expanded);
    on a multimodal checkpoint's language model, `exclude_modules` keeps PEFT off every other part
    of the multimodal model (PEFT 0.14 and later)."""
    multimodal = multimodal_of(model)
    excluded = {"exclude_modules": multimodal.outside_language_model()} if multimodal is not None else {}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": upstream_id(model_name),
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": target_leaf_names(model),
        "use_rslora": cfg.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
        "revision": None,
        **excluded,
    }


def write_adapter(directory: Path, model: nn.Module, cfg: LoraConfig, model_name: str) -> None:
    """Write the adapter files into an existing directory (callers make it atomic)."""
    if not lora_modules(model):
        raise RuntimeError("model has no LoRA layers to export")
    if ("/" in model_name or os.sep in model_name) and not is_hub_id(model_name):
        # a Hub id (owner/name) is what PEFT and vLLM load the base by; never a path of this machine
        raise ModelError(f"the base must be given by its catalog name, not a path: {model_name!r}")
    # Written by Python, not by safetensors' save_file: a full disk is then an OSError (ENOSPC)
    # the worker recognises, not a SafetensorError with the errno in its text. An adapter is small.
    (directory / ADAPTER_WEIGHTS).write_bytes(save(lora_state_dict(model), metadata={"format": "pt"}))
    config = adapter_config(model, cfg, model_name)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def replace_dir_atomically(tmp: Path, final: Path) -> None:
    """Move a fully written `tmp` directory to `final`; an existing `final` is replaced whole."""
    _fsync_tree(tmp)
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def export_adapter(out_dir: Path, model: nn.Module, cfg: LoraConfig, model_name: str) -> Path:
    """Write `out_dir` (e.g. output_dir/adapter) atomically: temp dir beside it, then rename."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        write_adapter(tmp, model, cfg, model_name)
        replace_dir_atomically(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_adapter_config(adapter_dir: Path) -> tuple[LoraConfig, str]:
    """LoraConfig and the base's catalog name (its upstream hub id mapped back) from adapter_config.json."""
    path = adapter_dir / ADAPTER_CONFIG
    if not path.is_file():
        raise ModelError(f"{adapter_dir} is not a PEFT adapter directory: no {ADAPTER_CONFIG}")
    data = json.loads(path.read_text())
    if data.get("peft_type") != "LORA":
        raise ModelError(f"{path}: peft_type must be LORA, got {data.get('peft_type')!r}")
    # not range-checked: an adapter trained elsewhere may use a shape our jobs do not offer
    cfg = LoraConfig.model_construct(
        r=int(data["r"]),
        alpha=float(data["lora_alpha"]),
        dropout=float(data.get("lora_dropout", 0.0)),
        target_modules=data["target_modules"],
        use_rslora=bool(data.get("use_rslora", False)),
    )
    return cfg, catalog_name(str(data.get("base_model_name_or_path", "")))


def load_adapter(adapter_dir: Path, model: nn.Module) -> LoraConfig:
    """Wrap `model` with LoRA as adapter_config.json says and load the safetensors weights."""
    cfg, _ = read_adapter_config(adapter_dir)
    apply_lora(model, cfg)
    device = next(model.parameters()).device
    load_lora_state_dict(model, load_file(str(adapter_dir / ADAPTER_WEIGHTS), device=str(device)))
    return cfg


def export_merged(adapter_dir: Path, base: LoadedModel, out_dir: Path) -> Path:
    """Write base + adapter merged (W + s·B·A) as a Hugging Face model directory.

    Works on a deep copy, so `base` (possibly the worker's cached model) stays pristine.
    """
    _, name = read_adapter_config(adapter_dir)
    if name and name != base.name:
        raise ModelError(f"adapter was trained on {name!r}, not on {base.name!r}")
    model = copy.deepcopy(base.model)
    load_adapter(adapter_dir, model)
    with torch.no_grad():
        merge_lora(model)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        # the text model of a multimodal checkpoint is saved as itself (transformers 5 would write
        # it back under the multimodal names it was loaded from, which its own class cannot load)
        if multimodal_of(model) is not None:
            model.save_pretrained(tmp, safe_serialization=True, save_original_format=False)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        base.tokenizer.save_pretrained(tmp)
        replace_dir_atomically(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
