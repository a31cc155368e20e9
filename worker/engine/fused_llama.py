"""Fast-path module surgery for Llama-family models after `apply_lora`, and the fused loss.

Applied only where gpu_kernels' compiled path is active (see `fuse_llama`); the CPU path keeps
the plain modules. Module paths and parameter objects do not change, so LoRA state dicts,
checkpoints, PEFT export and the optimizer see exactly the same parameters.

- RMSNorm modules  -> FusedRMSNorm: one kernel forward, one backward (weight frozen)
- q/k/v and gate/up LoRA layers -> GroupedLoRALinear: the projections that read the same input
  run as ONE grouped op (one base GEMM over the stacked weight, one skinny GEMM for all A's);
  their base weights become views into the stacked weight, so no memory is added
- LlamaMLP -> FusedSwiGLUMLP: down(swiglu_packed(gate_up(x))), no split/concat copies
- the LM loss: chunked fused linear + cross-entropy on the final hidden states, so the
  (tokens, vocab) logits never exist at once

- LlamaAttention -> FusedLlamaAttention: the grouped q/k/v output goes through one RoPE kernel
  that splits and rotates it (gpu_kernels.rope_qkv), then SDPA with native grouped-query heads;
  Hugging Face's forward, called by keyword, still runs whenever the fast path does not apply
  (a mask, a KV cache under any of its names)

Called outside FusedLlamaAttention, the first of q/k/v computes all three and hands the other two
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
from worker.engine.families import family_named, fused_path_gap
from worker.engine.lora import LoRALinear, slot_operands
from worker.engine.types import ModelError


class FusedRMSNorm(nn.Module):
    """y = w ⊙ x / sqrt(mean(x²) + eps) through gpu_kernels.rms_norm; x (..., D)."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gpu_kernels.rms_norm(x, self.weight, self.variance_epsilon)


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

    def forward_all(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., Σ out): every member's LoRA projection, stacked on the last dim."""
        lead = self.members[0]
        operands = slot_operands(self.cast_slot)
        return gpu_kernels.lora_linear_grouped(
            x, self.weight, self.bias, self.adapters(), lead.dropout, lead.training, operands
        )


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


class FusedSwiGLUMLP(nn.Module):
    """down(silu(gate(x)) ⊙ up(x)) with gate/up as one grouped LoRA op and a fused SwiGLU."""

    def __init__(
        self, gate_proj: GroupedLoRALinear, up_proj: GroupedLoRALinear, down_proj: nn.Module
    ) -> None:
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = getattr(self.gate_proj, "group", None)
        if group is None or self.up_proj not in group.members:
            # gate/up were unwrapped (remove_lora / merge_lora): the plain SwiGLU MLP
            return self.down_proj(gpu_kernels.swiglu(self.gate_proj(x), self.up_proj(x)))
        gate_up = group.forward_all(x)  # (..., 2F) = [gate | up]
        return self.down_proj(gpu_kernels.swiglu_packed(gate_up))


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


class FusedLlamaAttention(nn.Module):
    """Llama self-attention on the fused path: grouped q/k/v LoRA op -> RoPE split kernel ->
    SDPA (causal, GQA without repeating k/v) -> o_proj. Same submodules and parameters as the
    Hugging Face module it replaces, whose forward it calls when the fast path does not apply."""

    def __init__(self, attn: Any) -> None:  # a transformers LlamaAttention
        super().__init__()
        self.config = attn.config
        self.n_heads = int(attn.config.num_attention_heads)
        self.n_kv_heads = int(attn.config.num_key_value_heads)
        self.layer_idx = attn.layer_idx
        self.head_dim = int(attn.head_dim)
        self.num_key_value_groups = attn.num_key_value_groups
        self.scaling = float(attn.scaling)
        self.attention_dropout = float(attn.attention_dropout)
        self.is_causal = True
        self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj
        self.o_proj: nn.Module = attn.o_proj
        self.hf_forward: Callable[..., tuple[torch.Tensor, Any]] = type(attn).forward

    def _fast_group(self, attention_mask: Any, kwargs: dict[str, Any]) -> LoRAGroup | None:
        """The q/k/v group when the fast path applies: no mask and no KV cache in play (under
        any name a supported transformers version uses, or any argument that is a Cache)."""
        group: LoRAGroup | None = getattr(self.q_proj, "group", None)
        if (
            group is None
            or group.members != [self.q_proj, self.k_proj, self.v_proj]
            or attention_mask is not None
            or uses_kv_cache(kwargs)
            or kwargs.get("output_attentions")
            or (self.training and self.attention_dropout > 0)
        ):
            return None
        return group

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, S, d)
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin (1|B, S, D)
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        """`cu_seqlens` (K + 1,) int32 and `max_seqlen` (int) in kwargs: the B·S tokens are
        packed sequences at those offsets, and each attends only within its own sequence.
        `rope_positions` (B, S) int64 in kwargs: position_embeddings is one (1, P, D) table pair
        that token (b, s) reads at row rope_positions[b, s] (every entry < P)."""
        cu_seqlens: torch.Tensor | None = kwargs.pop("cu_seqlens", None)
        max_seqlen: int = kwargs.pop("max_seqlen", 0)
        rope_positions: torch.Tensor | None = kwargs.pop("rope_positions", None)
        group = None if args else self._fast_group(attention_mask, kwargs)
        if group is None or position_embeddings is None:
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
        # q (B, H, S, D), k and v (B, G, S, D), stored as (B, S, heads, D) rows
        q, k, v = gpu_kernels.rope_qkv(
            group.forward_all(hidden_states), cos, sin, n_heads, n_kv, rope_positions
        )
        if cu_seqlens is not None:
            # (B, S, heads, D) rows are already the packed (B·S, heads, D) layout: views, no copies
            qp, kp, vp = (t.transpose(1, 2).reshape(b * s, t.shape[1], self.head_dim) for t in (q, k, v))
            out = gpu_kernels.varlen_attention(
                qp, kp, vp, cu_seqlens, max_seqlen, self.scaling
            )  # (B·S, H, D)
            return self.o_proj(out.view(b, s, n_heads * self.head_dim)), None
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=s > 1, scale=self.scaling, enable_gqa=n_kv != n_heads
        )  # (B, H, S, D)
        out = out.transpose(1, 2).reshape(b, s, n_heads * self.head_dim)
        return self.o_proj(out), None


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


def fuse_llama(model: nn.Module) -> FuseReport:
    """Swap in the fused modules where the compiled kernels are active and cover the model's
    family and config (`families.fused_path_gap`); otherwise a no-op report saying why not.

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
    for name, module in list(model.named_modules()):
        parent_path, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        cls = type(module).__name__
        if cls.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            weight = module.weight
            assert isinstance(weight, nn.Parameter)
            setattr(parent, leaf, FusedRMSNorm(weight, float(module.variance_epsilon)))
            report.rms_norms += 1
        elif cls.endswith("Attention") and hasattr(module, "q_proj"):
            if _group(module, ["q_proj", "k_proj", "v_proj"]) is not None:
                report.qkv_groups += 1
                unfit = hf_attention_signature_ok(module) if cls == "LlamaAttention" else cls
                if unfit is None and module.head_dim % 2 == 0:
                    setattr(parent, leaf, FusedLlamaAttention(module))
                    report.attentions += 1
                elif unfit is not None and cls == "LlamaAttention":
                    report.skipped.append(f"{name}: {unfit}")
            else:
                report.skipped.append(f"{name}: q/k/v are not all LoRA layers of one kind")
        elif cls.endswith("MLP") and hasattr(module, "gate_proj"):
            act = type(getattr(module, "act_fn", None)).__name__
            if act != "SiLUActivation" and act != "SiLU":
                report.skipped.append(f"{name}: activation {act} is not SiLU")
                continue
            members = _group(module, ["gate_proj", "up_proj"])
            if members is None:
                report.skipped.append(f"{name}: gate/up are not both LoRA layers of one kind")
                continue
            setattr(parent, leaf, FusedSwiGLUMLP(members[0], members[1], module.down_proj))
            report.mlps += 1
    return report


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
    """Whether a decoder stack is a Llama stack whose attention layers are all fused (the only
    kind `_fused_decoder_states` and packed attention run on)."""
    layers = getattr(backbone, "layers", None)
    parts = [getattr(backbone, name, None) for name in ("embed_tokens", "rotary_emb", "norm")]
    if not isinstance(layers, nn.ModuleList) or not all(isinstance(p, nn.Module) for p in parts):
        return False
    return all(isinstance(getattr(layer, "self_attn", None), FusedLlamaAttention) for layer in layers)


def _fused_decoder_states(
    backbone: nn.Module,
    input_ids: torch.Tensor,  # (B, S)
    position_ids: torch.Tensor | None = None,  # (B, S); None: 0..S-1 in every row
    final_norm: bool = True,  # False: the last layer's output, before the final RMSNorm
    **attention: Any,  # cu_seqlens, max_seqlen: packed sequences (see FusedLlamaAttention)
) -> torch.Tensor | None:
    """Final hidden states (B, S, d) of a Llama stack whose attention layers are all fused, run
    without Hugging Face's mask construction; None if the stack is not of that kind.

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
    position_embeddings = rotary(hidden, position_ids=position_ids)  # cos, sin (1 or B, S, D)
    for layer in layers:
        out = layer(
            hidden,
            attention_mask=None,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            use_cache=False,
            **attention,
        )
        hidden = out[0] if isinstance(out, tuple) else out  # older transformers return tuples
    if not final_norm:
        return hidden
    states: torch.Tensor = norm(hidden)
    return states


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
        raise ValueError("packed training needs a fused Llama stack (see fuse_llama)")
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, inputs.loss_index[i])
