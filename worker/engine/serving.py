"""Serving LoRA adapters on a shared base model: batched decoding with a KV cache, mixed adapters.

One `ServingModel` owns one base model. Every linear layer LoRA can target (all but the output
head) is replaced by a `MultiLoRALinear` that holds a stack of adapter slots:

    lora_a (N, r, in), lora_b (N, out, r), scales (N,)     slot 0 = no adapter (zeros, scale 0)

and applies, for row b of a batch, the slot `index[b]` (gpu_kernels.lora_linear_multi: one
batch mixes requests for different adapters of the base, as Punica's SGMV and S-LoRA do).
Adapters are loaded into slots on demand and evicted least-recently-used. Ranks differ between
adapters: the stacks are zero-padded to the largest rank loaded, which adds exact zeros.

`generate` runs a batch to completion: a left-padded prefill, then one token per row per step
against a `DynamicCache`; finished rows leave the batch (cache rows dropped), so a long request
does not make short ones pay. Text is detokenized incrementally with stop strings held back
until they can no longer match.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedTokenizerBase

import gpu_kernels
from worker.engine.lora import PEFT_PREFIX, _decoder_linear_names
from worker.engine.models import LoadedModel
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


@dataclass
class GenResult:
    text: str
    completion_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) | "length"


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

    def __init__(self, loaded: LoadedModel, max_adapters: int) -> None:
        if max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1, got {max_adapters}")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = next(self.model.parameters()).device
        self.rows = AdapterRows()
        self.layers: dict[str, MultiLoRALinear] = {}
        for path in _decoder_linear_names(self.model):
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
        factors = adapter.factors()
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

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        from worker.engine.data import prompt_ids

        return prompt_ids(messages, self.tokenizer)

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt + max_tokens > self.max_context:
            raise RequestError(
                "messages",
                f"this model's maximum context length is {self.max_context} tokens; the messages use "
                f"{n_prompt} and max_tokens asks for {max_tokens} more",
            )

    @torch.inference_mode()
    def generate(
        self, requests: list[GenRequest], on_text: Callable[[int, str], None] | None = None
    ) -> list[GenResult]:
        """Run every request to its end; `on_text(i, delta)` is called once per generated token of
        request i (delta may be "" while text is held back) and once more with any final tail."""
        if not requests:
            return []
        for req in requests:
            self.check_fits(len(req.prompt_ids), req.max_tokens)
        emit = on_text or (lambda _i, _t: None)
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        streams = [TextStream(self.tokenizer, r.stop) for r in requests]
        generators = [torch.Generator().manual_seed(_seed(r.seed)) for r in requests]
        counts = [0] * len(requests)
        reasons = [""] * len(requests)

        # Left-padded prefill: every row's last prompt token sits in the last column.
        n = len(requests)
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((n, width), int(pad), dtype=torch.long)
        mask = torch.zeros(n, width, dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, width)
        slots = torch.tensor([r.slot for r in requests], device=self.device)
        active = list(range(n))  # request index of each batch row
        cache = DynamicCache(config=self.model.config)
        self.rows.index = slots if any(r.slot for r in requests) else None
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            next_pos = positions[:, -1] + 1  # (B,)
            while True:
                logits = out.logits[:, -1, :]  # (B_active, V)
                tokens = sample(logits, [requests[i] for i in active], [generators[i] for i in active])
                keep: list[int] = []
                for row, (i, tok) in enumerate(zip(active, tokens, strict=True)):
                    req, stream = requests[i], streams[i]
                    if tok == eos:
                        reasons[i] = "stop"
                        emit(i, stream.finish())
                        continue
                    counts[i] += 1
                    emit(i, stream.push(tok))
                    if stream.stopped:
                        reasons[i] = "stop"
                    elif counts[i] >= req.max_tokens:
                        reasons[i] = "length"
                        emit(i, stream.finish())
                    else:
                        keep.append(row)
                if not keep:
                    break
                if len(keep) < len(active):
                    rows = torch.tensor(keep, device=self.device)
                    cache.batch_select_indices(rows)
                    mask, next_pos, slots = mask[rows], next_pos[rows], slots[rows]
                    if self.rows.index is not None:
                        self.rows.index = slots
                    active = [active[r] for r in keep]
                tokens = [tokens[r] for r in keep]
                mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
                out = self.model(
                    input_ids=torch.tensor(tokens, device=self.device)[:, None],
                    attention_mask=mask,
                    position_ids=next_pos[:, None],
                    past_key_values=cache,
                    use_cache=True,
                )
                next_pos = next_pos + 1
        finally:
            self.rows.index = None
        return [
            GenResult(text=s.sent, completion_tokens=c, finish_reason=f)
            for s, c, f in zip(streams, counts, reasons, strict=True)
        ]


def _seed(seed: int | None) -> int:
    return seed if seed is not None else random.getrandbits(63)


def load_serving_model(
    name: str, *, store: Path, max_adapters: int, device: str | None = None
) -> ServingModel:
    """The base model `name` on `device` (default: CUDA in bf16 when present, else CPU fp32),
    ready to serve adapters."""
    from worker.engine.models import load_base_model

    use_cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    dtype = torch.bfloat16 if use_cuda else torch.float32
    loaded = load_base_model(name, store=store, device="cuda" if use_cuda else "cpu", dtype=dtype)
    return ServingModel(loaded, max_adapters)
