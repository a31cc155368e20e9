"""The model families Loraq trains, and what each one changes relative to Llama: in one place.

Pure Python (no torch, no transformers): the catalog reads it to accept a model directory, the
API to check `lora.target_modules` at submit, and the engine to decide what the fused GPU step
covers. A family is keyed by the `architectures` entry of the model's config.json.

Every family is a decoder of grouped-query attention with RoPE on q and k and a gated MLP
`down(act(gate(x)) ⊙ up(x))`, with RMSNorm(x) = (offset + w) ⊙ x / √(mean(x²) + eps). A layer is

    pre-norm:  h = x + attn(norm₁(x));            y = h + mlp(norm₂(h))
    sandwich:  h = x + norm₂(attn(norm₁(x)));     y = h + norm₄(mlp(norm₃(h)))      (Gemma 3)

What varies is a field of `Family`; what varies per layer of one model (attention window, RoPE
base) comes from its config through `layer_attention`. An attention window W means: a token
attends to itself and the W − 1 tokens before it, within its own example (transformers'
`sliding_window`; flash-attention's `window_size=(W - 1, 0)`).

Some families ship their larger models as a multimodal checkpoint around the same language model
(Gemma 3 4B, 12B and 27B: `Gemma3ForConditionalGeneration`, a vision tower beside a Gemma 3 text
model). Loraq trains that text model: `Multimodal` says where its config and weights sit in such
a checkpoint and by which module paths PEFT and vLLM know its layers there; `text_config` gives
the config the engine reads, with the family's defaults for what the Hub's file leaves out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from worker.engine.types import ModelError

Norm = Literal["pre", "sandwich"]
# a decoder layer's RMSNorm modules by placement, in the order the formulas above apply them:
# norm₁ (before attention), [norm₂ (on attention's output)], norm₂|₃ (before the MLP),
# [norm₄ (on the MLP's output)]: Hugging Face's names, the same in every family of a placement
LAYER_NORMS: dict[Norm, tuple[str, ...]] = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
}
# the gate's activation: SiLU (SwiGLU) or GELU with the tanh approximation (GeGLU)
Activation = Literal["silu", "gelu_tanh"]
# where a layer's attention window comes from:
#   none:           no window (every layer attends over the whole example)
#   sliding_window: config `sliding_window`, on every layer, where set
#   layer_types:    config `sliding_window` on the layers whose `layer_types` entry is
#                   "sliding_attention" (and, where the family names one, only while the config's
#                   `window_switch` flag is true)
Windows = Literal["none", "sliding_window", "layer_types"]
# one RoPE for every layer, or one per layer type (Gemma 3: local base on sliding layers,
# global base and scaling on full-attention layers)
RopeLayout = Literal["single", "per_layer_type"]
# attention scores scale by head_dim^-½, or by query_pre_attn_scalar^-½ (Gemma 3)
AttentionScale = Literal["head_dim", "query_pre_attn_scalar"]
LayerKind = Literal["full_attention", "sliding_attention"]

SPLIT_LINEAR_MODULES: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# RoPE types whose cos/sin tables do not depend on the sequence: one table serves every row
# of a packed step (dynamic, yarn and longrope rescale with the length, or switch tables)
STATIC_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Multimodal:
    """A multimodal checkpoint whose language model is a family here."""

    architecture: str  # config.json `architectures` entry, e.g. "Gemma3ForConditionalGeneration"
    text_config_key: str  # the key of the language model's config in config.json
    # checkpoint key prefix (regex) -> the causal LM's: the Hub's layout and transformers 5's
    weight_prefixes: Mapping[str, str]
    # a causal LM module path prefix -> the same module's path in the multimodal model, as PEFT
    # (and vLLM, which maps the same names) knows it: adapters are exported by those paths
    module_prefix: tuple[str, str]

    def checkpoint_path(self, path: str) -> str:
        """`path` of the causal LM as the multimodal model names it."""
        inner, outer = self.module_prefix
        return outer + path.removeprefix(inner) if path.startswith(inner) else path

    def model_path(self, path: str) -> str:
        """The inverse of `checkpoint_path`."""
        inner, outer = self.module_prefix
        return inner + path.removeprefix(outer) if path.startswith(outer) else path

    def outside_language_model(self) -> str:
        """A regex PEFT's `exclude_modules` takes: every module path of the multimodal model
        outside its language model (the vision tower's q_proj is no target of a text adapter)."""
        return f"(?!{re.escape(self.module_prefix[1])}).*"


@dataclass(frozen=True)
class Family:
    architecture: str  # config.json `architectures` entry, e.g. "Qwen3ForCausalLM"
    model_type: str  # config.json `model_type` transformers loads this architecture from
    name: str  # what people call it: "Qwen3"
    differs: str  # what differs from Llama, in words (the README's table, error messages)
    norm: Norm = "pre"
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): 0 (Llama), 1 (Gemma: w starts at 0)
    activation: Activation = "silu"
    qk_norm: bool = False  # per-head RMSNorm on q and k, after the projection, before RoPE
    qkv_bias: bool = False  # q/k/v projections always carry a bias (Llama's `attention_bias` aside)
    embedding_scale: bool = False  # token embeddings × √hidden_size, in the weights' dtype
    windows: Windows = "none"
    window_switch: str | None = None  # the config flag that turns `layer_types` windows on
    rope: RopeLayout = "single"
    rope_theta: float = 10_000.0  # base when the config names none (full-attention layers)
    local_rope_theta: float | None = None  # sliding layers' base when the config names none
    attention_scale: AttentionScale = "head_dim"
    tied_embeddings: bool = False  # tie_word_embeddings when the config does not say
    # fused projection -> the split ones it stands for, in output order (vLLM's packed_modules_mapping)
    packed_modules: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # the linear layers LoRA can wrap: leaf name -> parent module. These are the names PEFT wraps
    # and an exported adapter_config.json lists, so the fused ones where the model has them.
    linear_modules: Mapping[str, str] = field(default_factory=lambda: dict(SPLIT_LINEAR_MODULES))
    # what transformers' config class assumes for a field a config.json leaves out, for the fields
    # the engine reads (a multimodal checkpoint's text_config lists only what differs from them)
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    multimodal: Multimodal | None = None  # the multimodal checkpoint this family's models ship in

    def target_hint(self, leaf: str) -> str:
        """Why `leaf` is no layer of this family, where a fused projection holds it ("" if not)."""
        for fused, parts in self.packed_modules.items():
            if leaf in parts:
                return f"; {self.name} fuses {'/'.join(parts)} into one layer, {fused}"
        return ""


LLAMA = Family(
    "LlamaForCausalLM",
    "llama",
    "Llama",
    "the reference shape; Llama 3.1+ rope_scaling type llama3",
)
MISTRAL = Family(
    "MistralForCausalLM",
    "mistral",
    "Mistral",
    "attention window on every layer where the config sets sliding_window",
    windows="sliding_window",
)
QWEN2 = Family(
    "Qwen2ForCausalLM",
    "qwen2",
    "Qwen2",
    "biases on q/k/v",
    qkv_bias=True,
    windows="layer_types",
    window_switch="use_sliding_window",
)
QWEN3 = Family(
    "Qwen3ForCausalLM",
    "qwen3",
    "Qwen3",
    "per-head RMSNorm on q and k before RoPE",
    qk_norm=True,
    windows="layer_types",
    window_switch="use_sliding_window",
)
GEMMA3 = Family(
    "Gemma3ForCausalLM",
    "gemma3_text",
    "Gemma 3",
    "sandwich norms with (1 + w) weights, GeGLU (tanh GELU), q/k RMSNorm, embeddings × √hidden, "
    "sliding-window layers between global ones with their own RoPE base, "
    "scores × query_pre_attn_scalar^-½, tied embeddings",
    norm="sandwich",
    norm_offset=1.0,
    activation="gelu_tanh",
    qk_norm=True,
    embedding_scale=True,
    windows="layer_types",
    rope="per_layer_type",
    rope_theta=1_000_000.0,
    local_rope_theta=10_000.0,
    attention_scale="query_pre_attn_scalar",
    tied_embeddings=True,
    config_defaults={  # Gemma3TextConfig's (tests/engine/test_multimodal_text.py holds them to it)
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
    },
    multimodal=Multimodal(
        "Gemma3ForConditionalGeneration",
        "text_config",
        {
            r"^language_model\.model\.": "model.",
            r"^language_model\.lm_head\.": "lm_head.",
            r"^model\.language_model\.": "model.",
        },
        ("model.", "model.language_model."),
    ),
)
PHI3 = Family(
    "Phi3ForCausalLM",
    "phi3",
    "Phi-3",
    "fused qkv_proj and gate_up_proj, partial rotary (Phi-4-mini), attention window where set",
    windows="sliding_window",
    packed_modules={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    linear_modules={
        "qkv_proj": "self_attn",
        "o_proj": "self_attn",
        "gate_up_proj": "mlp",
        "down_proj": "mlp",
    },
)

FAMILIES: dict[str, Family] = {f.architecture: f for f in (LLAMA, QWEN2, QWEN3, MISTRAL, GEMMA3, PHI3)}
# multimodal architecture -> the family of its language model, which Loraq trains
TEXT_FAMILIES: dict[str, Family] = {f.multimodal.architecture: f for f in FAMILIES.values() if f.multimodal}
# every architecture a config.json may name -> the family Loraq trains it as
ARCHITECTURE_FAMILIES: dict[str, Family] = {**FAMILIES, **TEXT_FAMILIES}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_FAMILIES)


def family_named(architecture: str) -> Family:
    """The family of a model class name (`type(model).__name__`), or ModelError naming the supported."""
    family = FAMILIES.get(architecture)
    if family is None:
        raise ModelError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return family


def family_in_config(config: Mapping[str, Any]) -> Family | None:
    """The family of the first supported entry of a config.json's `architectures` (a multimodal
    one: its language model's), or None."""
    names = config.get("architectures") or []
    return next(
        (ARCHITECTURE_FAMILIES[a] for a in names if isinstance(a, str) and a in ARCHITECTURE_FAMILIES), None
    )


def multimodal_of_config(config: Mapping[str, Any]) -> Multimodal | None:
    """The multimodal wrapper a config.json describes (Gemma3ForConditionalGeneration), or None
    for a causal LM's own config."""
    family = family_in_config(config)
    names = config.get("architectures") or []
    if family is None or family.multimodal is None or family.architecture in names:
        return None
    return family.multimodal


def text_config(config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The config of the causal LM Loraq trains from a config.json's content: the content itself,
    or a multimodal checkpoint's language model config (`architectures` then the family's causal
    LM), with the family's defaults for the fields it leaves out. `source` names the file in
    errors; a config of no supported family is returned as it is (family_of_config refuses it)."""
    family = family_in_config(config)
    if family is None:
        return dict(config)
    multimodal = multimodal_of_config(config)
    if multimodal is None:
        return {**family.config_defaults, **config}
    inner = config.get(multimodal.text_config_key)
    if not isinstance(inner, Mapping):
        raise ModelError(
            f"{source} names {multimodal.architecture} but has no {multimodal.text_config_key!r} object: "
            "the language model's config is missing"
        )
    return {**family.config_defaults, **inner, "architectures": [family.architecture]}


def ties_embeddings(family: Family | None, config: Mapping[str, Any]) -> bool:
    """Whether the LM head is the embedding matrix: the config's `tie_word_embeddings`, or where
    it leaves that out (Hugging Face writes only what differs from the config class's default,
    so a Gemma 3 config.json rarely says) the family's default; untied for no family."""
    value = config.get("tie_word_embeddings")
    if value is None:
        return family.tied_embeddings if family is not None else False
    return bool(value)


def family_of_config(config: Mapping[str, Any], source: str) -> Family:
    """The family of a config.json's content (`source` names the file in errors; a multimodal
    checkpoint's: its language model's), after checking the config asks for nothing the engine
    would compute differently from transformers."""
    family = family_in_config(config)
    if family is None:
        architectures = config.get("architectures") or []
        raise ModelError(
            f"unsupported architecture {architectures or '(none given)'} in {source}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    text = text_config(config, source)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        # Gemma 2's soft-capping (Gemma 3 has none): the engine's loss runs the LM head itself
        if text.get(key) is not None:
            raise ModelError(f"{source} sets {key}={text[key]!r}; logit soft-capping is not supported")
    if text.get("use_bidirectional_attention"):
        raise ModelError(f"{source} sets use_bidirectional_attention: not a causal language model")
    return family


@dataclass(frozen=True)
class Rope:
    type: str  # transformers' rope_type: default, linear, llama3, yarn, longrope, dynamic
    theta: float
    factor: float | None = None  # the scaling factor, for the types that have one
    rotary_fraction: float = 1.0  # share of head_dim that rotates (Phi-4-mini: 0.75)


@dataclass(frozen=True)
class LayerAttention:
    kind: LayerKind
    window: int | None  # see the module docstring; None: the whole example
    rope: Rope


def layer_attention(family: Family, config: Mapping[str, Any]) -> list[LayerAttention]:
    """Each decoder layer's attention window and RoPE, from a config.json's content (as on the
    Hub: rope_theta, rope_scaling, rope_local_base_freq, sliding_window_pattern; or as
    transformers 5 writes it: rope_parameters, layer_types)."""
    n = int(config["num_hidden_layers"])
    kinds = _layer_kinds(family, config, n)
    window = _window(family, config)
    return [
        LayerAttention(kind, window if kind == "sliding_attention" else None, _rope(family, config, kind))
        for kind in kinds
    ]


def fused_path_gap(family: Family, config: Mapping[str, Any]) -> str | None:
    """Why the GPU fused step (worker/engine/fused_model.py) does not cover a model of `family`
    with `config` (None: it does). It covers every field of every family here; what it cannot
    take is a RoPE whose table depends on the sequence (one static cos/sin table per layer type)."""
    layers = layer_attention(family, config)
    dynamic = sorted({layer.rope.type for layer in layers} - set(STATIC_ROPE_TYPES))
    if dynamic:
        return f"RoPE type {dynamic[0]}: the fused step reads one static cos/sin table"
    return None


def _layer_kinds(family: Family, config: Mapping[str, Any], n: int) -> list[LayerKind]:
    if family.windows == "none":
        return ["full_attention"] * n
    if family.windows == "sliding_window":
        return ["sliding_attention" if config.get("sliding_window") is not None else "full_attention"] * n
    given = config.get("layer_types")
    if isinstance(given, list) and len(given) == n:
        return ["sliding_attention" if t == "sliding_attention" else "full_attention" for t in given]
    if family.window_switch is not None:  # Qwen: the layers from max_window_layers on, if switched on
        if _window(family, config) is None:
            return ["full_attention"] * n
        first = int(config.get("max_window_layers", 28))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    # Gemma 3 configs on the Hub give a pattern: every `pattern`-th layer is global
    pattern = int(config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6)))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]


def _window(family: Family, config: Mapping[str, Any]) -> int | None:
    window = config.get("sliding_window")
    if window is None or (family.window_switch is not None and not config.get(family.window_switch)):
        return None
    return int(window)


def _rope(family: Family, config: Mapping[str, Any], kind: LayerKind) -> Rope:
    params = config.get("rope_parameters")  # as transformers 5 writes it (per layer type for Gemma 3)
    if family.rope == "per_layer_type":
        params = params.get(kind) if isinstance(params, Mapping) else None
    if isinstance(params, Mapping) and params:
        p = dict(params)
    elif family.rope == "per_layer_type" and kind == "sliding_attention":
        p = {"rope_theta": config.get("rope_local_base_freq", family.local_rope_theta)}
    else:  # as on the Hub: rope_theta beside rope_scaling
        theta = config.get("rope_theta", family.rope_theta)
        p = {**(config.get("rope_scaling") or {}), "rope_theta": theta}
    factor = p.get("factor")
    return Rope(
        type=str(p.get("rope_type") or p.get("type") or "default"),
        theta=float(p.get("rope_theta") or family.rope_theta),
        factor=float(factor) if factor is not None else None,
        rotary_fraction=float(p.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))),
    )
