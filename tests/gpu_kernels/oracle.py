"""How the per-op GPU tests compare a compiled op with its reference (test_op_*.py).

Error measure: ‖out − gold‖_F / ‖gold‖_F, where gold is the reference run in float64 on the same
inputs, for the output and every input gradient. Bounds per dtype: fp32 (TF32 off) 1e-4; bf16
2e-2 (bf16 operands land between 1e-3 and 1e-2; the gradients pass through two bf16 roundings).
The compiled error must also be at most twice the error of the same-dtype reference + 10% of the
bound, so a kernel can be no sloppier than eager torch. Outputs' memory is poisoned with NaN
first, so an element a kernel forgot to write fails the check.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# the largest vocabulary of worker/engine/catalog.py's models (the Llama 3 family)
LARGEST_VOCAB = 128_256

Recorder = Callable[[str, object], None]


@contextlib.contextmanager
def saved_storages(counted: Callable[[torch.Tensor], bool] | None = None) -> Iterator[dict[int, int]]:
    """Inside: the storages of the tensors autograd saves for the backward (those `counted` picks,
    default all), address -> bytes; what a test of an op's or a step's memory reads."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if counted is None or counted(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def give_norm_sources(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The fused decoder stack's NormSource wiring on the CPU (worker/engine/fused_model.py with
    its kernels forced on): gpu_kernels.add_rms_norm returns the reference norm's values and the
    NormSource the compiled one would (its sum and rstd; none for a sandwich norm whose sum is
    formed again), and the grouped LoRA op is the compiled op's torch code (gpu_kernels.ops.lora),
    which keeps a given source instead of its input. Returns the switch: set [0] False and the
    norms give no source."""
    import inspect

    import gpu_kernels
    from gpu_kernels import dispatch
    from gpu_kernels.ops import lora as lora_ops
    from gpu_kernels.ops.norm_source import NormSource

    reference_add_rms_norm = gpu_kernels.add_rms_norm
    signature = inspect.signature(reference_add_rms_norm)
    give = [True]

    def add_rms_norm(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, NormSource | None]:
        h, n, _ = reference_add_rms_norm(*args, **kwargs)
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments  # residual, delta, weight, eps, offset, delta_norm, keep_sum
        if not give[0] or (a["delta_norm"] is not None and not a["keep_sum"]):
            return h, n, None
        rows = h.detach().reshape(-1, h.shape[-1])
        return h, n, NormSource(rows, torch.rsqrt(rows.pow(2).mean(-1) + a["eps"]), a["weight"], a["offset"])

    monkeypatch.setattr(gpu_kernels, "add_rms_norm", add_rms_norm)
    monkeypatch.setattr(dispatch, "lora_linear_grouped", lora_ops.lora_linear_grouped)
    return give


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """‖a − ref‖ / ‖ref‖ in float64 (inf if a holds a non-finite value)."""
    a64, r64 = a.detach().double(), ref.detach().double()
    if not torch.isfinite(a64).all():
        return math.inf
    denom = r64.norm().item()
    return (a64 - r64).norm().item() / (denom if denom > 0 else 1.0)


def randn(*shape: int, dtype: torch.dtype, grad: bool = False, scale: float = 1.0) -> torch.Tensor:
    """A CUDA tensor of N(0, scale²) values in dtype (drawn in fp32, then rounded)."""
    return (torch.randn(*shape, device="cuda") * scale).to(dtype).requires_grad_(grad)


def poison() -> None:
    """Fill recently freed allocator blocks with NaN so an unwritten output shows up."""
    blob = torch.full((64 * 1024 * 1024,), float("nan"), dtype=torch.float32, device="cuda")
    del blob


def outputs_and_grads(
    fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], gy: torch.Tensor | None
) -> list[torch.Tensor]:
    """[fn(inputs), then the gradient of every input that requires grad], for fresh leaves.
    gy is the output's incoming gradient (None: the output is a scalar loss)."""
    xs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*xs)
    if gy is None:
        out.backward()
    else:
        out.backward(gy.to(out.dtype))
    grads = [x.grad for x in xs if x.requires_grad]
    assert all(g is not None for g in grads), "an input that requires grad got no gradient"
    return [out.detach(), *[g for g in grads if g is not None]]


def assert_matches_reference(
    ours: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    gy: torch.Tensor | None,
    names: Sequence[str],
    dtype: torch.dtype,
    record: Recorder | None = None,
) -> dict[str, float]:
    """Forward and backward of `ours` against `reference` in float64 (see the module docstring);
    `names` labels the output and the gradients in order. Returns the errors, which `record`
    (pytest's record_property) also stores for the results JSON."""
    poison()
    got = outputs_and_grads(ours, inputs, gy)
    same = outputs_and_grads(reference, inputs, gy)
    inputs64 = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    gold = outputs_and_grads(reference, inputs64, gy.double() if gy is not None else None)
    errs = {n: rel(o, g) for n, o, g in zip(names, got, gold, strict=True)}
    ref_errs = {n: rel(s, g) for n, s, g in zip(names, same, gold, strict=True)}
    return check_errors(errs, ref_errs, dtype, record)


def check_errors(
    errs: dict[str, float], ref_errs: dict[str, float], dtype: torch.dtype, record: Recorder | None = None
) -> dict[str, float]:
    """Assert every error is within the dtype's bound (or twice the reference's, see above)."""
    bound = BOUNDS[dtype]
    if record is not None:
        record("bound", bound)
        for k in errs:
            record(f"err_{k}", float(f"{errs[k]:.3e}"))
            record(f"ref_err_{k}", float(f"{ref_errs[k]:.3e}"))
    over = {
        k: (e, ref_errs[k]) for k, e in errs.items() if not e <= max(bound, 2 * ref_errs[k] + 0.1 * bound)
    }
    assert not over, f"errors over the bound {bound:g} (ours, same-dtype reference): {over}"
    return errs


def shapes(small: Sequence[Any], large: Sequence[Any] = ()) -> list[Any]:
    """Parameters for a shape: the small ones (edge shapes; what compute-sanitizer runs) and
    the large ones marked `slow` (`-m "gpu and not slow"` leaves them out)."""
    return [*small, *(pytest.param(*s, marks=pytest.mark.slow) for s in large)]


def rope_tables(
    b: int, s: int, d: int, dtype: torch.dtype, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-style cos/sin (b, s, d): positions (offset per row) times inverse frequencies,
    the halves repeated."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
    pos = torch.arange(s, device=device).float() + torch.randint(0, 50, (b, 1), device=device)
    ang = pos[..., None] * inv  # (b, s, d/2)
    return torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
