"""The memory plan of a training step: its predicted peak GPU bytes, and the cheapest way to keep
that peak under a share of the GPU (default 90 %). Pure Python: the API's dry run and submit
check use it before any GPU is claimed, and the engine obeys it (worker/engine/step_memory.py).

What a step keeps on the GPU (activations in bf16, b = 2 bytes; h = hidden, k·d = the k/v width,
i = intermediate, L = layers, V = vocabulary, T = tokens of one micro-batch = micro_rows × seq):

    weights      each decoder linear: 2 bytes a weight dense, or its packed size (nf4: 4 bits +
                 an fp32 absmax per 64; int8: 1 byte + an fp32 scale per row; gguf: the file's
                 bits per weight); embeddings, norms and the LM head stay dense (2 bytes)
    adapter      P = Σ_targets r·(in + out) parameters: fp32 weight, gradient and AdamW's two
                 moments (16 bytes) plus the bf16 copy the step multiplies by (2): 18·P
    activations  per token and decoder layer, what autograd saves with nothing checkpointed:
                 a = b·(6h + 2·k·d + 3i) + b·r·(targets a layer)
                 (the two norms' inputs and outputs, q, k, v, the attention output, gate, up
                 and their product); one layer's are alive again while it is recomputed. Where
                 the fused LoRA MLP op serves the step (rank ≤ 16 on gate, up and down, no
                 dropout; a dense or a quantized base: gpu_kernels.ops.lora_mlp) the product is
                 not kept: 2i for 3i, and the MLP's x·Aᵀ are 16 wide (ranks under 16 padded)
        none       L·(a − b·s·h)·T, s the norm outputs whose LoRA ops keep the norm's input
                   instead (gpu_kernels/ops/norm_source.py; no LoRA dropout): q/k/v's norm, and
                   gate/up's with pre-norms (a sandwich MLP norm keeps no input to form it from)
        selective  L·(a − b·3i − b·r·m − b·q·h)·T + b·(h + 3i)·T  (each MLP recomputed in the
                   backward: its gate, up and product, and its m LoRA targets' x·Aᵀ, are not
                   kept; its input, the second norm's output, still is, by the checkpoint; q: the
                   attention norm's output, not kept as under none)
        full       L·b·h·T + a·T                        (each layer recomputed from its input)
        full + offload: the layer inputs wait in host memory: 2·b·h·T + a·T
    loss         the chunked LM head's logits (CHUNK_BYTES, gpu_kernels.ops.cross_entropy) and
                 the final hidden states of the micro-batch: b·h·T + 200 MiB
    workspace    512 MiB (cuBLAS workspaces, the allocator's rounding, NCCL on several GPUs)

tests/engine/test_memory_plan.py checks the prediction against the measured peaks of
bench/results (service/estimates.py's table) within 15 %.

The plan picks, among micro-batch sizes (the batch's rows split into micro-batches whose losses
add up to the same Σ CE / N) and checkpointing modes, the one of least relative compute cost
that fits: recomputation costs 1.0 (none), 1.15 (selective), 1.33 (full), 1.4 (full + offload)
times a penalty for micro-batches of fewer than 4,096 tokens (GEMMs that small run below speed):
1 + 0.1 per halving below.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Checkpointing = Literal["none", "selective", "full"]
CHECKPOINTING: tuple[Checkpointing, ...] = ("none", "selective", "full")

BF16 = 2
GIB = 2**30
DEFAULT_SHARE = 0.9  # the plan keeps the predicted peak under this share of the GPU's memory
WORKSPACE_BYTES = 512 << 20
LOSS_CHUNK_BYTES = 200 << 20  # gpu_kernels.ops.cross_entropy.CHUNK_BYTES (the API imports no torch)
EFFICIENT_TOKENS = 4096  # micro-batches of fewer tokens run their GEMMs below speed
RECOMPUTE_COST = {
    ("none", False): 1.0,
    ("selective", False): 1.15,
    ("full", False): 1.33,
    ("full", True): 1.4,
}
# bits a weight of each GGUF block type holds (block bytes · 8 / weights a block)
GGUF_BITS = {
    "Q4_0": 4.5,
    "Q4_1": 5.0,
    "Q5_0": 5.5,
    "Q5_1": 6.0,
    "Q8_0": 8.5,
    "Q4_K": 4.5,
    "Q5_K": 5.5,
    "Q6_K": 6.5625,
}
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_LINEAR = ("gate_proj", "up_proj", "down_proj")
# the largest rank the fused LoRA MLP op serves (gpu_kernels.ops.lora_mlp.RANK: the plan loads no torch)
FUSED_MLP_RANK = 16


@dataclass(frozen=True)
class ModelDims:
    """The sizes a memory plan needs, from a config.json (or a preset's LlamaConfig keys)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    sandwich: bool = False  # Gemma's norms on each sublayer's output too (families.LAYER_NORMS)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelDims:
        """A multimodal checkpoint's config gives its language model's dims (what trains)."""
        # imported here: families imports this module through the engine's types
        from worker.engine.families import text_config

        config = text_config(config, "config.json")
        h, n = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(
            hidden=h,
            layers=int(config["num_hidden_layers"]),
            heads=n,
            kv_heads=int(config.get("num_key_value_heads") or n),
            head_dim=int(config.get("head_dim") or h // n),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            **_family_traits(config),
        )

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each decoder linear of one layer, by LoRA target name."""
        h, q, kv, i = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def dense_parameters(self) -> int:
        """Embeddings, norms and LM head: what stays dense on a quantized base."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + (2 * self.layers + 1) * self.hidden


def _family_traits(config: Mapping[str, Any]) -> dict[str, bool]:
    """`tied`: tie_word_embeddings, or the family's default where the config.json leaves it out (a
    Gemma 3 head counted twice would add vocab·hidden·2 bytes: 1.25 GiB at 4B). `sandwich`: the
    family puts a norm on each sublayer's output too."""
    # imported here: families imports this module through the engine's types
    from worker.engine.families import family_in_config, ties_embeddings

    family = family_in_config(config)
    return {
        "tied": ties_embeddings(family, config),
        "sandwich": family is not None and family.norm == "sandwich",
    }


@dataclass(frozen=True)
class MemoryChoice:
    """How the engine runs a step: rows per forward pass (None: the whole micro-batch), which
    activations it recomputes, and whether the checkpointed ones wait in host memory."""

    micro_rows: int | None = None
    checkpointing: Checkpointing = "none"
    offload: bool = False

    def words(self) -> str:
        rows = f"micro-batches of {self.micro_rows} row(s)" if self.micro_rows else "whole micro-batches"
        ckpt = {
            "none": "no activation checkpointing",
            "selective": "selective activation checkpointing (MLPs recomputed)",
            "full": "full activation checkpointing (every layer recomputed)",
        }
        return f"{rows}, {ckpt[self.checkpointing]}" + (
            ", checkpointed activations offloaded to CPU" if self.offload else ""
        )


@dataclass(frozen=True)
class MemoryPlan:
    choice: MemoryChoice
    peak_bytes: int  # predicted
    limit_bytes: int  # share × the GPU's memory
    fits: bool
    breakdown: dict[str, int]  # weights, adapter, activations, loss, workspace

    def sentence(self) -> str:
        """The plan in words, as the dry run and a job's first event say it."""
        peak, limit = self.peak_bytes / GIB, self.limit_bytes / GIB
        if not self.fits:
            return (
                f"does not fit: predicted peak {peak:.1f} GiB even with {self.choice.words()}, "
                f"over {limit:.1f} GiB"
            )
        return f"predicted peak {peak:.1f} GiB of {limit:.1f} GiB allowed, with {self.choice.words()}"


def weight_bytes(dims: ModelDims, quantization: str | None, gguf_bits: float | None = None) -> int:
    """Bytes of the frozen weights on the GPU."""
    linear = 0
    for n_in, n_out in dims.linears().values():
        n = n_in * n_out
        if quantization == "nf4":
            linear += n // 2 + (n // 64) * 4
        elif quantization == "int8":
            linear += n + n_out * 4
        elif quantization == "gguf":
            linear += math.ceil(n * (gguf_bits or GGUF_BITS["Q4_K"]) / 8)
        else:
            linear += n * BF16
    return dims.layers * linear + dims.dense_parameters() * BF16


def targeted(dims: ModelDims, targets: list[str] | str) -> dict[str, tuple[int, int]]:
    """The linears of one layer LoRA wraps (names as lora.target_modules: leaf or path suffix)."""
    if targets == "all-linear":
        return dims.linears()
    names = [t.split(".")[-1] for t in targets]
    return {name: shape for name, shape in dims.linears().items() if name in names}


def predict_peak(
    dims: ModelDims,
    *,
    rank: int,
    targets: list[str] | str,
    micro_tokens: int,
    choice: MemoryChoice,
    quantization: str | None = None,
    gguf_bits: float | None = None,
    dropout: float = 0.0,
) -> dict[str, int]:
    """The step's predicted peak bytes by part (the module docstring's terms); "total" sums them.
    `dropout`: the LoRA input's (a step with dropout takes the unfused MLP)."""
    h, i, kv = dims.hidden, dims.intermediate, dims.kv_heads * dims.head_dim
    lora = targeted(dims, targets)
    adapter = 18 * dims.layers * sum(rank * (n_in + n_out) for n_in, n_out in lora.values())
    # gpu_kernels.lora_gated_mlp's conditions, as far as the plan can know them (a quantized base
    # runs the op's base GEMMs over its dequantized tiles)
    fused_mlp = rank <= FUSED_MLP_RANK and dropout == 0 and set(MLP_LINEAR) <= set(lora)
    kept_i = 2 * i if fused_mlp else 3 * i  # gate and up (and, unfused, their product)
    mlp_targets = sum(1 for name in lora if name in MLP_LINEAR)
    mlp_rank = FUSED_MLP_RANK if fused_mlp else rank  # the fused op pads its x·Aᵀ to 16 columns
    lora_inputs = BF16 * (rank * (len(lora) - mlp_targets) + mlp_rank * mlp_targets)
    per_token = BF16 * (6 * h + 2 * kv) + BF16 * kept_i + lora_inputs  # one layer, nothing checkpointed
    mlp_dropped = BF16 * kept_i + BF16 * mlp_rank * mlp_targets  # what a checkpointed MLP does not keep
    mlp = BF16 * (h + 3 * i)  # one MLP's tensors, alive again while it is recomputed
    layers, t = dims.layers, micro_tokens
    # norm outputs not kept where the fused stack hands their NormSource to the LoRA ops reading
    # them: q/k/v's, and gate/up's with pre-norms unless the MLP is checkpointed (the checkpoint
    # keeps its input)
    attention_sourced = dropout == 0 and bool({"q_proj", "k_proj", "v_proj"} & set(lora))
    mlp_sourced = dropout == 0 and bool({"gate_proj", "up_proj"} & set(lora)) and not dims.sandwich
    if choice.checkpointing == "none":
        activations = layers * (per_token - BF16 * h * (attention_sourced + mlp_sourced)) * t
    elif choice.checkpointing == "selective":
        activations = layers * (per_token - mlp_dropped - BF16 * h * attention_sourced) * t + mlp * t
    elif choice.offload:
        activations = 2 * BF16 * h * t + per_token * t
    else:
        activations = layers * BF16 * h * t + per_token * t
    parts = {
        "weights": weight_bytes(dims, quantization, gguf_bits),
        "adapter": adapter,
        "activations": activations,
        "loss": BF16 * h * t + LOSS_CHUNK_BYTES,
        "workspace": WORKSPACE_BYTES,
    }
    parts["total"] = sum(parts.values())
    return parts


def _cost(choice: MemoryChoice, micro_tokens: int) -> float:
    halvings = max(0.0, math.log2(EFFICIENT_TOKENS / max(micro_tokens, 1)))
    return RECOMPUTE_COST[(choice.checkpointing, choice.offload)] * (1 + 0.1 * halvings)


def plan_memory(
    dims: ModelDims,
    *,
    rank: int,
    targets: list[str] | str,
    rows: int,
    seq: int,
    gpu_bytes: int,
    quantization: str | None = None,
    gguf_bits: float | None = None,
    share: float = DEFAULT_SHARE,
    allow_offload: bool = True,
    dropout: float = 0.0,
) -> MemoryPlan:
    """The cheapest choice (micro-batch rows × checkpointing × offload) whose predicted peak stays
    under share × gpu_bytes for micro-batches of `rows` rows of `seq` tokens (per GPU); when
    none fits, the smallest one, marked `fits=False`."""
    limit = int(share * gpu_bytes)
    sizes = sorted({rows, *(-(-rows // 2**j) for j in range(1, 12))}, reverse=True)
    modes = [MemoryChoice(None, "none"), MemoryChoice(None, "selective"), MemoryChoice(None, "full")]
    if allow_offload:  # the eager step's saved-tensor hooks; the captured step keeps them on the GPU
        modes.append(MemoryChoice(None, "full", offload=True))
    candidates = []
    for micro in sizes:
        for mode in modes:
            choice = MemoryChoice(None if micro == rows else micro, mode.checkpointing, mode.offload)
            parts = predict_peak(
                dims,
                rank=rank,
                targets=targets,
                micro_tokens=micro * seq,
                choice=choice,
                quantization=quantization,
                gguf_bits=gguf_bits,
                dropout=dropout,
            )
            # ties go to fewer, larger micro-batches (fewer launches)
            candidates.append((_cost(choice, micro * seq), -micro, parts["total"], choice, parts))
    fitting = [c for c in candidates if c[2] <= limit]
    if fitting:
        _, _, peak, choice, parts = min(fitting, key=lambda c: (c[0], c[1]))
        return MemoryPlan(choice, peak, limit, True, parts)
    _, _, peak, choice, parts = min(candidates, key=lambda c: c[2])
    return MemoryPlan(choice, peak, limit, False, parts)


def refusal(plan: MemoryPlan, *, quantization: str | None, rank: int, seq: int, rows: int) -> str:
    """Why a job that fits no GPU cannot run, naming what to change."""
    changes = []
    if quantization is None:
        changes.append('"quantization": "nf4" (a 4-bit frozen base)')
    if plan.breakdown["adapter"] > plan.breakdown["weights"] // 8 and rank > 8:
        changes.append(f"a smaller lora.r (now {rank})")
    if plan.breakdown["activations"] + plan.breakdown["loss"] > plan.breakdown["weights"] // 4:
        changes.append(f"a shorter max_seq_len (now {seq})")
    changes.append("a worker with a larger GPU (queue)")
    return (
        f"the job does not fit the GPU memory of any live worker: {plan.sentence()} "
        f"(weights {plan.breakdown['weights'] / GIB:.1f} GiB, micro-batches of 1 row of {seq} tokens); "
        f"change: {'; or '.join(changes)}"
    )


def catalog_dims(name: str, store: Path) -> ModelDims | None:
    """The dims of catalog model `name` (presets, the pulled GGUF's preset shape, a local or
    Hub directory's config.json); None where they cannot be read without loading it."""
    # imported here: the engine's types import this module, and the catalog imports them
    from worker.engine.catalog import PRESET_SHAPES, PRETRAINED, SHAPE_OF_PRETRAINED, get_model_info

    preset = SHAPE_OF_PRETRAINED.get(name, name)
    if preset in PRESET_SHAPES:
        return ModelDims.from_config(PRESET_SHAPES[preset].config_kwargs())
    try:
        info = get_model_info(name, store)
    except Exception:  # an unknown name is refused elsewhere, with its own message
        return None
    if info.path is None or name in PRETRAINED:
        return None
    config = Path(info.path) / "config.json"
    try:
        return ModelDims.from_config(json.loads(config.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
