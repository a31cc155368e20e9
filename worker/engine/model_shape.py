"""What a user picks a base by, read from its config.json without loading it: the family, the
parameter count and the context length. Pure Python (the API lists models through it).

Parameters of one decoder layer of a family (h = hidden_size, i = intermediate_size,
n = num_attention_heads, k = num_key_value_heads, d = head_dim, default h / n):

    attention   q, o: h·n·d each; k, v: h·k·d each      (Phi-3's fused qkv_proj holds the same)
                + biases n·d + 2·k·d where the family (Qwen2) or `attention_bias` has them
                  (`attention_bias` also gives o_proj its bias of h)
                + q/k RMSNorm weights 2·d where the family has them (Qwen3, Gemma 3)
    MLP         gate, up, down: 3·h·i                     (Phi-3's gate_up_proj holds gate and up)
    norms       2·h (pre-norm) or 4·h (Gemma 3's sandwich)

plus the embedding v·h (v = vocab_size), the final norm h and an LM head v·h unless tied.
tests/engine/test_model_shape.py checks these against transformers' models of every family.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.engine.families import Family, family_of_config, text_config, ties_embeddings


@dataclass(frozen=True)
class ModelShape:
    family: Family
    parameters: int | None  # None where the config lacks a size field (it would not load either)
    context_length: int | None  # max_position_embeddings; None where the config names none


def parameter_count(family: Family, config: Mapping[str, Any]) -> int:
    """The parameters of a `family` model built from `config` (see the module docstring)."""
    h, i, v = int(config["hidden_size"]), int(config["intermediate_size"]), int(config["vocab_size"])
    n = int(config["num_attention_heads"])
    k = int(config.get("num_key_value_heads") or n)
    d = int(config.get("head_dim") or h // n)
    bias = bool(config.get("attention_bias", False))
    attention = 2 * h * n * d + 2 * h * k * d
    if family.qkv_bias or bias:
        attention += n * d + 2 * k * d
    if bias:
        attention += h
    if family.qk_norm:
        attention += 2 * d
    norms = (4 if family.norm == "sandwich" else 2) * h
    layer = attention + 3 * h * i + norms
    tied = ties_embeddings(family, config)
    return int(config["num_hidden_layers"]) * layer + v * h * (1 if tied else 2) + h


def shape_of_config(config: Mapping[str, Any], source: str) -> ModelShape:
    """The family (ModelError naming the supported ones otherwise), parameters and context length
    of a config.json's content (a multimodal checkpoint's: of its language model, without the
    vision tower Loraq neither loads nor trains); `source` names the file in errors."""
    family = family_of_config(config, source)
    text = text_config(config, source)  # a multimodal checkpoint's language model: what trains
    try:
        parameters: int | None = parameter_count(family, text)
    except (KeyError, TypeError, ValueError):
        parameters = None
    context = text.get("max_position_embeddings")
    return ModelShape(family, parameters, int(context) if isinstance(context, int) else None)
