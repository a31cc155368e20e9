"""One tiny random model per family of worker/engine/families.py, as Liger-Kernel's tests keep
a mini model per family: a few layers of hidden size 32 that still show what the family changes.

- Llama: RoPE scaling of type llama3 (it rescales all but the fastest of the 4 frequencies);
- Mistral: an attention window of WINDOW tokens on every one of its 3 layers;
- Qwen2: q/k/v biases; Qwen3: per-head q/k RMSNorm;
- Gemma 3: sliding, global, sliding layers (window WINDOW, two RoPE bases), sandwich norms,
  GeGLU, embedding scale, tied embeddings, query_pre_attn_scalar unlike head_dim;
- Phi-3: fused qkv_proj and gate_up_proj, partial rotary 0.75 (Phi-4-mini), tied embeddings.

Every parameter is moved off its init by seeded noise (biases start at 0, norm weights at 1 or
0), so each of those differences changes the numbers. Saved as a local model directory (fp32
safetensors, config.json, tiny-llama's tokenizer and ChatML template), as `loraq models add` takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from worker.engine.tiny import build_tiny_tokenizer

# tokens an attention window spans: under half of any test example, yet three windowed layers
# reach 21 tokens back, past most prompts (17-31 tokens), so packed examples would see each
# other's answers if attention crossed an example's start
WINDOW = 8
NOISE = 0.05
SHAPE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def tiny_config(architecture: str) -> PretrainedConfig:
    tok = build_tiny_tokenizer()
    ids = {"bos_token_id": None, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    if architecture == "LlamaForCausalLM":
        llama3 = {
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(**SHAPE, **ids, rope_parameters=llama3)
    if architecture == "MistralForCausalLM":
        return MistralConfig(**{**SHAPE, "num_hidden_layers": 3}, **ids, head_dim=8, sliding_window=WINDOW)
    if architecture == "Qwen2ForCausalLM":
        return Qwen2Config(**SHAPE, **ids)
    if architecture == "Qwen3ForCausalLM":
        return Qwen3Config(**SHAPE, **ids, head_dim=8)
    if architecture == "Gemma3ForCausalLM":
        return Gemma3TextConfig(
            **{**SHAPE, "num_hidden_layers": 3},
            **ids,
            head_dim=8,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=16,
        )
    if architecture == "Phi3ForCausalLM":
        rope = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75}
        return Phi3Config(**SHAPE, **ids, rope_parameters=rope, tie_word_embeddings=True)
    raise ValueError(f"no tiny config for {architecture}")


def build_tiny_family(architecture: str, seed: int = 0) -> PreTrainedModel:
    """The tiny model in fp32 on the CPU, every parameter perturbed (seeded)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(architecture))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * NOISE)
    assert type(model).__name__ == architecture
    return model.eval()


def save_tiny_family(architecture: str, directory: Path, seed: int = 0) -> Path:
    build_tiny_family(architecture, seed).save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return directory
