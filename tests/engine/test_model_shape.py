"""worker/engine/model_shape.py: the parameter count read from a config.json equals what
transformers builds, for every family (and Llama with attention biases and tied embeddings)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.engine.tiny_families import build_tiny_family
from worker.engine.families import FAMILIES
from worker.engine.model_shape import shape_of_config


@pytest.mark.parametrize("architecture", list(FAMILIES))
def test_parameter_count_is_what_transformers_builds(architecture: str) -> None:
    model = build_tiny_family(architecture)
    config = {**json.loads(model.config.to_json_string()), "architectures": [architecture]}
    shape = shape_of_config(config, architecture)
    assert shape.family is FAMILIES[architecture]
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert shape.context_length == config["max_position_embeddings"]


def test_llama_with_attention_biases_and_tied_embeddings() -> None:
    config = LlamaConfig(
        vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    content = {**json.loads(config.to_json_string()), "architectures": ["LlamaForCausalLM"]}
    assert shape_of_config(content, "llama").parameters == sum(p.numel() for p in model.parameters())


def test_a_config_without_its_sizes_has_a_family_and_no_count() -> None:
    shape = shape_of_config({"architectures": ["MistralForCausalLM"]}, "x")
    assert (shape.family.name, shape.parameters, shape.context_length) == ("Mistral", None, None)
