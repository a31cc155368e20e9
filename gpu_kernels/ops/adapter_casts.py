"""The activation-dtype operands of many LoRA ops, refreshed together by one kernel launch.

A LoRA op (gpu_kernels.lora_linear_grouped) with adapters (A_j (r_j, K), B_j (N_j, r_j), s_j),
factors in fp32, multiplies in the activation dtype by

    A_cat = [A_1; A_2; ...]            (R, K)
    D     = blockdiag(s_1·B_1ᵀ, ...)   (R, N)

Built inside every call, that is a cat, a cast, a zero fill and a scale per adapter: about 15
small launches per transformer layer, each a few microseconds however small its tensor. Here
every op's pair lives in a buffer of its own (D's off-diagonal zeros written once), and
`refresh()` rewrites all of them from the current factors in one launch (csrc/lora.cu,
loraq_adapter_cast, driven by a table of the factors' addresses). The pairs are valid from one
refresh until the factors change (the next optimizer step): `in_step()` refreshes and hands
them out only inside that window, so a forward outside it (evaluation, sampling) casts for
itself.

Factors must stay at the addresses they had when the table was built (in-place updates, as the
optimizer and load_state_dict do); `refresh()` checks that on the host.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from gpu_kernels import _lib
from gpu_kernels.ops.lora import cast_operands

Adapters = Sequence[tuple[torch.Tensor, torch.Tensor, float]]  # (A_j, B_j, s_j) of one op
# one table row: src, dst, rows, cols, dst row stride, scale (fp32 bits), transpose
_FIELDS = 7


def _float_bits(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.float32).view(torch.int32).item())


class AdapterCasts:
    def __init__(self, ops: Sequence[Adapters], dtype: torch.dtype, *, compiled: bool) -> None:
        """`ops`: each op's adapters; `dtype`: the activations'; `compiled`: refresh with the
        kernel (CUDA factors, kernels loaded) or with plain torch ops (the reference)."""
        self.dtype = dtype
        self.compiled = compiled
        self._ops = [list(adapters) for adapters in ops]
        self._operands: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._factors: list[tuple[torch.Tensor, int]] = []  # each factor and its address
        rows: list[list[int]] = []
        for adapters in self._ops:
            a0 = adapters[0][0]
            ranks = [a.shape[0] for a, _, _ in adapters]
            widths = [b.shape[0] for _, b, _ in adapters]
            k, r_total, n_total = a0.shape[1], sum(ranks), sum(widths)
            a_act = torch.empty(r_total, k, dtype=dtype, device=a0.device)
            d_act = torch.zeros(r_total, n_total, dtype=dtype, device=a0.device)
            elt = d_act.element_size()
            col = r0 = 0
            for (a, b, s), r, n in zip(adapters, ranks, widths, strict=True):
                for f in (a, b):
                    if f.dtype != torch.float32 or not f.is_contiguous() or f.device != a0.device:
                        raise ValueError("adapter factors must be contiguous fp32 tensors on one device")
                    self._factors.append((f, f.data_ptr()))
                if a.shape[1] != k or b.shape[1] != r:
                    raise ValueError(f"adapter shapes {tuple(a.shape)}, {tuple(b.shape)} do not fit one op")
                a_dst = a_act.data_ptr() + elt * r0 * k
                d_dst = d_act.data_ptr() + elt * (r0 * n_total + col)
                rows.append([a.data_ptr(), a_dst, r, k, k, _float_bits(1.0), 0])
                rows.append([b.data_ptr(), d_dst, n, r, n_total, _float_bits(float(s)), 1])
                col += n
                r0 += r
            self._operands.append((a_act, d_act))
        self._max_elems = max((r[2] * r[3] for r in rows), default=0)
        self._n_rows = len(rows)
        device = self._ops[0][0][0].device if self._ops else torch.device("cpu")
        self._table = torch.tensor(rows, dtype=torch.int64).reshape(-1, _FIELDS).to(device)
        self._active = False

    def __len__(self) -> int:
        return len(self._operands)

    def refresh(self) -> None:
        """Rewrite every op's (A_cat, D) from the factors' current values."""
        for f, address in self._factors:
            if f.data_ptr() != address:
                raise RuntimeError("an adapter factor moved since AdapterCasts was built: build it again")
        if not self.compiled:
            for adapters, (a_act, d_act) in zip(self._ops, self._operands, strict=True):
                _reference_fill(adapters, a_act, d_act)
            return
        device = self._table.device
        code = _lib.dtype_code(self.dtype)
        rc = _lib.load().loraq_adapter_cast(
            self._table.data_ptr(), self._n_rows, self._max_elems, code, _lib.stream(device)
        )
        _lib.check(rc, "loraq_adapter_cast")

    @contextmanager
    def in_step(self) -> Iterator[None]:
        """Refresh, then hand out the operands (`operands(i)`) until the block ends: wrap one
        step's forward and backward, between two optimizer steps."""
        self.refresh()
        self._active = True
        try:
            yield
        finally:
            self._active = False

    def operands(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Op i's (A_cat, D) inside `in_step()`, else None (the op then casts for itself)."""
        return self._operands[i] if self._active else None


def _reference_fill(adapters: Adapters, a_act: torch.Tensor, d_act: torch.Tensor) -> None:
    """What the kernel writes, built as LoRALinearFunction builds it per call."""
    with torch.no_grad():
        a, d = cast_operands(
            [a for a, _, _ in adapters], [b for _, b, _ in adapters], [s for *_, s in adapters], d_act.dtype
        )
        a_act.copy_(a)
        d_act.copy_(d)
