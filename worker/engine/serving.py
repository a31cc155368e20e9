"""Serving LoRA adapters on a shared base model: batched decoding with a KV cache, mixed adapters.

One `ServingModel` owns one base model. Every linear layer LoRA can target (all but the output
head) is replaced by a `MultiLoRALinear` that holds a stack of adapter slots:

    lora_a (N, r, in), lora_b (N, out, r), scales (N,)     slot 0 = no adapter (zeros, scale 0)

and applies, for row b of a batch, the slot `index[b]` (gpu_kernels.lora_linear_multi: one
batch mixes requests for different adapters of the base, as Punica's SGMV and S-LoRA do).
Adapters are loaded into slots on demand and evicted least-recently-used. Ranks differ between
adapters: the stacks are zero-padded to the largest rank loaded, which adds exact zeros.

Decoding is continuous batching over a `DecodeBatch`: `admit` prefills new requests and merges
them into the running batch, `step` samples one token per row and runs the rows still going one
position further; finished rows leave the batch, so a long request does not make short ones pay
and a new request does not wait for a batch to drain. `generate` runs a list of requests to
completion. Text is detokenized incrementally with stop strings held back until they can no
longer match. Two engines run the model:
- Llama-shaped bases (worker.engine.kv_decode): a preallocated KV cache per batch, prefill straight
  into it, and decode steps with no host sync inside, replayed from CUDA graphs on a GPU;
- any other base: transformers' forward over a `DynamicCache` (left-padded prefill, a joining
  request's shorter cache left-padded and masked).
A step reads the sampled tokens back once (detokenization and stop checks need them); nothing
else in a step waits for the GPU.
"""

from __future__ import annotations

import json
import math
import random
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

import gpu_kernels
from worker.engine.kv_decode import KVCache, LlamaDecoder
from worker.engine.lora import PEFT_PREFIX, model_path
from worker.engine.models import LoadedModel
from worker.engine.quantize import decoder_linear_paths
from worker.engine.tool_calls import ToolCallFormat, tool_call_format
from worker.engine.types import RequestError

INITIAL_RANK = 8


@dataclass
class AdapterRows:
    """Which slot each row of the running batch uses; None: every row is the bare base model."""

    index: torch.Tensor | None = None  # (B,) int64 on the model's device


class MultiLoRALinear(nn.Module):
    """A frozen nn.Linear plus a stack of LoRA slots; row b of the input uses slot rows.index[b]."""

    def __init__(self, base: nn.Linear, rows: AdapterRows, n_slots: int, rank: int = INITIAL_RANK) -> None:
        super().__init__()
        self.base = base
        self.rows = rows
        device = base.weight.device
        # fp32 factors whatever the base dtype, as in training (small updates are not rounded away)
        self.register_buffer("lora_a", torch.zeros(n_slots, rank, base.in_features, device=device))
        self.register_buffer("lora_b", torch.zeros(n_slots, base.out_features, rank, device=device))
        self.register_buffer("scales", torch.zeros(n_slots, device=device))

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scales: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, in) -> (B, S, out)
        index = self.rows.index
        if index is None:
            return self.base(x)
        return gpu_kernels.lora_linear_multi(
            x, self.base.weight, self.base.bias, self.lora_a, self.lora_b, self.scales, index
        )

    @torch.no_grad()
    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scale: float) -> None:
        """Put A (r, in), B (out, r) in `slot` (None: this adapter leaves the layer alone)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scales[slot] = 0.0
        if a is None or b is None:
            return
        r = a.shape[0]
        if a.shape != (r, self.base.in_features) or b.shape != (self.base.out_features, r):
            raise RequestError(
                "model",
                f"adapter tensors of shapes {tuple(a.shape)}, {tuple(b.shape)} do not fit a layer "
                f"of {self.base.in_features} -> {self.base.out_features} features",
            )
        if r > self.lora_a.shape[1]:
            self._grow(r)
        self.lora_a[slot, :r] = a.to(self.lora_a)
        self.lora_b[slot, :, :r] = b.to(self.lora_b)
        self.scales[slot] = scale

    def _grow(self, rank: int) -> None:
        n, old, _ = self.lora_a.shape
        a = self.lora_a.new_zeros(n, rank, self.base.in_features)
        b = self.lora_b.new_zeros(n, self.base.out_features, rank)
        a[:, :old] = self.lora_a
        b[:, :, :old] = self.lora_b
        self.lora_a, self.lora_b = a, b


@dataclass(frozen=True)
class Adapter:
    """A PEFT adapter as read from its files: `adapter_config.json`'s content and the tensors of
    `adapter_model.safetensors` (keys `base_model.model.<path>.lora_A.weight`, ...)."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @classmethod
    def from_zip(cls, path: Path) -> Adapter:
        """An adapter as a job stores it (the zip `loraq jobs download` gives)."""
        from safetensors.torch import load as load_safetensors

        from worker.engine.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS

        with zipfile.ZipFile(path) as zf:
            config = json.loads(zf.read(ADAPTER_CONFIG))
            tensors = load_safetensors(zf.read(ADAPTER_WEIGHTS))
        return cls(config=config, tensors=tensors)

    @property
    def scale(self) -> float:
        r, alpha = int(self.config["r"]), float(self.config["lora_alpha"])
        return alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r

    def factors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{module path: (A, B)}; PEFT's ".default" adapter name in keys is accepted."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in self.tensors.items():
            key = key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            for part in ("lora_A", "lora_B"):
                suffix = f".{part}.weight"
                if key.startswith(PEFT_PREFIX) and key.endswith(suffix):
                    out.setdefault(key[len(PEFT_PREFIX) : -len(suffix)], {})[part] = value
        return {path: (ab["lora_A"], ab["lora_B"]) for path, ab in out.items() if len(ab) == 2}


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    slot: int = 0  # adapter slot (ServingModel.adapter_slot); 0 = the base model
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # keep generating past EOS up to max_tokens (benchmarks)
    # OpenAI's logprobs: None = none; k >= 0 = each generated token's log-probability and the
    # k most likely tokens at its position (top_logprobs)
    top_logprobs: int | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """log softmax of the logits the token was drawn from (before temperature and top_p, as
    OpenAI reports them): the token's and the `top_logprobs` largest, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class GenResult:
    text: str
    completion_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    token_ids: list[int]  # the generated tokens, EOS excluded (what the tests compare with PEFT)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token of token_ids


class TextStream:
    """Incremental detokenization of one row: `push(token)` returns the new text that is final.

    Held back: an incomplete UTF-8 sequence (decodes to U+FFFD at the end) and any tail that is a
    prefix of a stop string. Once a stop string appears, the text ends before it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def _text(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        assert isinstance(text, str)
        return text

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self._text()
        hits = [text.find(s) for s in self.stop if s in text]
        if hits:
            self.stopped = True
            return self._emit(text[: min(hits)])
        if text.endswith("\ufffd"):
            return ""
        hold = max(
            (n for s in self.stop for n in range(len(s) - 1, 0, -1) if text.endswith(s[:n])), default=0
        )
        return self._emit(text[: len(text) - hold])

    def finish(self) -> str:
        """The held-back tail once the row ends without a stop string."""
        if self.stopped:
            return ""
        return self._emit(self._text())

    def _emit(self, final: str) -> str:
        if not final.startswith(self.sent):  # sent text is never taken back
            return ""
        delta, self.sent = final[len(self.sent) :], final
        return delta


def sample(logits: torch.Tensor, requests: list[GenRequest], generators: list[torch.Generator]) -> list[int]:
    """One token per row of logits (B, V): argmax at temperature 0, else nucleus sampling."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, req in enumerate(requests):
        if req.temperature <= 0:
            continue
        probs = torch.softmax(logits[i].float() / req.temperature, dim=-1)
        if req.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_p.cumsum(0) - sorted_p >= req.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        tokens[i] = int(torch.multinomial(probs.cpu(), 1, generator=generators[i]).item())
    return tokens


class ServingModel:
    """One base model, LoRA slots on every decoder linear layer, an LRU of loaded adapters."""

    def __init__(self, loaded: LoadedModel, max_adapters: int, *, cuda_graphs: bool = True) -> None:
        if max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1, got {max_adapters}")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = next(self.model.parameters()).device
        self.rows = AdapterRows()
        self.layers: dict[str, MultiLoRALinear] = {}
        for path in decoder_linear_paths(self.model):
            parent_path, _, leaf = path.rpartition(".")
            parent = self.model.get_submodule(parent_path) if parent_path else self.model
            base = getattr(parent, leaf)
            layer = MultiLoRALinear(base, self.rows, n_slots=max_adapters + 1)
            setattr(parent, leaf, layer)
            self.layers[path] = layer
        self.model.eval()
        self._slots: OrderedDict[str, int] = OrderedDict()  # adapter key -> slot, oldest first
        self._free = list(range(max_adapters, 0, -1))
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        from worker.engine.data import turn_end_ids

        self.stop_ids = turn_end_ids(self.tokenizer)  # EOS, and the template's end-of-turn token
        # Llama-shaped bases decode over our own KV cache (see the module docstring)
        self.decoder = (
            LlamaDecoder(self.model, self._set_slots, graphs=cuda_graphs)
            if LlamaDecoder.supports(self.model)
            else None
        )
        # Requests can join a batch mid-decode when every cache layer is a plain full-attention
        # one (a sliding-window layer cannot be left-padded); otherwise they wait for it to drain.
        self.joins = self.decoder is not None or all(
            type(layer) is DynamicLayer for layer in DynamicCache(config=self.model.config).layers
        )

    def _set_slots(self, slots: torch.Tensor) -> None:
        self.rows.index = slots

    @property
    def loaded_adapters(self) -> list[str]:
        return list(self._slots)

    def adapter_slot(self, key: str, load: Callable[[], Adapter], *, keep: set[int] | None = None) -> int:
        """The slot holding adapter `key`, loading it with `load()` (evicting the least recently
        used adapter whose slot is not in `keep`, the slots of the batch being formed)."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return self._slots[key]
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._slots.items() if s not in (keep or set())), None)
            if victim is None:
                raise RuntimeError("every adapter slot is in use by the current batch")
            slot = self._slots.pop(victim)
        try:
            self._fill(slot, load())
        except BaseException:
            self._free.append(slot)
            raise
        self._slots[key] = slot
        return slot

    def _fill(self, slot: int, adapter: Adapter) -> None:
        model = self.loaded.model  # the adapter names layers as the base checkpoint's model does
        factors = {model_path(model, path): ab for path, ab in adapter.factors().items()}
        unknown = sorted(set(factors) - set(self.layers))
        if not factors or unknown:
            raise RequestError(
                "model",
                f"the adapter does not fit base model {self.loaded.name!r}: "
                f"{'no LoRA tensors' if not factors else f'unknown layers {unknown[:3]}'}",
            )
        for path, layer in self.layers.items():
            a, b = factors.get(path, (None, None))
            layer.set_slot(slot, a, b, adapter.scale)

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The request's prompt: `messages` and `tools` in the model's chat template."""
        from worker.engine.data import prompt_ids

        if tools and self.tool_format is None:
            raise RequestError(
                "tools",
                f"the chat template of {self.loaded.name!r} writes no tool calls: it takes no tools",
            )
        return prompt_ids(messages, self.tokenizer, tools)

    @property
    def tool_format(self) -> ToolCallFormat | None:
        """How this model's chat template writes tool calls (worker/engine/tool_calls.py)."""
        return tool_call_format(self.tokenizer.chat_template)

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt + max_tokens > self.max_context:
            raise RequestError(
                "messages",
                f"this model's maximum context length is {self.max_context} tokens; the messages use "
                f"{n_prompt} and max_tokens asks for {max_tokens} more",
            )

    def generate(
        self, requests: list[GenRequest], on_text: Callable[[int, str], None] | None = None
    ) -> list[GenResult]:
        """Run every request to its end; `on_text(i, delta)` is called once per generated token of
        request i (delta may be "" while text is held back) and once more with any final tail."""
        batch = DecodeBatch()
        self.admit(batch, list(enumerate(requests)))
        results: dict[Any, GenResult] = {}
        while batch.rows:
            results.update(self.step(batch, on_text))
        return [results[i] for i in range(len(requests))]

    @torch.inference_mode()
    def admit(self, batch: DecodeBatch, requests: list[tuple[Any, GenRequest]]) -> None:
        """Prefill `requests` (key, request) and add them to `batch`, which may be decoding already
        (continuous batching): the next `step` samples their first token with everyone else's."""
        if not requests:
            return
        for _, req in requests:
            self.check_fits(len(req.prompt_ids), req.max_tokens)
        if self.decoder is not None:
            self._admit_kv(batch, requests, self.decoder)
            return
        eos = self.tokenizer.eos_token_id
        pad = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos)
        # Left-padded prefill: every row's last prompt token sits in the last column.
        n = len(requests)
        width = max(len(r.prompt_ids) for _, r in requests)
        ids = torch.full((n, width), pad, dtype=torch.long)
        mask = torch.zeros(n, width, dtype=torch.long)
        for i, (_, r) in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (n, width)
        slots = torch.tensor([r.slot for _, r in requests], device=self.device)
        cache = DynamicCache(config=self.model.config)
        out = self._forward(
            slots, any(r.slot for _, r in requests),
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
        )  # fmt: skip
        batch.merge(self._rows(requests), cache, mask, positions[:, -1] + 1, slots, out.logits[:, -1, :])

    def _rows(self, requests: list[tuple[Any, GenRequest]]) -> list[_Row]:
        return [
            _Row(key, r, TextStream(self.tokenizer, r.stop), torch.Generator().manual_seed(_seed(r.seed)))
            for key, r in requests
        ]

    def _admit_kv(
        self, batch: DecodeBatch, requests: list[tuple[Any, GenRequest]], dec: LlamaDecoder
    ) -> None:
        """Prefill `requests` into cache rows after the batch's rows (the cache grown if needed)."""
        pad = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        rows = self._rows(requests)
        everyone = [*batch.rows, *rows]
        need = max(len(r.req.prompt_ids) + r.req.max_tokens for r in everyone)
        batch.kv = dec.ensure(batch.kv, len(everyone), need)
        start = len(batch.rows)
        try:
            logits = dec.prefill(
                batch.kv, start, [r.prompt_ids for _, r in requests], [r.slot for _, r in requests], pad
            )
        finally:
            self.rows.index = None
        slots = torch.tensor([r.slot for _, r in requests], device=self.device)
        batch.positions += [len(r.prompt_ids) for _, r in requests]
        batch.slots = slots if batch.slots is None else torch.cat([batch.slots, slots])
        batch.logits = logits if batch.logits is None else torch.cat([batch.logits, logits])
        batch.rows += rows

    @torch.inference_mode()
    def step(
        self, batch: DecodeBatch, on_text: Callable[[Any, str], None] | None = None
    ) -> dict[Any, GenResult]:
        """Sample one token for every row of `batch`, end the rows that are done (returned, by
        key), and run the others one position further (KV cache) for the next step."""
        emit = on_text or (lambda _k, _t: None)
        stops = self.stop_ids | {self.tokenizer.eos_token_id}
        assert batch.logits is not None
        tokens = sample(batch.logits, [r.req for r in batch.rows], [r.gen for r in batch.rows])
        wanted = [r.req.top_logprobs is not None for r in batch.rows]
        # (B, V) in fp32, only when some row asked for logprobs
        logprobs = torch.log_softmax(batch.logits.float(), dim=-1) if any(wanted) else None
        done: dict[Any, GenResult] = {}
        keep: list[int] = []
        for i, (row, tok) in enumerate(zip(batch.rows, tokens, strict=True)):
            if tok in stops and not row.req.ignore_eos:
                reason = "stop"
                emit(row.key, row.stream.finish())
            else:
                row.count += 1
                if logprobs is not None and row.req.top_logprobs is not None:
                    row.logprobs.append(_token_logprob(logprobs[i], tok, row.req.top_logprobs))
                emit(row.key, row.stream.push(tok))
                reason = "stop" if row.stream.stopped else "length" if row.count >= row.req.max_tokens else ""
                if reason == "length":
                    emit(row.key, row.stream.finish())
            if reason:
                done[row.key] = GenResult(
                    row.stream.sent, row.count, reason, list(row.stream.ids), list(row.logprobs)
                )
            else:
                keep.append(i)
        batch.keep(keep)
        if batch.rows and self.decoder is not None:
            assert batch.kv is not None
            try:
                batch.logits = self.decoder.decode(
                    batch.kv, [tokens[i] for i in keep], batch.positions, [r.req.slot for r in batch.rows]
                )
            finally:
                self.rows.index = None
            batch.positions = [p + 1 for p in batch.positions]
        elif batch.rows:
            assert batch.mask is not None and batch.next_pos is not None and batch.slots is not None
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(keep), 1)], dim=1)
            out = self._forward(
                batch.slots,
                any(row.req.slot for row in batch.rows),
                input_ids=torch.tensor([tokens[i] for i in keep], device=self.device)[:, None],
                attention_mask=batch.mask,
                position_ids=batch.next_pos[:, None],
                cache=batch.cache,
            )
            batch.next_pos = batch.next_pos + 1
            batch.logits = out.logits[:, -1, :]
        return done

    def _forward(
        self, slots: torch.Tensor, lora: bool, *, cache: DynamicCache | None, **inputs: torch.Tensor
    ) -> Any:
        """The model on `inputs` with row b using adapter slot slots[b] (no LoRA work at all when
        `lora` is False: every row is the base model, known on the host)."""
        self.rows.index = slots if lora else None
        try:
            return self.model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
        finally:
            self.rows.index = None


def _token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`logprobs` (V,): the row's log softmax."""
    values, ids = logprobs.topk(top) if top else (logprobs[:0], logprobs[:0].long())
    alternatives = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), alternatives)


@dataclass
class _Row:
    key: Any  # the caller's handle for the request
    req: GenRequest
    stream: TextStream
    gen: torch.Generator
    count: int = 0  # tokens generated
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with req.top_logprobs set


@dataclass
class DecodeBatch:
    """Rows decoding together and their shared state: each row's adapter slot and the logits (B, V)
    of each row's latest position (what `ServingModel.step` samples next), and either our KV cache
    (`kv`, rows in batch order, each row's next position in `positions`) or transformers' (`cache`,
    (B, heads, L, head_dim) per layer, with the attention mask (B, L) and `next_pos`)."""

    rows: list[_Row] = field(default_factory=list)
    kv: KVCache | None = None  # kept when the batch drains: its buffers and CUDA graphs are reused
    positions: list[int] = field(default_factory=list)
    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None
    next_pos: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def keep(self, indices: list[int]) -> None:
        """Drop every row not in `indices` (positions in `rows`), cache rows included."""
        if len(indices) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in indices]
        self.positions = [self.positions[i] for i in indices] if self.kv is not None else []
        if not indices:
            self.cache = self.mask = self.next_pos = self.slots = self.logits = None
            return
        assert self.slots is not None
        index = torch.tensor(indices, device=self.slots.device)
        self.slots = self.slots[index]  # the logits are replaced by the step that called this
        if self.kv is not None:
            self.kv.keep(indices)
            return
        assert self.cache is not None and self.mask is not None
        assert self.next_pos is not None
        self.cache.batch_select_indices(index)
        self.mask, self.next_pos = self.mask[index], self.next_pos[index]

    def merge(
        self,
        rows: list[_Row],
        cache: DynamicCache,
        mask: torch.Tensor,
        next_pos: torch.Tensor,
        slots: torch.Tensor,
        logits: torch.Tensor,
    ) -> None:
        """Add freshly prefilled rows. Caches of different lengths are left-padded to the longer
        one (zeros, masked out), so every row's newest position stays in the last column."""
        if not self.rows:
            self.rows, self.cache, self.mask = list(rows), cache, mask
            self.next_pos, self.slots, self.logits = next_pos, slots, logits
            return
        assert self.cache is not None and self.mask is not None and self.logits is not None
        assert self.next_pos is not None and self.slots is not None
        length = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            if type(old) is not DynamicLayer or type(new) is not DynamicLayer:  # see ServingModel.joins
                raise RuntimeError("only full-attention caches can be merged")
            assert old.keys is not None and old.values is not None
            assert new.keys is not None and new.values is not None
            old.keys = torch.cat([_left_pad(old.keys, length), _left_pad(new.keys, length)])
            old.values = torch.cat([_left_pad(old.values, length), _left_pad(new.values, length)])
        self.mask = torch.cat([_left_pad(self.mask, length), _left_pad(mask, length)])
        self.next_pos = torch.cat([self.next_pos, next_pos])
        self.slots = torch.cat([self.slots, slots])
        self.logits = torch.cat([self.logits, logits])
        self.rows += rows


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Zeros before `t`'s positions: (B, L) masks and (B, heads, L, head_dim) caches (the position
    axis is dim 1 of a mask, dim 2 of a cache) grown to `length` positions."""
    dim = 1 if t.dim() == 2 else 2
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _seed(seed: int | None) -> int:
    return seed if seed is not None else random.getrandbits(63)


def load_serving_model(
    name: str, *, store: Path, max_adapters: int, device: str | None = None, cuda_graphs: bool = True
) -> ServingModel:
    """The base model `name` on `device` (default: CUDA in bf16 when present, else CPU fp32),
    ready to serve adapters."""
    from worker.engine.models import load_base_model

    use_cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    dtype = torch.bfloat16 if use_cuda else torch.float32
    loaded = load_base_model(name, store=store, device="cuda" if use_cuda else "cpu", dtype=dtype)
    return ServingModel(loaded, max_adapters, cuda_graphs=cuda_graphs)
