"""A frozen (out, in) linear weight stored in a compact format, and the tiled matmul over it.

`FrozenWeight` is the strategy object a quantized base passes to every LoRA linear (as vLLM
passes its quant config): the format (NF4, int8, a GGUF block type) says how to dequantize a
range of rows; everything else (the tiled forward, the input gradient, moving between devices,
stacking q/k/v) is shared here. Rows are independent in every format (each row holds whole
blocks), so a tile of rows dequantizes on its own and the whole (out, in) weight never exists in
the activation dtype at once:

    y[..., r0:r1] = x · W[r0:r1]ᵀ                (forward, one tile at a time)
    ∂L/∂x        = Σ_tiles ∂L/∂y[..., r0:r1] · W[r0:r1]

The weight is frozen, so no weight gradient exists and the op saves nothing for its backward
(the LoRA branch keeps the input it needs). The compiled LoRA ops (gpu_kernels.ops.lora and
.lora_mlp) run their base GEMMs over the same tiles (`linear_into`, `input_grad_into`).
Dequantization runs in fp32 (as llama.cpp and gguf-py do) and is cast to the activation dtype once
per tile.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, cast

import torch

from gpu_kernels import backend

# One tile dequantizes at most this many weight elements (4 MiB in bf16; its fp32 temporaries
# 8-16 MiB): large enough that the GEMMs stay efficient (256 rows of an 8192-wide layer), small
# enough that a layer's dense copy never exists at once (an 8192 x 8192 NF4 layer's fwd + bwd
# measured 70+ MiB above its inputs on an H100 with 2^22 and int64 code indices).
TILE_ELEMENTS = 1 << 21
# A tile that a compiled kernel dequantizes (NF4, int8: gpu_kernels.quant.compiled) has no fp32
# temporaries, only itself in bf16 (16 MiB here): 4x larger tiles, so that a step's GEMMs fill the
# GPU (2,048 rows of a 4,096-wide layer: at 2,048 tokens a micro-batch, 256 output tiles of 128 x
# 128 where 2^21 gave 64 on 132 SMs) and the backward's K is as long as the forward's N.
COMPILED_TILE_ELEMENTS = 1 << 23
# Tile rows are a multiple of this where a tile holds that many: the forward writes columns
# start:stop of the output and the backward reads them, and a start that is not 16-byte aligned
# (a 14,336-wide layer's 585-row tiles) sends cuBLAS to kernels several times slower (measured:
# an 8B down projection's forward + input gradient 5.9 ms against 0.73 ms dense, on an H100).
TILE_ROW_ALIGN = 128


class FrozenWeight(ABC):
    """A frozen weight of `shape` (out, in) that computes in `dtype` (the activation dtype).

    Subclasses hold their packed tensors in `tensors()` (same keys after `to`), and implement
    `dequant_rows`. `dtype` and `device` mirror a dense weight's, so code that asks a layer's
    weight for them keeps working."""

    format: str = "dense"

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype) -> None:
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = dtype

    # -- the format
    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors (packed codes, scales), by name."""

    @abstractmethod
    def with_tensors(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> FrozenWeight:
        """The same weight over `tensors` (moved copies of `tensors()`), computing in `dtype`."""

    @abstractmethod
    def dequant_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of W, (stop - start, in) fp32, on this weight's device."""

    # -- shared
    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors().values())).device

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes this weight holds (its packed tensors; views of one buffer count once each)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @functools.cached_property
    def _kernel_fits(self) -> bool:
        """Whether a compiled kernel (gpu_kernels.quant.compiled) takes this weight's tensors; they
        never change, so it is asked once. Formats with a kernel override it."""
        return False

    def _compiled_tile_into(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """`tile_into` by the format's compiled kernel (only called where `_kernel_fits`)."""
        raise NotImplementedError(f"{type(self).__name__} has no compiled tile")

    def _compiled_tiles(self, dtype: torch.dtype) -> bool:
        return dtype == torch.bfloat16 and self._kernel_fits and backend.compiled()

    def tile_into(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Rows start:stop of W written into `out` ((stop - start, in), the compute dtype); returns
        `out`. One compiled launch where the format has a kernel (no fp32 temporaries), else the
        torch dequantization."""
        if out.is_contiguous() and self._compiled_tiles(out.dtype):
            return self._compiled_tile_into(start, stop, out)
        return out.copy_(self.dequant_rows(start, stop))

    def tile_elements(self, dtype: torch.dtype) -> int:
        """The largest tile `each_tile(dtype)` makes, in weight elements."""
        return COMPILED_TILE_ELEMENTS if self._compiled_tiles(dtype) else TILE_ELEMENTS

    def each_tile(self, dtype: torch.dtype) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(start, stop, rows start:stop of W in `dtype`) for every tile, in order. The tiles are
        written in turn into one buffer of the largest tile, so a tile is only valid until the
        next one is asked for (on a GPU: stream order; the consumer's kernels are queued first)."""
        tiles = list(self.tiles(self.tile_elements(dtype)))
        n_in = self.in_features
        buffer = torch.empty(max(b - a for a, b in tiles) * n_in, dtype=dtype, device=self.device)
        for start, stop in tiles:
            yield (
                start,
                stop,
                self.tile_into(start, stop, buffer[: (stop - start) * n_in].view(stop - start, n_in)),
            )

    def tiles(self, elements: int | None = None) -> Iterator[tuple[int, int]]:
        """(start, stop) row ranges of at most `elements` (default TILE_ELEMENTS) elements each,
        covering all rows."""
        out, n_in = self.shape
        step = max(1, (elements or TILE_ELEMENTS) // max(n_in, 1))
        if step >= TILE_ROW_ALIGN:  # tiles start on aligned rows: cuBLAS's fast paths need it
            step -= step % TILE_ROW_ALIGN
        for start in range(0, out, step):
            yield start, min(start + step, out)

    def dequant_into(self, out: torch.Tensor) -> torch.Tensor:
        """Write all of W into `out` (out, in) (any float dtype and device), a tile at a time."""
        if tuple(out.shape) != self.shape:
            raise ValueError(f"dequant_into: out has shape {tuple(out.shape)}, the weight {self.shape}")
        for start, stop in self.tiles():
            out[start:stop].copy_(self.dequant_rows(start, stop))
        return out

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """All of W as one dense (out, in) tensor: for tests, merges and exports, never a step."""
        out = torch.empty(self.shape, dtype=dtype or self.dtype, device=self.device)
        return self.dequant_into(out)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x · Wᵀ, (..., in) -> (..., out), differentiable in x, tiled over W's rows."""
        return _FrozenMatmul.apply(x, self)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> FrozenWeight:
        """On `device`, computing in `dtype`: the packed tensors keep their own dtypes (a cast
        would re-round the scales)."""
        moved = {k: t.to(device) if device is not None else t for k, t in self.tensors().items()}
        return self.with_tensors(moved, dtype or self.dtype)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(format={self.format}, shape={self.shape}, "
            f"dtype={self.dtype}, nbytes={self.nbytes})"
        )


def linear_into(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | FrozenWeight, add: bool
) -> torch.Tensor:
    """out (M, out) = x (M, in)·Wᵀ, or += with `add` (in the GEMM's epilogue, beta = 1), for a
    dense weight or a frozen one: a tile's GEMM per column block of out, written in place
    (cuBLAS takes the leading dimension), so no tile's product is copied. Returns out."""
    if not isinstance(weight, FrozenWeight):
        return out.addmm_(x, weight.t()) if add else torch.mm(x, weight.t(), out=out)
    for start, stop, w in weight.each_tile(x.dtype):
        if add:
            out[:, start:stop].addmm_(x, w.t())
        else:
            torch.mm(x, w.t(), out=out[:, start:stop])
    return out


def input_grad_into(
    out: torch.Tensor | None, grad_y: torch.Tensor, weight: torch.Tensor | FrozenWeight
) -> torch.Tensor:
    """out (M, in) += dY (M, out)·W, or a new dY·W where out is None: for a frozen weight each
    tile's share (M, tile)·(tile, in) added in the GEMM's epilogue, no partial sums kept."""
    if not isinstance(weight, FrozenWeight):
        return grad_y @ weight if out is None else out.addmm_(grad_y, weight)
    for start, stop, w in weight.each_tile(grad_y.dtype):
        g = grad_y[:, start:stop]
        out = g @ w if out is None else out.addmm_(g, w)
    assert out is not None, "a frozen weight has at least one tile"
    return out


def save_weights(ctx: Any, *weights: torch.Tensor | FrozenWeight) -> tuple[torch.Tensor | None, ...]:
    """An autograd op's base weights, split for its save: a frozen compact one is no tensor autograd
    can save, so the ctx holds it (it never changes); the dense ones are returned for
    save_for_backward, None in a frozen one's place. `saved_weights` joins them again."""
    ctx.frozen_weights = tuple(w if isinstance(w, FrozenWeight) else None for w in weights)
    return tuple(None if isinstance(w, FrozenWeight) else w for w in weights)


def saved_weights(ctx: Any, *dense: torch.Tensor | None) -> list[torch.Tensor | FrozenWeight]:
    """The weights `save_weights` split, from the dense ones ctx.saved_tensors gave back."""
    weights = [f if f is not None else d for d, f in zip(dense, ctx.frozen_weights, strict=True)]
    assert all(w is not None for w in weights)
    return cast(list[torch.Tensor | FrozenWeight], weights)


class _FrozenMatmul(torch.autograd.Function):
    """x·Wᵀ over a frozen weight's tiles (linear_into), its input gradient likewise."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: FrozenWeight) -> torch.Tensor:
        ctx.weight = weight
        xc = x.to(_compute_dtype(x)).reshape(-1, weight.in_features)  # (N, in)
        out = linear_into(xc.new_empty((xc.shape[0], weight.out_features)), xc, weight, add=False)
        return out.view(*x.shape[:-1], weight.out_features)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        weight: FrozenWeight = ctx.weight
        grad_x = input_grad_into(None, grad_out.reshape(-1, weight.out_features), weight)  # (N, in)
        return grad_x.view(*grad_out.shape[:-1], weight.in_features), None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the base GEMM runs in: autocast's where it is on (bf16 on CUDA), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class DenseWeight(FrozenWeight):
    """A dense weight as a FrozenWeight: for stacking beside quantized ones (a GGUF file may keep
    some of a group's projections in F16)."""

    format = "dense"

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(tuple(weight.shape), weight.dtype)  # type: ignore[arg-type]
        self.weight = weight.detach()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}

    def with_tensors(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> FrozenWeight:
        return DenseWeight(tensors["weight"].to(dtype))

    def dequant_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.weight[start:stop].float()


class StackedWeight(FrozenWeight):
    """Several frozen weights of one input stacked on the output dimension (q/k/v, gate/up), of
    any formats: nothing is copied; a tile never spans two parts."""

    def __init__(self, parts: list[FrozenWeight]) -> None:
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("StackedWeight needs one or more weights of the same in_features")
        super().__init__((sum(p.out_features for p in parts), parts[0].in_features), parts[0].dtype)
        self.parts = parts
        self.format = "+".join(sorted({p.format for p in parts}))
        self.offsets = [0]
        for p in parts:
            self.offsets.append(self.offsets[-1] + p.out_features)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{i}.{k}": t for i, p in enumerate(self.parts) for k, t in p.tensors().items()}

    def with_tensors(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> FrozenWeight:
        parts = []
        for i, p in enumerate(self.parts):
            mine = {k.split(".", 1)[1]: t for k, t in tensors.items() if k.split(".", 1)[0] == str(i)}
            parts.append(p.with_tensors(mine, dtype))
        return StackedWeight(parts)

    def tiles(self, elements: int | None = None) -> Iterator[tuple[int, int]]:
        for offset, part in zip(self.offsets, self.parts, strict=False):
            for start, stop in part.tiles(elements):
                yield offset + start, offset + stop

    def tile_elements(self, dtype: torch.dtype) -> int:
        return min(p.tile_elements(dtype) for p in self.parts)

    def tile_into(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        for offset, part in zip(self.offsets, self.parts, strict=False):
            if offset <= start and stop <= offset + part.out_features:  # every tile of tiles()
                return part.tile_into(start - offset, stop - offset, out)
        return super().tile_into(start, stop, out)

    def dequant_rows(self, start: int, stop: int) -> torch.Tensor:
        chunks = []
        for offset, part in zip(self.offsets, self.parts, strict=False):
            lo, hi = max(start, offset), min(stop, offset + part.out_features)
            if lo < hi:
                chunks.append(part.dequant_rows(lo - offset, hi - offset))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def stack_frozen(weights: list[torch.Tensor | FrozenWeight]) -> torch.Tensor | FrozenWeight:
    """Weights that read one input, stacked on the output dimension (Σ out, in): one dense tensor
    (a copy) when all are dense, else a StackedWeight over them (nothing copied)."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.cat([w.detach() for w in weights if isinstance(w, torch.Tensor)])
    return StackedWeight([w if isinstance(w, FrozenWeight) else DenseWeight(w) for w in weights])


def base_linear(
    x: torch.Tensor, weight: torch.Tensor | FrozenWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x·Wᵀ + b for a dense weight (F.linear) or a frozen compact one (tiled), (..., out)."""
    if isinstance(weight, FrozenWeight):
        y = weight.matmul(x)
        return y + bias.to(y.dtype) if bias is not None else y
    return torch.nn.functional.linear(x, weight, bias)
