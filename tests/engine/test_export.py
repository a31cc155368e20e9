"""Exported adapters load in PEFT and give the engine's logits; merged exports load in transformers."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.engine.recipe_helpers import Recorder, tiny_config
from worker.engine.export import export_merged, load_adapter
from worker.engine.lora import lora_modules
from worker.engine.models import LoadedModel
from worker.engine.recipe import train
from worker.engine.types import LoraConfig, ModelError


def _trained_adapter(tmp: Path, lora: LoraConfig) -> Path:
    # a high learning rate for a few steps: B moves well away from zero
    result = train(tiny_config(tmp, lora=lora, max_steps=3, learning_rate=2e-2), Recorder())
    return result.adapter_dir


def _engine_logits(tiny: LoadedModel, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    model = copy.deepcopy(tiny.model)
    load_adapter(adapter, model)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(
    "lora",
    [
        LoraConfig(r=8, alpha=16.0),
        LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    ],
    ids=["all-linear", "named-rslora"],
)
def test_peft_loads_the_adapter_and_matches_the_engine(
    tmp_path: Path, tiny: LoadedModel, lora: LoraConfig
) -> None:
    adapter = _trained_adapter(tmp_path, lora)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny-llama"
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (lora.r, lora.alpha, lora.use_rslora)
    if isinstance(lora.target_modules, list):
        assert config["target_modules"] == sorted(lora.target_modules)

    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = _engine_logits(tiny, adapter, ids)
    with torch.no_grad():
        base_logits = tiny.model(input_ids=ids).logits
    assert (ours - base_logits).abs().max() > 1e-3, (
        "the adapter must change the output for this to test anything"
    )

    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(tiny.model), str(adapter))
    peft_model.eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    assert (theirs - ours).abs().max().item() <= 1e-4


def test_merged_export_loads_with_transformers_and_matches(tmp_path: Path, tiny: LoadedModel) -> None:
    adapter = _trained_adapter(tmp_path, LoraConfig(r=8, alpha=16.0))
    out = export_merged(adapter, tiny, tmp_path / "merged")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not list(out.glob("*.bin"))
    assert not lora_modules(tiny.model)  # the base given in stays pristine

    merged = AutoModelForCausalLM.from_pretrained(out)
    merged.eval()
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = merged(input_ids=ids).logits
    assert (theirs - _engine_logits(tiny, adapter, ids)).abs().max().item() <= 1e-4

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("the cat")["input_ids"] == tiny.tokenizer("the cat")["input_ids"]
    assert tokenizer.chat_template == tiny.tokenizer.chat_template


def test_merged_export_refuses_another_base(tmp_path: Path, tiny: LoadedModel) -> None:
    adapter = _trained_adapter(tmp_path, LoraConfig(r=4, alpha=4.0))
    other = LoadedModel(tiny.model, tiny.tokenizer, "some-other-model", is_random=True)
    with pytest.raises(ModelError, match="trained on 'tiny-llama'"):
        export_merged(adapter, other, tmp_path / "merged")


def test_adapter_config_names_the_upstream_base_and_reads_back_the_catalog_name(
    tmp_path: Path, tiny: LoadedModel
) -> None:
    from worker.engine.export import adapter_config, read_adapter_config, write_adapter
    from worker.engine.lora import apply_lora

    model = copy.deepcopy(tiny.model)
    apply_lora(model, LoraConfig(r=2, alpha=4.0))
    config = adapter_config(model, LoraConfig(r=2, alpha=4.0), "smollm2-135m-instruct")
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    write_adapter(tmp_path, model, LoraConfig(r=2, alpha=4.0), "smollm2-135m-instruct")
    assert read_adapter_config(tmp_path)[1] == "smollm2-135m-instruct"  # `loraq export merged` finds it
    with pytest.raises(ModelError, match="catalog name, not a path"):
        write_adapter(tmp_path, model, LoraConfig(r=2, alpha=4.0), "/home/me/models/x")
