"""Llama-family decoding over a preallocated KV cache, decode steps replayed from CUDA graphs.

What serving runs on Llama-shaped bases (Llama, SmolLM2, the presets) instead of transformers'
forward over a DynamicCache: the same modules and weights (so the MultiLoRALinear layers, norms,
rotary embedding and MLP are transformers' own), called in an order that needs no host sync and
no allocation that depends on the step, as vLLM does:

- `KVCache`: per layer K and V buffers (rows, kv_heads, length, head_dim). Row i of the cache is
  row i of the batch; a row that leaves is replaced by moving the later rows down (`keep`). Each
  row's prompt sits at positions 0..n-1 (no padding), its next token at position n.
- prefill (`prefill`): new prompts right-padded to their longest, causal attention among their
  own tokens (SDPA), K/V written straight into their cache rows; logits of each last prompt token.
- decode (`decode`): one token per row, written at the row's position, attention over the first
  Lb cache positions with everything past the row's position masked. Batch sizes are padded to
  a power of two Bb and Lb is a power of two, so a handful of shapes cover every step; on CUDA
  each (Bb, Lb) is run eagerly once, then captured into a CUDA graph and replayed, reading the
  step's tokens, positions and adapter slots from a static (3, rows) buffer. Padding rows write
  into free cache rows and their logits are dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

log = logging.getLogger(__name__)

MIN_LENGTH = 64  # the smallest cache length and attention bucket


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(eq=False)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # (Bb, V): the static output, overwritten by each replay


@dataclass(eq=False)
class KVCache:
    """K and V of every layer, (rows, kv_heads, length, head_dim); `inputs` (3, rows) int64 holds
    the token, position and adapter slot of each row for the decode step (the graphs' input)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    inputs: torch.Tensor
    graphs: dict[tuple[int, int], _Graph] = field(default_factory=dict)
    eager_runs: set[tuple[int, int]] = field(default_factory=set)  # shapes run once, not captured
    # The memory pool its graphs share. It lives and dies with them: a pool whose graphs were all
    # freed is gone in the caching allocator, and capturing into its handle again fails an assert.
    pool: Any = None

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def keep(self, indices: list[int]) -> None:
        """Row j of the cache becomes row indices[j] (indices ascending): only moved rows are copied."""
        moved = [(j, i) for j, i in enumerate(indices) if i != j]
        if not moved:
            return
        device = self.inputs.device
        dst = torch.tensor([j for j, _ in moved], device=device)
        src = torch.tensor([i for _, i in moved], device=device)
        for t in (*self.keys, *self.values):
            t.index_copy_(0, dst, t.index_select(0, src))


class LlamaDecoder:
    """Prefill and decode of a transformers Llama model (see the module docstring). `set_slots`
    is called with each forward's (B,) adapter slots before the model's linear layers run."""

    def __init__(self, model: nn.Module, set_slots: Callable[[torch.Tensor], None], *, graphs: bool) -> None:
        cfg: Any = model.config
        self.set_slots = set_slots
        inner: Any = model.model  # transformers' LlamaModel: its modules are called one by one
        self.embed: Any = inner.embed_tokens
        self.layers: Any = inner.layers
        self.norm: Any = inner.norm
        self.rotary: Any = inner.rotary_emb
        self.lm_head: Any = model.lm_head
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.scaling = self.head_dim**-0.5
        self.max_length = int(getattr(cfg, "max_position_embeddings", 2048))
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.graphs = graphs and self.device.type == "cuda"
        self.graph_failure: str | None = None

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """A Llama causal LM whose rotary embedding needs no host-side update (no dynamic or
        long-rope scaling) and that attends over the full context (no sliding window)."""
        cfg = getattr(model, "config", None)
        inner = getattr(model, "model", None)
        rope_type = str(getattr(getattr(inner, "rotary_emb", None), "rope_type", ""))
        return (
            getattr(cfg, "model_type", None) == "llama"
            and getattr(cfg, "sliding_window", None) is None
            and hasattr(model, "lm_head")
            and rope_type in ("default", "linear", "llama3")
        )

    # -- cache
    def ensure(self, kv: KVCache | None, rows: int, length: int) -> KVCache:
        """A cache with at least `rows` rows and `length` positions: `kv` itself if it is large
        enough, else a larger one (powers of two, up to the model's context) holding kv's rows."""
        if kv is not None and kv.rows >= rows and kv.length >= length:
            return kv
        new_rows = max(_pow2(rows), kv.rows if kv is not None else 1)
        new_length = min(max(_pow2(length), MIN_LENGTH, kv.length if kv is not None else 0), self.max_length)
        shape = (new_rows, self.n_kv, new_length, self.head_dim)
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        if kv is not None:  # the graphs read the old buffers: they go with them
            for new, old in zip((*keys, *values), (*kv.keys, *kv.values), strict=True):
                new[: old.shape[0], :, : old.shape[2]] = old
        inputs = torch.zeros(3, new_rows, dtype=torch.int64, device=self.device)
        return KVCache(keys, values, inputs)

    # -- prefill
    def prefill(
        self, kv: KVCache, start: int, prompts: list[list[int]], slots: list[int], pad: int
    ) -> torch.Tensor:
        """Run `prompts` into cache rows start.. start+n; the logits (n, V) of each last token."""
        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, width), pad, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        ids = ids.to(self.device)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        self.set_slots(torch.tensor(slots, device=self.device))
        x = self.embed(ids)  # (n, W, hidden)
        positions = torch.arange(width, device=self.device).expand(n, width)
        cos, sin = self.rotary(x, positions)
        rep = self.n_heads // self.n_kv
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(n, width, self.n_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(n, width, self.n_kv, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(n, width, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            kv.keys[li][start : start + n, :, :width] = k
            kv.values[li][start : start + n, :, :width] = v
            # right padding: a real token's causal window holds only its own prompt's tokens
            o = F.scaled_dot_product_attention(
                q, repeat_kv(k, rep), repeat_kv(v, rep), is_causal=True, scale=self.scaling
            )  # (n, heads, W, head_dim)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(n, width, self.n_heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h_last = x[torch.arange(n, device=self.device), last][:, None]  # (n, 1, hidden)
        return self.lm_head(self.norm(h_last))[:, 0]

    # -- decode
    def decode(self, kv: KVCache, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """One position for each row: tokens[i] at positions[i] of cache row i, adapter slots[i].
        The logits (B, V) (a view of a graph's static output: read it before the next call)."""
        b = len(tokens)
        lb = min(max(_pow2(max(positions) + 1), MIN_LENGTH), kv.length)
        bb = min(_pow2(b), kv.rows) if self.graphs else b
        pad = bb - b
        host = torch.tensor([tokens + [0] * pad, positions + [0] * pad, slots + [0] * pad], dtype=torch.int64)
        kv.inputs[:, :bb].copy_(host)
        key = (bb, lb)
        if not self.graphs or self.graph_failure is not None:
            return self._decode_body(kv, bb, lb)[:b]
        if key in kv.graphs:
            g = kv.graphs[key]
            g.graph.replay()
            return g.logits[:b]
        if key not in kv.eager_runs:  # first run of this shape: eager (lazy inits happen here)
            kv.eager_runs.add(key)
            return self._decode_body(kv, bb, lb)[:b]
        return self._capture(kv, bb, lb)[:b]

    def _capture(self, kv: KVCache, bb: int, lb: int) -> torch.Tensor:
        torch.cuda.synchronize()
        if kv.pool is None:
            kv.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=kv.pool):
                logits = self._decode_body(kv, bb, lb)
        except Exception as exc:  # capture refuses many things; each one means: stay eager
            self.graph_failure = f"{type(exc).__name__}: {exc}"[:2000]
            log.warning("decode steps run eagerly: CUDA graph capture failed: %s", self.graph_failure)
            return self._decode_body(kv, bb, lb)
        kv.graphs[(bb, lb)] = _Graph(graph, logits)
        graph.replay()  # capture ran nothing: this is the step
        return logits

    def _decode_body(self, kv: KVCache, bb: int, lb: int) -> torch.Tensor:
        """The decode step of rows 0..bb over positions 0..lb, inputs from kv.inputs; (bb, V)."""
        tokens, positions, slots = kv.inputs[0, :bb], kv.inputs[1, :bb], kv.inputs[2, :bb]
        self.set_slots(slots)
        g, rep, d, length = self.n_kv, self.n_heads // self.n_kv, self.head_dim, kv.length
        x = self.embed(tokens[:, None])  # (bb, 1, hidden)
        cos, sin = self.rotary(x, positions[:, None])
        # additive mask (bb, 1, 1, lb): a row sees its positions up to and including the new one
        visible = torch.arange(lb, device=self.device)[None, :] <= positions[:, None]
        mask = torch.zeros(bb, 1, 1, lb, device=self.device).masked_fill(
            ~visible[:, None, None, :], float("-inf")
        )
        # where each row's new K/V lands in a layer's buffer viewed as (rows·heads·length, d)
        heads = (
            torch.arange(bb, device=self.device)[:, None] * g + torch.arange(g, device=self.device)[None, :]
        )
        flat = (heads * length + positions[:, None]).reshape(-1)  # (bb·g,)
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(bb, 1, self.n_heads, d).transpose(1, 2)  # (bb, heads, 1, d)
            k = attn.k_proj(h).view(bb, 1, g, d).transpose(1, 2)
            v = attn.v_proj(h).view(bb, 1, g, d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys, values = kv.keys[li], kv.values[li]
            keys.view(-1, d).index_copy_(0, flat, k.reshape(bb * g, d))
            values.view(-1, d).index_copy_(0, flat, v.reshape(bb * g, d))
            # grouped-query attention without repeating K/V: query head j·rep + i reads KV head j
            qg = q.reshape(bb, g, rep, d)
            scores = torch.matmul(qg, keys[:bb, :, :lb].transpose(-1, -2)).float() * self.scaling + mask
            p = torch.softmax(scores, dim=-1).to(values.dtype)  # (bb, g, rep, lb)
            o = torch.matmul(p, values[:bb, :, :lb])  # (bb, g, rep, d)
            x = x + attn.o_proj(o.reshape(bb, 1, self.n_heads * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x))[:, 0]
