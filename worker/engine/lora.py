"""Our own LoRA layer, so that `gpu_kernels` owns its forward and backward.

For a frozen linear layer y = x·Wᵀ + b with W of shape (out, in), LoRA adds a low-rank update

    y = x·Wᵀ + b + s · (drop(x)·Aᵀ)·Bᵀ,     A: (r, in), B: (out, r)

with s = alpha / r (or alpha / √r with rsLoRA). A starts kaiming-uniform (a=√5, as nn.Linear and
PEFT), B starts at zero, so a freshly wrapped model computes exactly the base model. A and B are
kept in fp32 whatever the base dtype (bf16 on CUDA) so that small updates are not rounded away.

State dicts use PEFT's key names (`base_model.model.<module path>.lora_A.weight`), so an adapter
saved here loads with `peft.PeftModel.from_pretrained` and vice versa. The module path is the
one the base checkpoint's own model has: for the language model of a multimodal checkpoint
(marked `CHECKPOINT_PATHS` by the loader), its path inside the multimodal model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import gpu_kernels
from gpu_kernels.quant import FrozenWeight
from worker.engine.families import Multimodal
from worker.engine.quantize import QuantizedLinear, decoder_linear_paths, is_frozen_linear
from worker.engine.types import ConfigError, LoraConfig

PEFT_PREFIX = "base_model.model."
# attribute the loader sets on the causal LM it took out of a multimodal checkpoint: its Multimodal
CHECKPOINT_PATHS = "_loraq_multimodal"
ALL_LINEAR = "all-linear"


def lora_scale(cfg: LoraConfig) -> float:
    return cfg.alpha / math.sqrt(cfg.r) if cfg.use_rslora else cfg.alpha / cfg.r


def slot_operands(
    slot: tuple[gpu_kernels.AdapterCasts, int] | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The activation-dtype (A_cat, D) that a LoRA op's cast slot holds now, or None (no slot,
    or outside the casts' `in_step()`: the op casts for itself)."""
    return slot[0].operands(slot[1]) if slot is not None else None


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` (`.base`) plus trainable fp32 factors `lora_A` (r, in), `lora_B` (out, r).
    The base may be a QuantizedLinear (a quantized base, worker/engine/quantize.py): its weight
    is then a gpu_kernels.quant.FrozenWeight, which the LoRA op multiplies by tiles."""

    # (casts, i): op i of a model-wide AdapterCasts holds this layer's factors in the activation
    # dtype during a training step (worker.engine.fused_model.attach_adapter_casts)
    cast_slot: tuple[gpu_kernels.AdapterCasts, int] | None = None

    def __init__(self, base: nn.Linear | QuantizedLinear, r: int, scale: float, dropout: float = 0.0) -> None:
        super().__init__()
        if r < 1:
            raise ConfigError("lora.r", f"lora.r must be >= 1, got {r}")
        self.base = base
        self.r = r
        self.scale = scale
        self.dropout = dropout
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=device, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=device, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        if isinstance(base.weight, torch.Tensor):
            base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor | FrozenWeight:
        """The frozen base weight: code that inspects `module.weight` (dtype, device) keeps working."""
        return self.base.weight

    def adapters(self) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """(A, B, scale) of this layer, as the grouped LoRA op takes them."""
        return [(self.lora_A, self.lora_B, self.scale)]

    def op(self) -> gpu_kernels.LoRAOp:
        """This layer as the arguments of a LoRA op (gpu_kernels.lora_gated_mlp takes two)."""
        return gpu_kernels.LoRAOp(
            self.base.weight, self.base.bias, self.adapters(), self.dropout, slot_operands(self.cast_slot)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        operands = slot_operands(self.cast_slot)
        if operands is not None:
            return gpu_kernels.lora_linear_grouped(
                x, self.base.weight, self.base.bias, self.adapters(), self.dropout, self.training, operands
            )
        return gpu_kernels.lora_linear(
            x,
            self.base.weight,
            self.base.bias,
            self.lora_A,
            self.lora_B,
            self.scale,
            self.dropout,
            self.training,
        )

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """s·B·A, shape (out, in), fp32."""
        return self.scale * (self.lora_B @ self.lora_A)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, r={self.r}, "
            f"scale={self.scale:g}, dropout={self.dropout}"
        )


def select_targets(model: nn.Module, target_modules: list[str] | str) -> list[str]:
    """Module paths to wrap. Names match a module's leaf name ("q_proj") or a path suffix
    ("self_attn.q_proj"); a name matching no linear layer is an error naming it."""
    candidates = decoder_linear_paths(model)
    if isinstance(target_modules, str):
        if target_modules != ALL_LINEAR:
            raise ConfigError(
                "lora.target_modules",
                f"lora.target_modules must be a list of module names or {ALL_LINEAR!r}, "
                f"got {target_modules!r}",
            )
        selected = candidates
    else:
        if not target_modules:
            raise ConfigError("lora.target_modules", "lora.target_modules is empty")
        selected = []
        for name in candidates:
            if any(name == t or name.endswith("." + t) for t in target_modules):
                selected.append(name)
        matched = {t for t in target_modules if any(n == t or n.endswith("." + t) for n in selected)}
        missing = [t for t in target_modules if t not in matched]
        if missing:
            leaves = sorted({n.split(".")[-1] for n in candidates})
            raise ConfigError(
                "lora.target_modules",
                f"lora.target_modules {missing} match no linear layer of this model; "
                f"its linear layers are named {leaves}",
            )
    if not selected:
        raise ConfigError("lora.target_modules", "no linear layer to apply LoRA to")
    return selected


def target_leaf_names(model: nn.Module) -> list[str]:
    """Sorted leaf names of the wrapped modules (what adapter_config.json's target_modules lists)."""
    return sorted({name.split(".")[-1] for name in lora_modules(model)})


def apply_lora(model: nn.Module, cfg: LoraConfig) -> dict[str, LoRALinear]:
    """Freeze every parameter of `model`, then replace each target nn.Linear by a LoRALinear.

    Returns {module path: LoRALinear}. Adapters are created on each base layer's device in fp32.
    """
    if lora_modules(model):
        raise RuntimeError("model already has LoRA layers; call remove_lora first")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError("lora.dropout", f"lora.dropout must be in [0, 1), got {cfg.dropout}")
    for p in model.parameters():
        p.requires_grad_(False)
    scale = lora_scale(cfg)
    wrapped: dict[str, LoRALinear] = {}
    for path in select_targets(model, cfg.target_modules):
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        base = getattr(parent, leaf)
        assert is_frozen_linear(base)
        layer = LoRALinear(base, cfg.r, scale, cfg.dropout)
        setattr(parent, leaf, layer)
        wrapped[path] = layer
    return wrapped


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def remove_lora(model: nn.Module) -> int:
    """Put every wrapped nn.Linear back (unmerged), leaving the pristine base. Returns how many."""
    removed = 0
    for path, layer in list(lora_modules(model).items()):
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, leaf, layer.base)
        removed += 1
    return removed


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold W ← W + s·B·A into each base layer (computed in fp32, stored in W's dtype), then unwrap.
    A quantized base cannot take the fold (its codes would be re-rounded): load it dense to merge."""
    layers = lora_modules(model)
    quantized = [path for path, layer in layers.items() if isinstance(layer.base, QuantizedLinear)]
    if quantized:
        raise ValueError(f"cannot merge LoRA into a quantized base ({quantized[0]}); load the base dense")
    for layer in layers.values():
        w = layer.base.weight
        assert isinstance(w, torch.Tensor)
        w.copy_((w.float() + layer.delta_weight().to(w.device)).to(w.dtype))
    return remove_lora(model)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """A then B of each LoRA layer, in module order (a stable order for the optimizer state)."""
    params: list[nn.Parameter] = []
    for layer in lora_modules(model).values():
        params += [layer.lora_A, layer.lora_B]
    return params


def multimodal_of(model: nn.Module) -> Multimodal | None:
    """The multimodal checkpoint `model` is the language model of, or None."""
    found = getattr(model, CHECKPOINT_PATHS, None)
    return found if isinstance(found, Multimodal) else None


def checkpoint_path(model: nn.Module, path: str) -> str:
    """Module `path` of `model` as the base checkpoint's own model names it (PEFT's, vLLM's)."""
    multimodal = multimodal_of(model)
    return multimodal.checkpoint_path(path) if multimodal is not None else path


def model_path(model: nn.Module, path: str) -> str:
    """The inverse of `checkpoint_path`: a checkpoint's module path as `model` names it."""
    multimodal = multimodal_of(model)
    return multimodal.model_path(path) if multimodal is not None else path


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """{"base_model.model.<path>.lora_A.weight": (r, in), "...lora_B.weight": (out, r)}, fp32, CPU;
    <path> as the base checkpoint's model names the layer (`checkpoint_path`)."""
    state: dict[str, torch.Tensor] = {}
    for path, layer in lora_modules(model).items():
        key = PEFT_PREFIX + checkpoint_path(model, path)
        state[f"{key}.lora_A.weight"] = layer.lora_A.detach().float().cpu().contiguous()
        state[f"{key}.lora_B.weight"] = layer.lora_B.detach().float().cpu().contiguous()
    return state


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter weights saved by `lora_state_dict` (or PEFT) into the wrapped model.

    Every LoRA layer must be present in `state` with matching shapes, and `state` must hold no
    key for a layer the model lacks: a partial load would silently train or serve the wrong thing.
    """
    layers = lora_modules(model)
    expected: dict[str, torch.Tensor] = {}
    for path, layer in layers.items():
        key = PEFT_PREFIX + checkpoint_path(model, path)
        expected[f"{key}.lora_A.weight"] = layer.lora_A
        expected[f"{key}.lora_B.weight"] = layer.lora_B
    # PEFT may save with the adapter name inside the key: "...lora_A.default.weight".
    normalised = {
        k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
        for k, v in state.items()
    }
    missing = sorted(set(expected) - set(normalised))
    unexpected = sorted(set(normalised) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"adapter does not fit the model: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
        )
    for key, param in expected.items():
        value = normalised[key]
        if value.shape != param.shape:
            raise ValueError(
                f"adapter tensor {key} has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
            )
        param.copy_(value.to(device=param.device, dtype=param.dtype))
