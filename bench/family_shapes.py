"""Real shapes of each model family, random-init, for the job benchmark's per-family rows
(`train_bench.py --job --presets qwen3-8b,gemma-3-4b,...`).

The sizes are those of the published config.json of each model (hidden, intermediate, layers,
heads, kv heads, head size, vocabulary, windows, tied embeddings); the weights are random, and the
RoPE is each family's plain one (no long-context scaling: its cost is the same table). The
tokenizer is tiny-llama's, as for the catalog presets: the data's token ids are a subset of every
vocabulary here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.engine.families import FAMILIES, Family, ties_embeddings


@dataclass(frozen=True)
class FamilyShape:
    architecture: str
    config: dict[str, Any]  # the config.json fields that set the shape
    job: tuple[int, int, int, int]  # rows B, row tokens T, HF+PEFT examples per padded batch, timed steps

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    def targets(self) -> list[str]:
        """Every linear layer of a decoder layer, by the names this family's checkpoints use."""
        return list(self.family.linear_modules)

    def linear_weights(self) -> int:
        """Weights of every linear layer, the LM head included (tied or not: it is a matmul)."""
        c = self.config
        h, i, n = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
        k, d = c["num_key_value_heads"], c.get("head_dim") or c["hidden_size"] // n
        per_layer = 2 * h * n * d + 2 * h * k * d + 3 * h * i
        return c["num_hidden_layers"] * per_layer + c["vocab_size"] * h

    def attention_width(self) -> int:
        """n·d summed over layers: what causal attention's FLOPs per token scale with (× 6·s)."""
        c = self.config
        d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return c["num_hidden_layers"] * c["num_attention_heads"] * d


_8B = (2, 2048, 4, 12)
_1B = (4, 2048, 8, 20)
FAMILY_SHAPES: dict[str, FamilyShape] = {
    "llama-3.1-8b": FamilyShape(
        "LlamaForCausalLM",
        {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
        _8B,
    ),
    "qwen3-8b": FamilyShape(
        "Qwen3ForCausalLM",
        {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000.0,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
        _8B,
    ),
    "mistral-7b": FamilyShape(  # v0.1: the 4,096-token window (at T = 2,048 it never binds)
        "MistralForCausalLM",
        {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": 4096, "rope_theta": 10000.0},
        _8B,
    ),
    "gemma-3-4b": FamilyShape(
        "Gemma3ForCausalLM",
        {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208, "sliding_window": 1024,
         "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6},
        _8B,
    ),
    "gemma-3-12b": FamilyShape(
        "Gemma3ForCausalLM",
        {"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 262208, "sliding_window": 1024,
         "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6},
        (1, 2048, 2, 10),
    ),
    "phi-4-mini": FamilyShape(
        "Phi3ForCausalLM",
        {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24,
         "num_key_value_heads": 8, "vocab_size": 200064, "partial_rotary_factor": 0.75,
         "tie_word_embeddings": True, "rope_theta": 10000.0},
        _8B,
    ),
    "llama-3.2-1b": FamilyShape(
        "LlamaForCausalLM",
        {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
         "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "tie_word_embeddings": True},
        _1B,
    ),
    "qwen3-1.7b": FamilyShape(
        "Qwen3ForCausalLM",
        {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000.0,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
        _1B,
    ),
    "gemma-3-1b": FamilyShape(
        "Gemma3ForCausalLM",
        {"hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
         "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "sliding_window": 512,
         "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6},
        _1B,
    ),
}  # fmt: skip
# the Llama row each family's MFU and memory are held against (same parameter class)
LLAMA_PEER = {
    "qwen3-8b": "llama-3.1-8b",
    "mistral-7b": "llama-3.1-8b",
    "gemma-3-4b": "llama-3.1-8b",
    "gemma-3-12b": "llama-3.1-8b",
    "phi-4-mini": "llama-3.1-8b",
    "qwen3-1.7b": "llama-3.2-1b",
    "gemma-3-1b": "llama-3.2-1b",
}


# the config fields a Llama twin keeps: the sizes, nothing of the family's own parts
TWIN_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "rope_theta", "rms_norm_eps",
)  # fmt: skip


def llama_twin(shape: FamilyShape) -> FamilyShape:
    """A Llama of `shape`'s sizes (layers, widths, heads, head size, vocabulary, tied head): the
    row that tells what a family's own parts (q/k norm, sandwich norms, GeGLU, windows) cost in
    speed and memory, apart from its size. Not a published model; a diagnosis beside the goals,
    which hold each family against its published Llama peer."""
    config = {k: shape.config[k] for k in TWIN_KEYS if k in shape.config}
    config["tie_word_embeddings"] = ties_embeddings(shape.family, shape.config)
    return FamilyShape("LlamaForCausalLM", config, shape.job)


# family shape -> its Llama twin's name (`llama-as-<shape>`), for the families that differ from
# Llama in more than their sizes
LLAMA_TWIN = {
    name: f"llama-as-{name}" for name in ("qwen3-8b", "gemma-3-4b", "gemma-3-12b", "qwen3-1.7b", "gemma-3-1b")
}
FAMILY_SHAPES.update({twin: llama_twin(FAMILY_SHAPES[name]) for name, twin in LLAMA_TWIN.items()})


def random_family_model(name: str, max_positions: int = 8192, attn_implementation: str = "sdpa") -> Any:
    """The family's model at the shape `name`, random-init (seed 0), bf16 on the GPU, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    shape = FAMILY_SHAPES[name]
    # attn_implementation reaches PreTrainedConfig through **kwargs (as in bench/peers.py)
    kwargs = {
        **shape.config,
        "max_position_embeddings": max_positions,
        "attn_implementation": attn_implementation,
    }
    config = CONFIG_MAPPING[shape.family.model_type](**kwargs)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(torch.float32)
    assert type(model).__name__ == shape.architecture
    return model.eval()
