"""Every model family of worker/engine/families.py on the CPU path, against transformers + PEFT.

For each family a tiny random model directory (tests/engine/tiny_families.py) is registered as
`loraq models add` does, then:
- the family's description is what transformers builds from that directory and from configs as
  the Hub writes them (norms, activation, q/k norm, biases, embedding scale, per-layer windows and
  RoPE, linear layer names);
- the engine's own CPU step (`LoRAFinetuneRecipe`, the eager Hugging Face step), switched to
  float64, gives each example the per-token losses and LoRA gradients of transformers' model + PEFT
  LoRA built here on the same weights, within 1e-6 relative; packed rows (several examples a row)
  give every example what one example per row gives, windows included;
- the adapter a job exports loads in PEFT and gives the logits the serving engine computes,
  prefill and decode steps;
- `models add` takes exactly these families; the fused GPU path takes all of them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

import worker.engine.recipe as recipe_module
from gpu_kernels.dispatch import KernelStatus
from tests.engine.tiny_families import SHAPE, WINDOW, build_tiny_family, save_tiny_family
from worker.engine import fused_model
from worker.engine.catalog import model_family, register_local_model
from worker.engine.data import IGNORE_INDEX, Batch
from worker.engine.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from worker.engine.families import (
    FAMILIES,
    SUPPORTED_ARCHITECTURES,
    Family,
    family_of_config,
    fused_path_gap,
    layer_attention,
)
from worker.engine.lora import apply_lora, lora_modules, lora_state_dict
from worker.engine.models import load_base_model
from worker.engine.recipe import LoRAFinetuneRecipe, train
from worker.engine.serving import Adapter, DecodeBatch, GenRequest, ServingModel, load_serving_model
from worker.engine.types import LoraConfig, ModelError, NullCallbacks, TrainConfig

ARCHITECTURES = list(FAMILIES)
LORA = LoraConfig(r=4, alpha=8.0)
TOLERANCE = 1e-6  # relative, float64
# (user, assistant) turns of different lengths; every example is longer than two windows
CHATS = [
    ("what is the cat?", "the cat is an animal that likes to sleep in the sun."),
    ("tell me about the dog and the horse.", "the dog is an animal. the horse is an animal too."),
    ("what is a fish?", "a fish is an animal that lives in the water and swims all day long."),
    ("and the bird?", "the bird is an animal."),
    ("what do cows and sheep and goats eat?", "the cow, the sheep and the goat eat grass in the field."),
]


@dataclass(frozen=True)
class Tiny:
    family: Family
    name: str  # its catalog name
    directory: Path
    store: Path


def _name(architecture: str) -> str:
    return "fam-" + architecture.lower().removesuffix("forcausallm")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model store with each family's tiny directory registered (`loraq models add`)."""
    root = tmp_path_factory.mktemp("families")
    for architecture in ARCHITECTURES:
        directory = save_tiny_family(architecture, root / architecture)
        register_local_model(_name(architecture), directory, root / "models")
    return root / "models"


@pytest.fixture(scope="module")
def train_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]} for u, a in CHATS
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny(store: Path, architecture: str) -> Tiny:
    name = _name(architecture)
    family = model_family(name, store)
    assert family is FAMILIES[architecture]
    return Tiny(family, name, store.parent / architecture, store)


# ------------------------------------------------------------------------------- the description


def _module_layers(model: PreTrainedModel) -> list[tuple[int | None, str, float, int]]:
    """What transformers built, layer by layer: (window, RoPE type, RoPE base, rotary dims)."""
    config: Any = model.config
    rotary: Any = model.model.rotary_emb
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
        if isinstance(rotary.rope_type, dict):  # Gemma 3: one table per layer type
            kind = attn.layer_type
            rope_type, params = rotary.rope_type[kind], config.rope_parameters[kind]
            inv_freq = getattr(rotary, f"{kind}_inv_freq")
        else:
            rope_type, params, inv_freq = rotary.rope_type, config.rope_parameters, rotary.inv_freq
        out.append((window, rope_type, float(params["rope_theta"]), 2 * inv_freq.numel()))
    return out


def _described_layers(family: Family, config: dict[str, Any], head_dim: int) -> list[tuple[Any, ...]]:
    return [
        (a.window, a.rope.type, a.rope.theta, int(head_dim * a.rope.rotary_fraction))
        for a in layer_attention(family, config)
    ]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_description_is_what_transformers_builds(architecture: str, store: Path) -> None:
    t = tiny(store, architecture)
    family = t.family
    config = json.loads((t.directory / "config.json").read_text())
    model: Any = AutoModelForCausalLM.from_pretrained(t.directory)
    assert type(model).__name__ == family.architecture and model.config.model_type == family.model_type
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = int(attn.head_dim)
    x = torch.randn(3, 5, model.config.hidden_size)

    # norms: placement, and the (offset + w) weight
    sandwich = hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_feedforward_layernorm")
    assert sandwich == (family.norm == "sandwich")
    norm = model.model.norm
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)))
    expect = (family.norm_offset + norm.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(norm(x), expect)
    # the gate's activation
    act = getattr(mlp, "act_fn", None) or mlp.activation_fn
    want = F.silu(x) if family.activation == "silu" else F.gelu(x, approximate="tanh")
    torch.testing.assert_close(act(x), want)
    # q/k norm, q/k/v biases
    assert (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")) == family.qk_norm
    qkv = [getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "qkv_proj") if hasattr(attn, n)]
    assert all((p.bias is not None) == family.qkv_bias for p in qkv)
    # embedding scale, tied embeddings (and transformers' default for them)
    ids = torch.tensor([[3, 50, 400]])
    scale = math.sqrt(model.config.hidden_size) if family.embedding_scale else 1.0
    torch.testing.assert_close(model.model.embed_tokens(ids), model.model.embed_tokens.weight[ids] * scale)
    assert type(model.config)().tie_word_embeddings == family.tied_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == config["tie_word_embeddings"]
    # attention scale
    scalar = (
        config["query_pre_attn_scalar"] if family.attention_scale == "query_pre_attn_scalar" else head_dim
    )
    assert attn.scaling == pytest.approx(scalar**-0.5)
    # windows and RoPE, layer by layer
    assert _module_layers(model) == _described_layers(family, config, head_dim)
    # the linear layers LoRA wraps, fused ones as the model has them
    apply_lora(model, LORA)
    wrapped = {path.rsplit(".", 1)[-1]: path.split(".")[-2] for path in lora_modules(model)}
    assert wrapped == dict(family.linear_modules)
    for fused, parts in family.packed_modules.items():
        assert fused in wrapped and not set(parts) & set(wrapped)


# Configs as the Hub holds them (older keys: rope_theta beside rope_scaling, rope_local_base_freq,
# sliding_window_pattern, use_sliding_window), at tiny sizes.
HUB_CONFIGS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {  # Llama 3.1
        "rope_theta": 500_000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_type": "llama3",
        },
    },
    "MistralForCausalLM": {"sliding_window": 16, "rope_theta": 1_000_000.0},
    "Qwen2ForCausalLM": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    "Qwen3ForCausalLM": {"use_sliding_window": False, "sliding_window": None, "rope_theta": 1_000_000.0},
    "Gemma3ForCausalLM": {  # Gemma 3 4B's text model: linear scaling on the global layers
        "num_hidden_layers": 7,
        "head_dim": 8,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 16,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 8,
    },
    "Phi3ForCausalLM": {  # Phi-4-mini
        "partial_rotary_factor": 0.75,
        "rope_theta": 10_000.0,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0, 2.0, 4.0], "short_factor": [1.0] * 3},
        "original_max_position_embeddings": 64,
        "sliding_window": 32,
        "pad_token_id": 0,
    },
}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_hub_configs_read_as_transformers_reads_them(architecture: str) -> None:
    family = FAMILIES[architecture]
    config = {
        "architectures": [architecture],
        "model_type": family.model_type,
        **SHAPE,
        **HUB_CONFIGS[architecture],
    }
    assert family_of_config(config, "config.json") is family
    model: Any = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    head_dim = int(model.model.layers[0].self_attn.head_dim)
    assert _module_layers(model) == _described_layers(family, config, head_dim)


# ----------------------------------------------------------------- the engine's step against PEFT


def train_config(t: Tiny, train_file: Path, out: Path, **overrides: Any) -> TrainConfig:
    """Rows of up to 128 tokens (packed: several examples each), 2 rows a micro-batch."""
    values: dict[str, Any] = {"lora": LORA, "max_seq_len": 128, "batch_size": 2, "device": "cpu", **overrides}
    return TrainConfig(model=t.name, train_file=train_file, output_dir=out, model_store=t.store, **values)


def engine(t: Tiny, train_file: Path, out: Path, *, pack: bool) -> LoRAFinetuneRecipe:
    """The job's recipe set up on the CPU, then switched to float64, its adapters drawn at random
    (B nonzero, so LoRA changes the forward and A gets gradients). Drawn in fp32: exported exactly."""
    # no clipping: the gradients are compared as computed
    cfg = train_config(t, train_file, out, pack=pack, max_grad_norm=1e6)
    recipe = LoRAFinetuneRecipe(cfg, NullCallbacks())
    recipe.setup()
    recipe.model.double()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in lora_modules(recipe.model).values():
            for p in (layer.lora_A, layer.lora_B):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return recipe


@dataclass
class Result:
    tokens: torch.Tensor  # (N,) per-token CE, in order
    loss: float  # Σ CE / N
    grads: dict[str, torch.Tensor]  # "<module path>.lora_A" -> gradient


@pytest.fixture
def tapped(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[torch.Tensor]]:
    """The per-token losses of the recipe's step, read where its loss takes the final hidden
    states of the trained positions and the LM head (`lm_loss_sum`)."""
    seen: list[torch.Tensor] = []
    real = recipe_module.lm_loss_sum

    def tap(selected: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor) -> torch.Tensor:
        seen.append(F.cross_entropy(head(selected).double(), targets, reduction="none").detach())
        return real(selected, head, targets)

    monkeypatch.setattr(recipe_module, "lm_loss_sum", tap)
    yield seen


def engine_step(recipe: LoRAFinetuneRecipe, micro: list[Batch], seen: list[torch.Tensor]) -> Result:
    seen.clear()
    recipe.optimizer.zero_grad(set_to_none=True)
    loss, norm = recipe._train_step(micro)
    assert float(norm) < recipe.config.max_grad_norm
    grads = {}
    for path, layer in lora_modules(recipe.model).items():
        for part in ("lora_A", "lora_B"):
            grad = getattr(layer, part).grad
            assert grad is not None and grad.dtype == torch.float64
            grads[f"{path}.{part}"] = grad.clone()
    return Result(torch.cat(seen), float(loss), grads)


def reference(t: Tiny, state: dict[str, torch.Tensor], **config: Any) -> Any:
    """transformers' model from the directory, switched to float64 as the engine's is, + PEFT LoRA
    on the family's linear layers, holding the adapter weights `state` (the engine's, by PEFT's key
    names). Loaded in fp32 first, as the engine loads on the CPU: the fp32 buffers made at init
    (Gemma's embedding scale √hidden) are then equal; Gemma's RMSNorm computes in fp32 inside
    transformers even in a float64 model, so a 1e-8 difference there would round apart."""
    base = AutoModelForCausalLM.from_pretrained(t.directory, **config).double()
    targets = sorted(t.family.linear_modules)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=LORA.r, lora_alpha=int(LORA.alpha), target_modules=targets)
    )
    loaded: Any = peft.set_peft_model_state_dict(model, state)
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if "lora_" in k]
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    return model.eval()


def reference_alone(model: Any, ids: torch.Tensor, labels: torch.Tensor) -> Result:
    """One example run by itself, (T,) ids and labels: its per-token CE and Σ CE / N's gradients."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]  # (T-1, V)
    targets = labels[1:]
    keep = targets != IGNORE_INDEX
    tokens = F.cross_entropy(logits[keep], targets[keep], reduction="none")
    (tokens.sum() / keep.sum()).backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:  # base_model.model.<path>.lora_A.default.weight -> <path>.lora_A
            grads[name.removeprefix("base_model.model.").removesuffix(".default.weight")] = p.grad.clone()
    tokens = tokens.detach()
    return Result(tokens, float(tokens.sum() / keep.sum()), grads)


@dataclass(frozen=True)
class Segment:
    """An example's place in the recipe's batches: row `row` of `batch`, positions [start, end)."""

    batch: Batch
    row: int
    start: int
    end: int

    @property
    def ids(self) -> torch.Tensor:
        return self.batch.input_ids[self.row, self.start : self.end]

    @property
    def labels(self) -> torch.Tensor:
        return self.batch.labels[self.row, self.start : self.end]

    def alone(self) -> Batch:
        """The batch with the loss on this example's tokens only (the rest of its row still runs)."""
        b = self.batch
        labels = torch.full_like(b.labels, IGNORE_INDEX)
        labels[self.row, self.start : self.end] = self.labels
        return Batch(b.input_ids, labels, b.attention_mask, b.position_ids, b.packed)


def segments(recipe: LoRAFinetuneRecipe) -> dict[tuple[int, ...], Segment]:
    """Every example of the recipe's first epoch, keyed by its token ids; an example starts where
    its position_ids restart at 0 (padding excluded)."""
    out = {}
    for i in range(len(recipe.sampler)):
        b = recipe.sampler.batch(0, i)
        for r in range(b.input_ids.shape[0]):
            n = int(b.attention_mask[r].sum())
            starts = [p for p in range(n) if int(b.position_ids[r, p]) == 0] + [n]
            for s, e in pairwise(starts):
                seg = Segment(b, r, s, e)
                out[tuple(seg.ids.tolist())] = seg
    return out


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def assert_same(got: Result, want: Result, what: str) -> None:
    assert got.tokens.shape == want.tokens.shape, what
    per_token = ((got.tokens - want.tokens).abs() / want.tokens.abs()).max()
    assert per_token <= TOLERANCE, f"{what}: per-token losses differ by {per_token:.2e} relative"
    assert abs(got.loss - want.loss) <= TOLERANCE * want.loss, f"{what}: loss {got.loss} vs {want.loss}"
    assert got.grads.keys() == want.grads.keys(), what
    worst = max(got.grads, key=lambda k: rel(got.grads[k], want.grads[k]))
    error = rel(got.grads[worst], want.grads[worst])
    assert error <= TOLERANCE, f"{what}: gradient of {worst} differs by {error:.2e} relative"


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_cpu_step_equals_peft_and_packing_changes_nothing(
    architecture: str, store: Path, train_file: Path, tmp_path: Path, tapped: list[torch.Tensor]
) -> None:
    t = tiny(store, architecture)
    per_example: dict[bool, dict[tuple[int, ...], Result]] = {}
    state: dict[str, torch.Tensor] = {}
    ref: Any = None
    for pack in (False, True):
        recipe = engine(t, train_file, tmp_path / f"pack-{pack}", pack=pack)
        try:
            if ref is None:
                state = lora_state_dict(recipe.model)
                ref = reference(t, state)
            found = segments(recipe)
            assert len(found) == len(CHATS)
            rows = {(id(s.batch), s.row) for s in found.values()}
            assert len(rows) < len(CHATS) if pack else len(rows) == len(CHATS)  # packed: shared rows
            per_example[pack] = {}
            for key, seg in found.items():
                assert len(key) > 2 * WINDOW and int(seg.labels[0]) == IGNORE_INDEX  # no loss across examples
                got = engine_step(recipe, [seg.alone()], tapped)
                assert_same(got, reference_alone(ref, seg.ids, seg.labels), f"example of {len(key)} tokens")
                per_example[pack][key] = got
            # the job's whole step: every batch, Σ CE over all examples / their trainable tokens
            micro = [recipe.sampler.batch(0, i) for i in range(len(recipe.sampler))]
            step = engine_step(recipe, micro, tapped)
            alone = [reference_alone(ref, s.ids, s.labels) for s in found.values()]
            n = sum(r.tokens.numel() for r in alone)
            total = sum(r.loss * r.tokens.numel() for r in alone) / n
            grads = {
                k: torch.stack([r.grads[k] * r.tokens.numel() for r in alone]).sum(0) / n
                for k in alone[0].grads
            }
            assert abs(step.loss - total) <= TOLERANCE * total
            assert max(rel(step.grads[k], grads[k]) for k in grads) <= TOLERANCE
        finally:
            recipe.cleanup()
    for key, unpacked in per_example[False].items():
        assert_same(per_example[True][key], unpacked, "packed vs one example per row")

    if any(
        a.window for a in layer_attention(t.family, json.loads((t.directory / "config.json").read_text()))
    ):
        # the window binds on this data: without it the same example scores otherwise
        wide = reference(t, state, sliding_window=4096)
        seg = next(iter(found.values()))
        windowed, unbounded = (
            reference_alone(ref, seg.ids, seg.labels),
            reference_alone(wide, seg.ids, seg.labels),
        )
        assert (windowed.tokens - unbounded.tokens).abs().max() > 1e-3


# ------------------------------------------------------------------- export, PEFT and serving


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_exported_adapter_loads_in_peft_and_serves_the_same_logits(
    architecture: str, store: Path, train_file: Path, tmp_path: Path
) -> None:
    t = tiny(store, architecture)
    config = train_config(t, train_file, tmp_path / "run", max_steps=3, learning_rate=2e-2)
    adapter_dir = train(config, NullCallbacks()).adapter_dir  # the job's path, export included
    adapter_config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    assert adapter_config["target_modules"] == sorted(t.family.linear_modules)
    assert adapter_config["base_model_name_or_path"] == t.name

    base: Any = AutoModelForCausalLM.from_pretrained(t.directory)
    model: Any = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    wrapped = {
        name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.Linear)
    }
    assert wrapped == set(t.family.linear_modules)

    serving = load_serving_model(t.name, store=t.store, max_adapters=2, device="cpu")
    adapter = Adapter(config=adapter_config, tensors=load_file(str(adapter_dir / ADAPTER_WEIGHTS)))
    question = "what do the cow and the sheep eat in the field, and where does the fish swim?"
    prompt = serving.prompt_ids([{"role": "user", "content": question}])
    assert len(prompt) > 3 * WINDOW  # decoding runs past several windows
    assert_serves_peft_logits(serving, adapter, model, prompt, max_tokens=8)


def assert_serves_peft_logits(
    serving: ServingModel, adapter: Adapter, model: Any, prompt: list[int], max_tokens: int
) -> list[int]:
    """Greedy decoding of `prompt` with `adapter` in the serving engine: at every step its logits
    are those of `model` (PEFT with the same adapter), which the adapter changes; returns the ids."""
    slot = serving.adapter_slot("adapter", lambda: adapter)
    batch = DecodeBatch()
    request = GenRequest(prompt, max_tokens=max_tokens, slot=slot, temperature=0.0, ignore_eos=True)
    serving.admit(batch, [(0, request)])
    ids = list(prompt)
    with torch.no_grad():
        for step in range(request.max_tokens):
            assert batch.logits is not None
            served = batch.logits[0].clone()  # what the next token is sampled from
            want = model(input_ids=torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(served, want, rtol=1e-4, atol=1e-5, msg=f"logits at step {step}")
            if step == 0:  # the adapter changes the answer's logits, so the comparison sees it
                with model.disable_adapter():
                    plain = model(input_ids=torch.tensor([ids])).logits[0, -1]
                assert (plain - want).abs().max() > 1e-2
            done = serving.step(batch)
            ids.append(done[0].token_ids[-1] if done else batch.rows[0].stream.ids[-1])
            assert ids[-1] == int(served.argmax())
    assert done and done[0].token_ids == ids[len(prompt) :]
    return ids


# --------------------------------------------------------------------- catalog and fused path


def test_models_add_takes_exactly_the_described_families(store: Path, tmp_path: Path) -> None:
    assert set(SUPPORTED_ARCHITECTURES) == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "Gemma3ForConditionalGeneration",  # its language model: tests/engine/test_multimodal_text.py
    }
    for architecture in ARCHITECTURES:  # registered by the fixture; each loads as its own class
        assert type(load_base_model(_name(architecture), store=store).model).__name__ == architecture

    def with_config(name: str, **changes: Any) -> Path:
        source = store.parent / "Gemma3ForCausalLM"
        directory = tmp_path / name
        directory.mkdir()
        for file in source.iterdir():
            (directory / file.name).write_bytes(file.read_bytes())
        config = json.loads((source / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **changes}))
        return directory

    other = tmp_path / "store"
    for unsupported in (["Gemma2ForCausalLM"], ["Gemma3nForConditionalGeneration"], ["Phi3VForCausalLM"], []):
        with pytest.raises(ModelError, match="unsupported architecture") as caught:
            register_local_model(
                "other", with_config(f"arch-{len(str(unsupported))}", architectures=unsupported), other
            )
        assert all(a in str(caught.value) for a in SUPPORTED_ARCHITECTURES)
    # a multimodal architecture whose config holds no language model config
    with pytest.raises(ModelError, match=r"names Gemma3ForConditionalGeneration but has no 'text_config'"):
        register_local_model(
            "no-text", with_config("no-text", architectures=["Gemma3ForConditionalGeneration"]), other
        )
    with pytest.raises(
        ModelError, match=r"sets final_logit_softcapping=30\.0; logit soft-capping is not supported"
    ):
        register_local_model("capped", with_config("capped", final_logit_softcapping=30.0), other)
    # a config whose model_type loads another class than its architectures entry names
    register_local_model("mixed", with_config("mixed", architectures=["Qwen3ForCausalLM"]), other)
    with pytest.raises(
        ModelError, match=r"names Qwen3ForCausalLM but its model_type 'gemma3_text' loads Gemma3ForCausalLM"
    ):
        load_base_model("mixed", store=other)
    assert model_family("tiny-llama", other) is FAMILIES["LlamaForCausalLM"]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_fused_path_takes_every_family(architecture: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the fused modules compute per family: tests/engine/test_fused_families.py."""
    monkeypatch.setattr(fused_model.gpu_kernels, "available", lambda: KernelStatus(True, "forced for a test"))
    model = build_tiny_family(architecture)
    apply_lora(model, LORA)
    report = fused_model.fuse_model(model)
    assert fused_model.fused_stack(model.model) and not report.skipped


def test_fused_path_refuses_a_llama_config_it_does_not_cover() -> None:
    llama = FAMILIES["LlamaForCausalLM"]
    config: dict[str, Any] = {"num_hidden_layers": 2, "rope_theta": 10_000.0}
    assert fused_path_gap(llama, config) is None
    yarn = {**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert fused_path_gap(llama, yarn) == "RoPE type yarn: the fused step reads one static cos/sin table"
