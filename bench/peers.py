"""The HF transformers + PEFT peer model that every training benchmark compares against.

One construction for the fixed-batch peers (bench/train_bench.py, with Liger or torch.compile
applied by the caller) and the job-path peers (bench/job_bench.py), so their rows measure the
same model: a random-init Llama of the catalog preset's shape in bf16 on the GPU, LoRA r=16 on
every linear layer, fp32 adapters, fused AdamW.
"""

from __future__ import annotations

from typing import Any

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_peer_model(preset: str, max_positions: int, device: str = "cuda") -> tuple[Any, list[Any], Any]:
    """(peft_model, trainable params, optimizer) for `preset`, positions up to `max_positions`
    (a catalog preset on `device`; family shapes are built on the GPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.family_shapes import FAMILY_SHAPES, random_family_model
    from worker.engine.catalog import PRESET_SHAPES

    if preset in FAMILY_SHAPES:  # another family's real shape (bench/family_shapes.py)
        model = random_family_model(preset, max_positions)
        return with_lora(model, FAMILY_SHAPES[preset].targets())
    # attn_implementation reaches PreTrainedConfig through **kwargs: transformers 5's LlamaConfig
    # (a dataclass) does not name it in its signature
    kwargs = {**PRESET_SHAPES[preset].config_kwargs(), "attn_implementation": "sdpa"}
    cfg = LlamaConfig(**kwargs)
    cfg.max_position_embeddings = max_positions
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return with_lora(model, TARGETS)


def with_lora(model: Any, targets: list[str]) -> tuple[Any, list[Any], Any]:
    """PEFT LoRA r=16/alpha=32 on `targets` of `model`, fp32 adapters, fused AdamW:
    (peft_model, trainable params, optimizer)."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets)
    )
    params = [p for p in peft_model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()  # fp32 adapters over the bf16 base
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    return peft_model, params, opt
