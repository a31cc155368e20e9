"""The language model of a multimodal checkpoint: Gemma 3 4B, 12B and 27B ship on the Hub as
`Gemma3ForConditionalGeneration` (a SigLIP vision tower, a projector and a Gemma 3 text model),
and only the 1B as `Gemma3ForCausalLM`. Loraq trains the text model of such a directory.

A tiny random multimodal Gemma 3 is saved by transformers (its weights under the Hub's
`language_model.model.` names), registered as `loraq models add` does, and checked against
transformers' own multimodal model:
- its family, parameter count and context length are the text model's, also from a config as the
  Hub writes it (a `text_config` listing only what differs from Gemma3TextConfig's defaults);
- pulled from the suite's Hub through the real huggingface_hub client, it loads as it does from
  a directory;
- it loads as Gemma3ForCausalLM without the vision tower, and computes the multimodal model's
  logits on text; the transformers-5 layout (`model.language_model.`) loads the same; a checkpoint
  missing a text weight is refused, naming it;
- a job's adapter names its layers as the multimodal model does, loads there in PEFT wrapping no
  vision layer, and gives the logits the serving engine computes; merged, it is the text model
  alone with PEFT's logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

from tests.engine.test_families import assert_serves_peft_logits
from tests.engine.tiny_families import NOISE, tiny_config
from tests.fake_hub import hub_endpoint
from worker.engine.catalog import get_model_info, model_shape, register_local_model
from worker.engine.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_merged
from worker.engine.families import FAMILIES, GEMMA3, layer_attention, text_config
from worker.engine.memory_plan import ModelDims
from worker.engine.model_shape import shape_of_config
from worker.engine.models import load_base_model
from worker.engine.pull import pull_model
from worker.engine.recipe import train
from worker.engine.serving import Adapter, load_serving_model
from worker.engine.tiny import build_tiny_tokenizer
from worker.engine.types import LoraConfig, ModelError, NullCallbacks, TrainConfig

NAME = "tiny-gemma3-multimodal"
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}
CHATS = [
    ("what is the cat?", "the cat is an animal that likes to sleep in the sun."),
    ("what is a fish?", "a fish is an animal that lives in the water and swims all day long."),
    ("and the bird?", "the bird is an animal."),
]


def multimodal_config() -> Gemma3Config:
    """tests/engine/tiny_families.py's tiny Gemma 3 text model inside a multimodal config."""
    text = tiny_config("Gemma3ForCausalLM").to_dict()
    return Gemma3Config(
        text_config=text,
        vision_config=VISION,
        mm_tokens_per_image=4,
        boi_token_index=509,
        eoi_token_index=510,
        image_token_index=511,
    )


def build_multimodal(directory: Path) -> Path:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma3ForConditionalGeneration(multimodal_config())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * NOISE)
    model.save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_multimodal(tmp_path_factory.mktemp("multimodal") / "gemma3")


@pytest.fixture(scope="module")
def store(directory: Path) -> Path:
    store = directory.parent / "models"
    register_local_model(NAME, directory, store)
    return store


def multimodal_logits(directory: Path, ids: list[int]) -> torch.Tensor:
    model = Gemma3ForConditionalGeneration.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


# ------------------------------------------------------------------------------ what it is


@pytest.mark.parametrize("family", [f for f in FAMILIES.values() if f.config_defaults], ids=lambda f: f.name)
def test_the_family_defaults_are_its_config_class_defaults(family: Any) -> None:
    defaults = AutoConfig.for_model(family.model_type).to_dict()
    assert {k: defaults[k] for k in family.config_defaults} == dict(family.config_defaults)


def test_a_hub_config_reads_as_transformers_reads_it() -> None:
    """Gemma 3 4B's config.json as on the Hub: the text_config lists only what differs."""
    hub: dict[str, Any] = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model", "image_size": 896, "patch_size": 14},
        "mm_tokens_per_image": 256,
    }
    theirs: Any = Gemma3Config(**{k: v for k, v in hub.items() if k != "architectures"}).get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(theirs)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    shape = shape_of_config(hub, "config.json")
    assert shape.family is GEMMA3
    assert shape.parameters == sum(p.numel() for p in model.parameters())  # 3.88e9: no vision tower
    assert shape.context_length == theirs.max_position_embeddings == 131_072
    dims = ModelDims.from_config(hub)
    assert (dims.hidden, dims.layers, dims.heads, dims.kv_heads, dims.head_dim, dims.vocab, dims.tied) == (
        2560,
        34,
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        theirs.head_dim,
        theirs.vocab_size,
        True,
    )
    assert dims.sandwich
    layers = layer_attention(GEMMA3, text_config(hub, "config.json"))
    assert [a.kind for a in layers] == theirs.layer_types
    for a in layers:
        params = theirs.rope_parameters[a.kind]
        assert (a.rope.type, a.rope.theta, a.rope.factor) == (
            params["rope_type"],
            params["rope_theta"],
            params.get("factor"),
        )
        assert a.window == (1024 if a.kind == "sliding_attention" else None)
    without = {k: v for k, v in hub.items() if k != "text_config"}
    with pytest.raises(ModelError, match=r"names Gemma3ForConditionalGeneration but has no 'text_config'"):
        shape_of_config(without, "config.json")


def test_the_catalog_lists_the_text_model(directory: Path, store: Path) -> None:
    shape = model_shape(NAME, store)
    text = AutoModelForCausalLM.from_config(tiny_config("Gemma3ForCausalLM"))
    assert shape is not None and shape.family is GEMMA3
    assert shape.parameters == sum(p.numel() for p in text.parameters())
    assert shape.context_length == 256


# --------------------------------------------------------------------------------- loading


def test_the_language_model_loads_alone_and_computes_the_multimodal_models_logits(
    directory: Path, store: Path, tmp_path: Path
) -> None:
    keys = set(load_file(str(directory / "model.safetensors")))
    assert any(k.startswith("language_model.model.layers.") for k in keys)  # the Hub's layout
    assert any(k.startswith("vision_tower.") for k in keys)
    loaded = load_base_model(NAME, store=store)
    model: Any = loaded.model
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert not [n for n, _ in model.named_parameters() if "vision" in n or "multi_modal" in n]
    # the worker's memory plan reads the loaded model's config (step_memory): a Gemma 3 there too
    assert model.config.architectures == ["Gemma3ForCausalLM"]
    assert ModelDims.from_config(model.config.to_dict()).sandwich
    ids = loaded.tokenizer("the cat is an animal that likes to sleep in the sun.")["input_ids"]
    with torch.no_grad():
        ours = model(input_ids=torch.tensor([ids])).logits[0]
    want = multimodal_logits(directory, ids)
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-5)

    # the layout transformers 5 keeps in memory (some tools save it so) loads the same weights
    relaid = tmp_path / "relaid"
    relaid.mkdir()
    for file in directory.iterdir():
        (relaid / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(directory / "model.safetensors"))
    save_file(
        {k.replace("language_model.model.", "model.language_model.", 1): v for k, v in tensors.items()},
        str(relaid / "model.safetensors"),
        metadata={"format": "pt"},
    )
    register_local_model("relaid", relaid, store)
    with torch.no_grad():
        again = load_base_model("relaid", store=store).model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(again, ours, rtol=0, atol=0)

    # a text weight missing: refused, named (transformers would start it from its random init)
    save_file(
        {k: v for k, v in tensors.items() if k != "language_model.model.layers.1.mlp.up_proj.weight"},
        str(relaid / "model.safetensors"),
        metadata={"format": "pt"},
    )
    with pytest.raises(
        ModelError, match=r"lacks weights of its language model: model\.layers\.1\.mlp\.up_proj"
    ):
        load_base_model("relaid", store=store)


def test_a_hub_pull_of_the_multimodal_repository_trains_its_language_model(
    directory: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`loraq models pull google/gemma-3-4b-it` through the real huggingface_hub client against the
    suite's Hub (tests/fake_hub.py) serving the tiny multimodal checkpoint under that id."""
    repo = "google/gemma-3-4b-it"
    store = tmp_path / "models"
    with hub_endpoint(monkeypatch, repo, directory):
        pull_model(repo, store)
    info = get_model_info(repo, store)
    text = AutoModelForCausalLM.from_config(tiny_config("Gemma3ForCausalLM"))
    assert (info.pulled, info.family, info.parameters) == (
        True,
        "Gemma 3",
        sum(p.numel() for p in text.parameters()),
    )
    loaded = load_base_model(repo, store=store)
    ids = [5, 17, 42, 9, 300]
    with torch.no_grad():
        ours = loaded.model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, multimodal_logits(directory, ids), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------- a job's adapter


def test_a_jobs_adapter_loads_in_peft_on_the_multimodal_model_and_serves_the_same_logits(
    directory: Path, store: Path, tmp_path: Path
) -> None:
    data = tmp_path / "train.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]} for u, a in CHATS
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = TrainConfig(
        model=NAME,
        train_file=data,
        output_dir=tmp_path / "run",
        model_store=store,
        lora=LoraConfig(r=4, alpha=8.0),
        max_seq_len=128,
        batch_size=2,
        device="cpu",
        max_steps=3,
        learning_rate=2e-2,
    )
    adapter_dir = train(config, NullCallbacks()).adapter_dir  # the job's path, export included
    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    layers = tiny_config("Gemma3ForCausalLM").num_hidden_layers
    assert len(tensors) == 2 * 7 * layers
    assert all(k.startswith("base_model.model.model.language_model.layers.") for k in tensors)
    adapter_config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    assert adapter_config["target_modules"] == sorted(GEMMA3.linear_modules)

    base = Gemma3ForConditionalGeneration.from_pretrained(directory)
    model: Any = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    wrapped = [n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.Linear)]
    assert len(wrapped) == 7 * layers  # the vision tower's q/k/v are left alone
    assert all(".model.language_model.layers." in n for n in wrapped)

    serving = load_serving_model(NAME, store=store, max_adapters=2, device="cpu")
    prompt = serving.prompt_ids([{"role": "user", "content": "what does the fish do all day long?"}])
    adapter = Adapter(config=adapter_config, tensors=tensors)
    ids = assert_serves_peft_logits(serving, adapter, model, prompt, max_tokens=4)

    # merged: the text model alone, computing what PEFT does on the multimodal model
    loaded = load_base_model(NAME, store=store)
    merged = AutoModelForCausalLM.from_pretrained(export_merged(adapter_dir, loaded, tmp_path / "merged"))
    assert type(merged).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0]
        torch.testing.assert_close(
            merged(input_ids=torch.tensor([ids])).logits[0], want, rtol=1e-4, atol=1e-5
        )
