"""Fast-path module surgery after `apply_lora`, for every family of worker/engine/families.py,
and the fused loss.

Applied only where gpu_kernels' compiled path is active (see `fuse_model`); the CPU path keeps
the plain modules. Module paths and parameter objects do not change, so LoRA state dicts,
checkpoints, PEFT export and the optimizer see exactly the same parameters. What differs between
families is read from their `Family` and the model's config (`families.layer_attention`), never
from class names. The modules inside each decoder layer are swapped; the stack then runs the layers
itself, by the family's norm placement (families.LAYER_NORMS: pre-norm, or Gemma's sandwich), so
that every residual add is one kernel with the norm that reads the sum (`_fused_residual_layers`);
a layer whose forward is wrapped (activation checkpointing) runs its own forward instead:

- RMSNorm modules -> FusedRMSNorm: one kernel forward, one backward (weight frozen), scaling by
  (offset + w) with the family's offset (Gemma: 1); in the stack, with the residual add before it
  (and Gemma's norm on the sublayer's output) in the same kernel (gpu_kernels.add_rms_norm)
- q/k/v and gate/up LoRA layers -> GroupedLoRALinear: the projections that read the same input
  run as ONE grouped op (one base GEMM over the stacked weight, one skinny GEMM for all A's);
  their base weights become views into the stacked weight, so no memory is added. Families whose
  checkpoints fuse them already (Phi-3's qkv_proj, gate_up_proj) run their one LoRA layer as is.
- the MLP -> FusedGatedMLP: down(act_packed(gate_up(x))) with the family's activation (SwiGLU,
  GeGLU), no split/concat copies; with LoRA on gate/up and down, one op (gpu_kernels.lora_gated_mlp)
  whose backward folds the LoRA reductions into the activation's and which keeps no act ⊙ up
- the attention -> FusedAttention: the q/k/v rows go through one kernel that splits them,
  applies the per-head q/k RMSNorm where the family has one (Qwen3, Gemma 3), and rotates the
  rotary dims (all, or Phi-4-mini's partial share) with the layer's RoPE table (Gemma 3: one per
  layer type); then variable-length flash attention with the layer's window (Mistral, Gemma 3's
  sliding layers: no dense mask), or SDPA with native grouped-query heads; Hugging Face's forward,
  called by keyword, still runs whenever the fast path does not apply (a mask, a KV cache under
  any of its names)
- the LM loss: chunked fused linear + cross-entropy on the final hidden states, so the
  (tokens, vocab) logits never exist at once (Gemma's 262k vocabulary included; tied heads too)

Called outside FusedAttention, the first of q/k/v computes all three and hands the other two
their (view) outputs, which they return when called with the same input tensor.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache

import gpu_kernels
from gpu_kernels.quant import stack_frozen
from worker.engine.families import (
    LAYER_NORMS,
    Activation,
    Family,
    LayerAttention,
    Norm,
    family_named,
    fused_path_gap,
    layer_attention,
)
from worker.engine.lora import LoRALinear, slot_operands
from worker.engine.types import ModelError


class FusedRMSNorm(nn.Module):
    """y = (offset + w) ⊙ x / sqrt(mean(x²) + eps) through gpu_kernels.rms_norm; x (..., D)."""

    def __init__(self, weight: nn.Parameter, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gpu_kernels.rms_norm(x, self.weight, self.variance_epsilon, self.offset)

    def after_residual(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor,
        delta_norm: FusedRMSNorm | None = None,
        keep_sum: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, gpu_kernels.NormSource | None]:
        """(h, this norm of h, its NormSource) with h = residual + delta, or residual +
        delta_norm(delta): one kernel each way (gpu_kernels.add_rms_norm) for a layer's residual
        step and the norm after. keep_sum=False: the backward forms h again from residual and
        delta (sandwich only), and there is no source. The source lets the LoRA ops reading the
        norm keep h and rstd, which the norm keeps, instead of the norm's output."""
        inner = (delta_norm.weight, delta_norm.variance_epsilon) if delta_norm is not None else None
        return gpu_kernels.add_rms_norm(
            residual, delta, self.weight, self.variance_epsilon, self.offset, inner, keep_sum
        )


def rms_norm_eps(module: nn.Module) -> float | None:
    """An RMSNorm module's epsilon, under either name transformers uses (`variance_epsilon`:
    Llama and most; `eps`: Gemma); None for a module that is no RMSNorm with a weight."""
    weight = getattr(module, "weight", None)
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, nn.Parameter):
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


class LoRAGroup:
    """Projections of one input: stacked base weight (Σ out, in) and the member layers in order."""

    def __init__(self, members: list[GroupedLoRALinear]) -> None:
        self.members = members
        self.widths = [m.out_features for m in members]
        with torch.no_grad():
            # (Σ out, in); dense: members' weights become its views; quantized: a StackedWeight
            stacked = stack_frozen([m.base.weight for m in members])
            if isinstance(stacked, torch.Tensor):
                for m, view in zip(members, stacked.split(self.widths), strict=True):
                    assert isinstance(m.base, nn.Linear)
                    m.base.weight = nn.Parameter(view, requires_grad=False)
            self.weight = stacked
            self.bias: torch.Tensor | None = None
            if any(m.base.bias is not None for m in members):
                biases = [
                    m.base.bias.detach()
                    if m.base.bias is not None
                    else torch.zeros(m.out_features, dtype=stacked.dtype, device=stacked.device)
                    for m in members
                ]
                self.bias = torch.cat(biases)
        # outputs handed from the leader to the other members: id(member) -> (input, output)
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cast_slot: tuple[gpu_kernels.AdapterCasts, int] | None = None  # see LoRALinear

    def adapters(self) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        return [adapter for m in self.members for adapter in m.adapters()]

    def op(self) -> gpu_kernels.LoRAOp:
        """The group as one LoRA op: stacked base, every member's adapters, the leader's dropout."""
        return gpu_kernels.LoRAOp(
            self.weight, self.bias, self.adapters(), self.members[0].dropout, slot_operands(self.cast_slot)
        )

    def forward_all(self, x: torch.Tensor, source: gpu_kernels.NormSource | None = None) -> torch.Tensor:
        """(..., in) -> (..., Σ out): every member's LoRA projection, stacked on the last dim;
        `source`: x is that norm's output (gpu_kernels.lora_linear_grouped)."""
        return self.op()(x, self.members[0].training, source)


class GroupedLoRALinear(LoRALinear):
    """A LoRALinear that belongs to a LoRAGroup (same parameters, same module path)."""

    group: LoRAGroup

    @classmethod
    def from_layer(cls, layer: LoRALinear) -> GroupedLoRALinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.base = layer.base
        new.r = layer.r
        new.scale = layer.scale
        new.dropout = layer.dropout
        new.lora_A = layer.lora_A  # the same Parameter objects: optimizer and state dicts unchanged
        new.lora_B = layer.lora_B
        new.train(layer.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group
        if group.members[0] is self:
            outs = group.forward_all(x).split(group.widths, dim=-1)
            group.pending = {id(m): (x, o) for m, o in zip(group.members[1:], outs[1:], strict=True)}
            return outs[0]
        handed = group.pending.pop(id(self), None)
        if handed is not None and handed[0] is x:
            return handed[1]
        return super().forward(x)  # called on its own (or out of order): the ungrouped op


class FusedGatedMLP(nn.Module):
    """down(act(gate(x)) ⊙ up(x)), act SiLU or tanh-GELU, with gate/up as one LoRA op (a grouped
    pair, or the family's fused gate_up_proj) and the activation fused on the packed [gate | up]."""

    def __init__(self, mlp: nn.Module, activation: Activation) -> None:
        super().__init__()
        for name, child in mlp.named_children():  # gate_proj/up_proj or gate_up_proj, down_proj
            if name not in ("act_fn", "activation_fn"):
                self.add_module(name, child)
        self.activation: Activation = activation

    def forward(self, x: torch.Tensor, source: gpu_kernels.NormSource | None = None) -> torch.Tensor:
        """`source`: x is that norm's output, so the LoRA ops on x need not keep it (the fused
        decoder stack passes it; gpu_kernels.lora_gated_mlp)."""
        down = cast(nn.Module, self.down_proj)
        packed = getattr(self, "gate_up_proj", None)
        if packed is not None:  # (..., 2F) = [gate | up] from one layer (Phi-3)
            if isinstance(packed, LoRALinear) and isinstance(down, LoRALinear):
                return gpu_kernels.lora_gated_mlp(
                    x, packed.op(), down.op(), self.activation, packed.training, source
                )
            return down(gpu_kernels.swiglu_packed(packed(x), self.activation))
        gate, up = cast(nn.Module, self.gate_proj), cast(nn.Module, self.up_proj)
        group = getattr(gate, "group", None)
        if group is None or up not in group.members:
            # gate/up were unwrapped (remove_lora / merge_lora): the plain gated MLP
            return down(gpu_kernels.swiglu(gate(x), up(x), self.activation))
        if isinstance(down, LoRALinear):  # the whole MLP as one op (its backward fused on the GPU)
            return gpu_kernels.lora_gated_mlp(
                x, group.op(), down.op(), self.activation, group.members[0].training, source
            )
        gate_up = group.forward_all(x, source)  # (..., 2F) = [gate | up]
        return down(gpu_kernels.swiglu_packed(gate_up, self.activation))


# config activation names (`hidden_act`, Gemma's `hidden_activation`) -> the fused kernel's
ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",  # the same tanh approximation, computed by hand
}


def config_activation(config: Any) -> str:
    """The gate activation a transformers config names."""
    return str(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu"))


# Names under which Hugging Face's attention has taken the KV cache: `past_key_value` (4.x),
# `past_key_values` (4.56-5.23), `cache` (5.24+). Any of them set means decoding with a cache,
# which the fast path (no cache update, causal over the call's own tokens) must never serve.
KV_CACHE_ARGS = ("cache", "past_key_values", "past_key_value")
# Keywords the fused forward hands to Hugging Face's by name: the installed signature must have them.
_HF_KEYWORDS = ("hidden_states", "position_embeddings", "attention_mask")


def uses_kv_cache(kwargs: dict[str, Any]) -> bool:
    if any(kwargs.get(name) is not None for name in KV_CACHE_ARGS):
        return True
    return any(isinstance(value, Cache) for value in kwargs.values())


def hf_attention_signature_ok(attn: nn.Module) -> str | None:
    """None when Hugging Face's attention forward can be called by keyword as the fused module
    does; otherwise why not (the module is then left unfused). Inspected once, at wrap time."""
    params = inspect.signature(type(attn).forward).parameters
    missing = [name for name in _HF_KEYWORDS if name not in params]
    if missing:
        return f"{type(attn).__name__}.forward has no parameter {', '.join(missing)}"
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return f"{type(attn).__name__}.forward takes no **kwargs"
    return None


class FusedAttention(nn.Module):
    """Self-attention on the fused path, for every family: one LoRA op for q/k/v (a grouped
    q/k/v, or the family's fused qkv_proj) -> one kernel for the split, the per-head q/k norm
    (Qwen3, Gemma 3) and RoPE -> causal attention within the layer's window -> o_proj. Keeps the
    Hugging Face module's submodules and attributes under their names, so its forward, called when
    the fast path does not apply, runs on this module unchanged."""

    def __init__(self, attn: nn.Module, layer: LayerAttention, family: Family) -> None:
        super().__init__()
        for name, child in attn.named_children():  # q/k/v/o_proj or qkv_proj, q_norm/k_norm
            self.add_module(name, child)
        for key, value in vars(attn).items():  # config, head_dim, scaling, layer_idx, ...
            if not key.startswith("_") and key != "training":
                setattr(self, key, value)
        config = cast(Any, attn).config
        self.n_heads = int(config.num_attention_heads)
        self.n_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(attn.head_dim)  # type: ignore[arg-type]
        self.scaling = float(attn.scaling)  # type: ignore[arg-type]
        self.attention_dropout = float(getattr(attn, "attention_dropout", 0.0))
        self.window = layer.window  # tokens a query sees, itself included; None: all before it
        # the rotary table this layer reads: one per layer type (Gemma 3), else the model's one
        self.rope_key: str | None = layer.kind if family.rope == "per_layer_type" else None
        self.qk_norm = family.qk_norm
        self.norm_offset = family.norm_offset
        self.norm_placement: Norm = family.norm  # how the decoder stack adds this layer's residuals
        self.packed_qkv = "qkv_proj" in family.packed_modules
        self.hf_forward: Callable[..., tuple[torch.Tensor, Any]] = type(attn).forward

    def _qkv(self) -> Callable[[torch.Tensor, gpu_kernels.NormSource | None], torch.Tensor] | None:
        """(..., d) -> (..., (H + 2G)·D) q/k/v rows as one LoRA op, while the LoRA layers are
        there; the second argument: the input is that norm's output (not kept by the op)."""
        if self.packed_qkv:
            layer = getattr(self, "qkv_proj", None)
            if not isinstance(layer, LoRALinear):
                return None
            packed: LoRALinear = layer

            def project(x: torch.Tensor, source: gpu_kernels.NormSource | None) -> torch.Tensor:
                return packed.op()(x, packed.training, source)

            return project
        group: LoRAGroup | None = getattr(self.q_proj, "group", None)
        if group is None or group.members != [self.q_proj, self.k_proj, self.v_proj]:
            return None
        return group.forward_all

    def _head_norm(self) -> gpu_kernels.HeadNorm | None:
        if not self.qk_norm:
            return None
        q_norm, k_norm = cast(nn.Module, self.q_norm), cast(nn.Module, self.k_norm)
        eps = rms_norm_eps(q_norm)
        assert eps is not None, "q_norm is an RMSNorm"
        return gpu_kernels.HeadNorm(
            cast(torch.Tensor, q_norm.weight), cast(torch.Tensor, k_norm.weight), eps, self.norm_offset
        )

    def _fast_qkv(
        self, attention_mask: Any, kwargs: dict[str, Any]
    ) -> Callable[[torch.Tensor, gpu_kernels.NormSource | None], torch.Tensor] | None:
        """The q/k/v op when the fast path applies: no mask and no KV cache in play (under any
        name a supported transformers version uses, or any argument that is a Cache)."""
        if (
            attention_mask is not None
            or uses_kv_cache(kwargs)
            or kwargs.get("output_attentions")
            or (self.training and self.attention_dropout > 0)
        ):
            return None
        return self._qkv()

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, S, d)
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin (1|B, S, R)
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        """`cu_seqlens` (K + 1,) int32 and `max_seqlen` (int) in kwargs: the B·S tokens are
        packed sequences at those offsets, and each attends only within its own sequence.
        `rope_positions` (B, S) int64 in kwargs: position_embeddings is one (1, P, R) table pair
        that token (b, s) reads at row rope_positions[b, s] (every entry < P). `norm_source` in
        kwargs: hidden_states is that norm's output (the fused decoder stack passes it), which
        the q/k/v op then does not keep."""
        norm_source: gpu_kernels.NormSource | None = kwargs.pop("norm_source", None)
        cu_seqlens: torch.Tensor | None = kwargs.pop("cu_seqlens", None)
        max_seqlen: int = kwargs.pop("max_seqlen", 0)
        rope_positions: torch.Tensor | None = kwargs.pop("rope_positions", None)
        qkv = None if args else self._fast_qkv(attention_mask, kwargs)
        if qkv is None or position_embeddings is None:
            if cu_seqlens is not None or rope_positions is not None:
                raise ValueError("packed sequences (cu_seqlens, rope_positions) need the fused attention")
            if args:  # a caller that passes more positionally follows the installed signature
                return self.hf_forward(
                    self, hidden_states, position_embeddings, attention_mask, *args, **kwargs
                )
            return self.hf_forward(
                self,
                hidden_states=hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                **kwargs,
            )
        b, s, _ = hidden_states.shape
        n_heads, n_kv = self.n_heads, self.n_kv_heads
        cos, sin = position_embeddings
        if cu_seqlens is None and (self.window is not None or self.qk_norm):
            # A window has no SDPA flag, and the q/k norm saves less in one op with the
            # variable-length kernel (gpu_kernels.rope_attention): each row is one sequence.
            cu_seqlens = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=hidden_states.device)
            max_seqlen = s
        if cu_seqlens is not None:
            out = gpu_kernels.rope_attention(  # (B·S, H, D)
                qkv(hidden_states, norm_source),
                cos,
                sin,
                n_heads,
                n_kv,
                cu_seqlens,
                max_seqlen,
                positions=rope_positions,
                norm=self._head_norm(),
                scale=self.scaling,
                window=self.window,
            )
            return cast(nn.Module, self.o_proj)(out.view(b, s, n_heads * self.head_dim)), None
        # q (B, H, S, D), k and v (B, G, S, D), stored as (B, S, heads, D) rows
        rows = qkv(hidden_states, norm_source)
        q, k, v = gpu_kernels.rope_qkv(rows, cos, sin, n_heads, n_kv, rope_positions)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=s > 1, scale=self.scaling, enable_gqa=n_kv != n_heads
        )  # (B, H, S, D)
        out = out.transpose(1, 2).reshape(b, s, n_heads * self.head_dim)
        return cast(nn.Module, self.o_proj)(out), None


@dataclass
class FuseReport:
    rms_norms: int = 0
    qkv_groups: int = 0
    attentions: int = 0
    mlps: int = 0
    skipped: list[str] = field(default_factory=list)


def _group(parent: nn.Module, names: list[str]) -> list[GroupedLoRALinear] | None:
    layers = [getattr(parent, n, None) for n in names]
    if not all(isinstance(m, LoRALinear) for m in layers):
        return None
    lora_layers = [m for m in layers if isinstance(m, LoRALinear)]
    first = lora_layers[0]
    same = all(
        m.dropout == first.dropout
        and m.base.weight.dtype == first.base.weight.dtype
        and m.base.weight.device == first.base.weight.device
        and m.in_features == first.in_features
        for m in lora_layers
    )
    if not same:
        return None
    members = [GroupedLoRALinear.from_layer(m) for m in lora_layers]
    for name, member in zip(names, members, strict=True):
        setattr(parent, name, member)
    group = LoRAGroup(members)
    for member in members:
        member.group = group
    return members


def fuse_model(model: nn.Module) -> FuseReport:
    """Swap in the fused modules where the compiled kernels are active and cover the model's
    family and config (`families.fused_path_gap`); otherwise a no-op report saying why not.
    What each family changes (norm offset, activation, q/k norm, fused projections, windows and
    RoPE tables per layer) is read from its `Family` and `layer_attention(family, config)`.

    Call after apply_lora and before building the optimizer (parameters are kept, but this keeps
    the order of operations obvious)."""
    report = FuseReport()
    if not gpu_kernels.available().compiled:
        report.skipped.append("compiled kernels not in use: " + gpu_kernels.available().reason)
        return report
    gap = family_gap(model)
    if gap is not None:  # the model keeps its plain modules: the eager step, as on the CPU
        report.skipped.append(gap)
        return report
    family = family_named(type(model).__name__)
    config = cast(Any, model).config
    layers = layer_attention(family, config.to_dict())
    activation = ACTIVATIONS.get(config_activation(config))
    for name, module in list(model.named_modules()):
        parent_path, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        eps = rms_norm_eps(module)
        if eps is not None and leaf not in ("q_norm", "k_norm"):  # those run inside the rope kernel
            setattr(parent, leaf, FusedRMSNorm(cast(nn.Parameter, module.weight), eps, family.norm_offset))
            report.rms_norms += 1
        elif type(module).__name__.endswith("Attention") and isinstance(
            getattr(module, "layer_idx", None), int
        ):
            layer = layers[cast(int, module.layer_idx)]
            _fuse_attention(name, module, parent, leaf, layer, family, report)
        elif type(module).__name__.endswith("MLP") and hasattr(module, "down_proj"):
            if activation is None:
                report.skipped.append(f"{name}: activation {config_activation(config)} has no fused kernel")
                continue
            if "gate_up_proj" in family.packed_modules:
                fits = isinstance(getattr(module, "gate_up_proj", None), LoRALinear)
            else:
                fits = _group(module, ["gate_proj", "up_proj"]) is not None
            if not fits:
                report.skipped.append(f"{name}: gate/up are not LoRA layers of one kind")
                continue
            setattr(parent, leaf, FusedGatedMLP(module, activation))
            report.mlps += 1
    return report


def _layer_index(module: nn.Module) -> object:
    return getattr(module, "layer_idx", None)


def _fuse_attention(
    name: str,
    module: nn.Module,
    parent: nn.Module,
    leaf: str,
    layer: LayerAttention,
    family: Family,
    report: FuseReport,
) -> None:
    if "qkv_proj" in family.packed_modules:  # one LoRA layer already computes q/k/v (Phi-3)
        fits = isinstance(getattr(module, "qkv_proj", None), LoRALinear)
    else:
        fits = _group(module, ["q_proj", "k_proj", "v_proj"]) is not None
    if not fits:
        report.skipped.append(f"{name}: q/k/v are not all LoRA layers of one kind")
        return
    report.qkv_groups += 1
    unfit = hf_attention_signature_ok(module)
    if unfit is None and int(cast(Any, module).head_dim) % 2:
        unfit = f"odd head size {module.head_dim}"
    if unfit is not None:
        report.skipped.append(f"{name}: {unfit}")
        return
    setattr(parent, leaf, FusedAttention(module, layer, family))
    report.attentions += 1


def family_gap(model: nn.Module) -> str | None:
    """Why the fused modules do not serve `model` (its family or its config) yet; None: they do."""
    try:
        family = family_named(type(model).__name__)
    except ModelError as exc:
        return str(exc)
    config = getattr(model, "config", None)
    return fused_path_gap(family, config.to_dict() if config is not None else {})


def attach_adapter_casts(model: nn.Module) -> gpu_kernels.AdapterCasts | None:
    """One AdapterCasts over every LoRA op of the model (each q/k/v or gate/up group, each
    ungrouped LoRA layer), wired into those ops: inside its `in_step()` they take their adapters
    in the activation dtype from it, refreshed by one launch, instead of casting them per call.
    None where the compiled kernels are not in use, or the ops' activation dtypes differ."""
    if not gpu_kernels.available().compiled:
        return None
    sites: list[LoRAGroup | LoRALinear] = []
    for module in model.modules():
        if isinstance(module, GroupedLoRALinear):
            if module.group.members[0] is module:
                sites.append(module.group)
        elif isinstance(module, LoRALinear):
            sites.append(module)
    dtypes = {site.weight.dtype for site in sites}
    if not sites or len(dtypes) != 1:
        return None
    casts = gpu_kernels.adapter_casts([site.adapters() for site in sites], dtypes.pop())
    if not casts.compiled:
        return None
    for i, site in enumerate(sites):
        site.cast_slot = (casts, i)
    return casts


def lm_loss_sum(selected: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """Σ cross-entropy of head(selected) (N, V) against targets (N,) (none ignored), fp32 0-d.

    On the compiled path the chunked fused kernel (no (N, V) logits); otherwise exactly
    head + F.cross_entropy(reduction="sum"), so CPU runs are unchanged."""
    if (
        gpu_kernels.available().compiled
        and isinstance(head, nn.Linear)
        and head.bias is None
        and not head.weight.requires_grad
    ):
        return gpu_kernels.fused_linear_cross_entropy(selected, head.weight, targets) * targets.numel()
    return F.cross_entropy(head(selected).float(), targets, reduction="sum")


def fused_stack(backbone: nn.Module) -> bool:
    """Whether a decoder stack's attention layers are all fused (the only kind
    `_fused_decoder_states` and packed attention run on)."""
    layers = getattr(backbone, "layers", None)
    parts = [getattr(backbone, name, None) for name in ("embed_tokens", "rotary_emb", "norm")]
    if not isinstance(layers, nn.ModuleList) or not all(isinstance(p, nn.Module) for p in parts):
        return False
    return all(isinstance(getattr(layer, "self_attn", None), FusedAttention) for layer in layers)


def _fused_decoder_states(
    backbone: nn.Module,
    input_ids: torch.Tensor,  # (B, S)
    position_ids: torch.Tensor | None = None,  # (B, S); None: 0..S-1 in every row
    final_norm: bool = True,  # False: the last layer's output, before the final RMSNorm
    **attention: Any,  # cu_seqlens, max_seqlen: packed sequences (see FusedAttention)
) -> torch.Tensor | None:
    """Final hidden states (B, S, d) of a decoder stack whose attention layers are all fused, run
    without Hugging Face's mask construction; None if the stack is not of that kind. The
    embedding module applies the family's scale (Gemma: × √d), each layer its norm placement.

    An all-causal batch needs no mask (SDPA's is_causal covers it), and a packed one gets its
    per-sequence offsets instead. Skipping the construction matters under CUDA-graph capture:
    there transformers materialises a (S, S) mask (it cannot look at the data while capturing),
    the fused attention has to fall back to the masked Hugging Face path, and cuDNN's masked
    attention backward runs ~1.6x slower."""
    if not fused_stack(backbone):
        return None
    layers = cast(nn.ModuleList, backbone.layers)
    embed, rotary, norm = (
        cast(nn.Module, getattr(backbone, n)) for n in ("embed_tokens", "rotary_emb", "norm")
    )
    hidden = embed(input_ids)  # (B, S, d)
    steps = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # (1, S)
    if position_ids is None:
        position_ids = steps
    elif "cu_seqlens" in attention:
        # Packed rows: positions restart at every sequence start, so each is < S. One (1, S, D)
        # table that the rope kernel reads by position replaces a (B, S, D) copy per row, which
        # the backward would keep alive through the whole step.
        attention = {**attention, "rope_positions": position_ids}
        position_ids = steps
    tables = _rope_tables(backbone, rotary, hidden, position_ids)  # layer type -> cos, sin (1|B, S, R)
    residual_norms = [_residual_norms(layer) for layer in layers]
    if isinstance(norm, FusedRMSNorm) and all(step is not None for step in residual_norms):
        return _fused_residual_layers(
            layers,
            cast(list[ResidualNorms], residual_norms),
            norm if final_norm else None,
            hidden,
            tables,
            attention,
        )
    for layer in layers:
        out = layer(
            hidden,
            attention_mask=None,
            position_ids=position_ids,
            position_embeddings=tables[cast(FusedAttention, layer.self_attn).rope_key],
            use_cache=False,
            **attention,
        )
        hidden = out[0] if isinstance(out, tuple) else out  # older transformers return tuples
    if not final_norm:
        return hidden
    states: torch.Tensor = norm(hidden)
    return states


@dataclass(frozen=True)
class ResidualNorms:
    """A decoder layer's norms as the fused residual steps read them (families.LAYER_NORMS):
    before attention, on attention's output (sandwich only), before the MLP, on the MLP's output
    (sandwich only)."""

    attention_in: FusedRMSNorm
    attention_out: FusedRMSNorm | None
    mlp_in: FusedRMSNorm
    mlp_out: FusedRMSNorm | None


def _residual_norms(layer: nn.Module) -> ResidualNorms | None:
    """The layer's norms, or None where the layer must run its own forward: the forward replaced
    on the instance (activation checkpointing wraps it), a norm not fused, or a residual dropout
    that is live (Phi-3's resid_pdrop while training)."""
    attention = getattr(layer, "self_attn", None)
    if not isinstance(attention, FusedAttention) or "forward" in vars(layer):
        return None
    if any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in layer.children()):
        return None
    norms = [getattr(layer, name, None) for name in LAYER_NORMS[attention.norm_placement]]
    fused = [n for n in norms if isinstance(n, FusedRMSNorm)]
    if len(fused) != len(norms):
        return None
    if len(fused) == 2:  # pre-norm
        return ResidualNorms(fused[0], None, fused[1], None)
    return ResidualNorms(fused[0], fused[1], fused[2], fused[3])


def _fused_residual_layers(
    layers: nn.ModuleList,
    norms: list[ResidualNorms],
    final: FusedRMSNorm | None,  # None: return the stream after the last layer, unnormalised
    hidden: torch.Tensor,  # (B, S, d): the embeddings
    tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
    attention: dict[str, Any],
) -> torch.Tensor:
    """The decoder layers with every residual add fused with the norm that reads the sum: the
    layer's own (before its MLP), the next layer's (before its attention) or the final one, and,
    with sandwich norms, the norm on the sublayer's output before the add. The same ops as each
    layer's forward (families' formulas), in the same order; a layer's 4 (pre-norm) or 6
    (sandwich) norm and add kernels become 2 each way.

    With sandwich norms the step after attention keeps no sum: its backward forms the sum again
    from the layer's input stream (kept by the step before; the first layer's embeddings, which
    nothing else keeps, are kept here instead of the sum) and attention's output (kept for the
    sandwich norm). A sandwich layer then keeps one (tokens, d) tensor more than a pre-norm layer
    instead of two: both sublayer outputs (for their sandwich norms) less the sum between them.

    Each norm whose sum is kept hands its NormSource to the LoRA ops that read its output (q/k/v
    after the attention norm, gate/up after the MLP norm), and those keep the sum and rstd the
    norm keeps instead of that output: two (tokens, d) tensors a layer less with pre-norms, one
    with sandwich norms (the MLP norm's sum is formed again, so its output stays kept), none for
    the first layer's attention norm (its input, the embeddings, is not kept by the norm)."""
    normed = norms[0].attention_in(hidden)
    source = None  # the first norm's: its input, the embeddings, is not kept by the op
    for i, (layer, step) in enumerate(zip(layers, norms, strict=True)):
        attn = cast(FusedAttention, layer.self_attn)
        out, _ = attn(normed, tables[attn.rope_key], None, norm_source=source, **attention)
        hidden, normed, source = step.mlp_in.after_residual(hidden, out, step.attention_out, keep_sum=False)
        mlp = cast(nn.Module, layer.mlp)
        out = mlp(normed, source) if isinstance(mlp, FusedGatedMLP) else mlp(normed)
        following = norms[i + 1].attention_in if i + 1 < len(norms) else final
        if following is None:  # the last layer's output, before the final norm
            last: torch.Tensor = hidden + (step.mlp_out(out) if step.mlp_out is not None else out)
            return last
        hidden, normed, source = following.after_residual(hidden, out, step.mlp_out)
    return normed


def _rope_tables(
    backbone: nn.Module, rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor
) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
    """The cos/sin tables of every rope key the stack's layers read: None (the model's one table)
    or a layer type (Gemma 3: local base on sliding layers, global base and scaling on the rest),
    each computed once per forward."""
    keys = {cast(FusedAttention, layer.self_attn).rope_key for layer in cast(nn.ModuleList, backbone.layers)}
    tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in keys:
        if key is None:
            tables[key] = rotary(hidden, position_ids=position_ids)
        elif "layer_type" in inspect.signature(rotary.forward).parameters:  # transformers 5
            tables[key] = rotary(hidden, position_ids=position_ids, layer_type=key)
        else:  # transformers 4: a second module for the sliding layers
            local = getattr(backbone, "rotary_emb_local", rotary) if key == "sliding_attention" else rotary
            tables[key] = local(hidden, position_ids=position_ids)
    return tables


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a *ForCausalLM over labels != -100, shape ().

    Same value as `model(input_ids, labels=labels).loss`: position t predicts labels[t + 1];
    the last position of each row predicts nothing. The LM head runs inside the chunked fused
    loss (gpu_kernels.fused_linear_cross_entropy) instead of forming all logits."""
    backbone = getattr(model, "base_model")  # noqa: B009 (the decoder stack, LlamaModel for Llama)
    hidden = _fused_decoder_states(backbone, input_ids)  # (B, S, d)
    if hidden is None:
        hidden = backbone(input_ids=input_ids, use_cache=False).last_hidden_state
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)  # (B, S)
    head = getattr(model, "get_output_embeddings")()  # noqa: B009 (nn.Module's __getattr__ types it as Tensor)
    assert isinstance(head, nn.Linear)
    return gpu_kernels.fused_linear_cross_entropy(hidden, head.weight, targets)


@dataclass
class PackedInputs:
    """Static device buffers of a packed step: k micro-batches of B rows of S tokens."""

    input_ids: torch.Tensor  # (k, B, S) int32
    position_ids: torch.Tensor  # (k, B, S) int64, restarting at 0 at every sequence start
    cu_seqlens: torch.Tensor  # (k, K + 1) int32, sequence offsets into the flattened B·S tokens
    max_seqlen: int  # bound on every sequence's length (S)
    loss_index: torch.Tensor  # (k, M) int64, flat positions whose next token carries loss
    loss_targets: torch.Tensor  # (k, M) int64, those next tokens (-100 on unused entries)
    loss_scale: torch.Tensor  # () fp32, 1 / trainable tokens of the whole step


def packed_lm_loss(model: nn.Module, inputs: PackedInputs, i: int) -> torch.Tensor:
    """Σ CE over micro-batch i's trainable tokens × inputs.loss_scale, shape (), fp32.

    Every sequence attends only to itself (variable-length attention over cu_seqlens, no mask),
    and the final norm and LM head run on the M gathered trainable positions only: hidden
    (B, S, d) → (B·S, d) → (M, d) → RMSNorm → chunked fused linear + cross-entropy. Gathering
    by a host-built index keeps the shapes static and reads nothing back to the host."""
    backbone = getattr(model, "base_model")  # noqa: B009
    head = getattr(model, "get_output_embeddings")()  # noqa: B009
    assert isinstance(head, nn.Linear)
    rows = _trained_rows(backbone, inputs, i)  # (M, d)
    # the final RMSNorm is row-wise, so on the gathered rows it gives the same values; it keeps
    # its input for the M rows only
    selected = cast(nn.Module, backbone.norm)(rows)  # (M, d)
    return gpu_kernels.fused_linear_cross_entropy(
        selected, head.weight, inputs.loss_targets[i], scale=inputs.loss_scale
    )


def packed_loss_states(model: nn.Module, inputs: PackedInputs, i: int) -> torch.Tensor:
    """Micro-batch i's final hidden states at its M loss positions, (M, d), after the final norm:
    what `packed_lm_loss` feeds the head. A step objective other than the cross-entropy (DPO,
    worker/engine/preference.py) takes its per-token log-probabilities from here."""
    backbone = getattr(model, "base_model")  # noqa: B009
    states: torch.Tensor = cast(nn.Module, backbone.norm)(_trained_rows(backbone, inputs, i))
    return states


def _trained_rows(backbone: nn.Module, inputs: PackedInputs, i: int) -> torch.Tensor:
    """The last decoder layer's output at micro-batch i's M loss positions, (M, d); unused index
    entries read row 0 and carry no loss.

    The full (B·S, d) output dies with this frame (the gather's backward keeps only the index),
    so the norm and the loss, the step's memory high point, run without it: a (B·S, d) tensor
    less than the fixed-shape step, whose final norm keeps it."""
    hidden = _fused_decoder_states(
        backbone,
        inputs.input_ids[i],
        inputs.position_ids[i],
        final_norm=False,
        cu_seqlens=inputs.cu_seqlens[i],
        max_seqlen=inputs.max_seqlen,
    )
    if hidden is None:
        raise ValueError("packed training needs a fused decoder stack (see fuse_model)")
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, inputs.loss_index[i])
