"""Base models: catalog, tiny-llama determinism, presets, local directories, the real SmolLM2."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BatchEncoding,
    GenerationMixin,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tests.engine.conftest import WriteJsonl, chat
from worker.engine.catalog import (
    PRESET_SHAPES,
    builtin_names,
    get_model_info,
    list_models,
    register_local_model,
)
from worker.engine.data import IGNORE_INDEX, read_examples
from worker.engine.models import LoadedModel, load_base_model
from worker.engine.types import ModelError

# sha256 over tiny-llama's state dict (names and fp32 bytes, sorted by name): identical on every machine
# sha256 of the smollm2-135m preset's layers[3].mlp.up_proj.weight (fp32 bytes), seed PRESET_SEED
SMOLLM2_PRESET_UP_PROJ_SHA256 = "193c0265a5f94b685054e14fc9f59bef3da523dd86f95f4d308da6cada315384"
# sha256 of tiny-llama's tokenizer (vocabulary, merges, specials) as tokenizers serialises it
TINY_TOKENIZER_SHA256 = "7682039ee619f2cbbb2b44e29a3fce650888972517fcff05c66fdb6439ac57d5"
TINY_WEIGHTS_SHA256 = "4725336854209fcbc92598ca87bce4c626abe669b24bef825075706432da5f8b"


def state_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------ catalog


def test_catalog_lists_builtins_and_labels_random(model_store: Path) -> None:
    infos = {i.name: i for i in list_models(model_store)}
    assert list(infos) == builtin_names()
    assert set(infos) == {"smollm2-135m-instruct", "tiny-llama", "llama-1b", "llama-8b", "smollm2-135m"}
    for name in ("tiny-llama", "llama-1b", "llama-8b", "smollm2-135m"):
        assert infos[name].kind == "random" and infos[name].random and infos[name].pulled
    smol = infos["smollm2-135m-instruct"]
    assert smol.kind == "pretrained" and not smol.random and not smol.pulled and smol.path is None


def test_unknown_model_names_the_model_and_lists_known_ones(model_store: Path) -> None:
    with pytest.raises(
        ModelError, match=r"unknown model 'gpt-5'; known models: smollm2-135m-instruct, tiny-llama"
    ):
        get_model_info("gpt-5", model_store)


def test_unpulled_pretrained_model_says_how_to_pull(model_store: Path) -> None:
    with pytest.raises(ModelError, match="run `loraq models pull smollm2-135m-instruct`"):
        load_base_model("smollm2-135m-instruct", store=model_store)


# --------------------------------------------------------------------------------------- tiny-llama


def test_tiny_llama_weights_are_bit_identical_everywhere(tiny: LoadedModel, model_store: Path) -> None:
    torch.manual_seed(99)  # the caller's RNG state must not matter
    again = load_base_model("tiny-llama", store=model_store)
    for (name, a), (_, b) in zip(
        tiny.model.state_dict().items(), again.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    # the digests were computed once in another process and pinned: same weights and token ids on
    # every run and machine (the tokenizer is trained from tiny_corpus.txt at each load)
    assert state_digest(tiny.model) == TINY_WEIGHTS_SHA256
    serialized = again.tokenizer.backend_tokenizer.to_str().encode()
    assert hashlib.sha256(serialized).hexdigest() == TINY_TOKENIZER_SHA256


def test_tiny_llama_is_small_and_leaves_global_rng_alone(model_store: Path) -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    loaded = load_base_model("tiny-llama", store=model_store)
    assert torch.equal(torch.rand(3), expected)
    n_params = sum(p.numel() for p in loaded.model.parameters())
    assert 100_000 < n_params < 1_000_000  # a few MB in fp32
    assert loaded.is_random and loaded.model.config.model_type == "llama"


def test_tiny_tokenizer_chat_template_and_special_tokens(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    assert 300 <= len(tok) <= tiny.model.config.vocab_size
    for special in ("<|im_start|>", "<|im_end|>", "<|pad|>", "<|endoftext|>"):
        assert tok(special, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(special)]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    without_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert isinstance(without_prompt, str) and without_prompt.endswith("Hi<|im_end|>\n")
    sentence = "Byte-level: naïve café ☕ 42!"
    assert tok.decode(tok(sentence, add_special_tokens=False)["input_ids"]) == sentence


def test_tiny_llama_in_bf16() -> None:
    loaded = load_base_model("tiny-llama", store=Path("."), dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    logits = loaded.model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, loaded.model.config.vocab_size) and torch.isfinite(logits).all()


# ------------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize(
    ("name", "params"),
    [("llama-1b", 1_235_814_400), ("llama-8b", 8_030_261_248), ("smollm2-135m", 134_515_008)],
)
def test_presets_are_created_directly_on_the_target_device(name: str, params: int, model_store: Path) -> None:
    # the meta device allocates nothing: the model is never materialised on the host first
    loaded = load_base_model(name, store=model_store, device="meta", dtype=torch.bfloat16)
    weights = list(loaded.model.parameters())
    assert {p.device.type for p in weights} == {"meta"} and {p.dtype for p in weights} == {torch.bfloat16}
    assert sum(p.numel() for p in weights) == params == PRESET_SHAPES[name].parameter_count()
    assert loaded.is_random


def test_smollm2_135m_preset_has_smollm2_shape_and_seeded_weights(model_store: Path) -> None:
    model = load_base_model("smollm2-135m", store=model_store).model
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        576,
        30,
        9,
        3,
    )
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (1536, 49152, True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # seeded: one layer's weights match a digest pinned from an earlier run
    weight = model.model.layers[3].mlp.up_proj.weight.detach().contiguous().numpy().tobytes()
    assert hashlib.sha256(weight).hexdigest() == SMOLLM2_PRESET_UP_PROJ_SHA256


# ------------------------------------------------------------------------------------ local models


def save_local(model: PreTrainedModel, tiny: LoadedModel, directory: Path) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    tiny.tokenizer.save_pretrained(directory)
    return directory


def test_local_llama_directory_round_trip(tiny: LoadedModel, model_store: Path, tmp_path: Path) -> None:
    directory = save_local(tiny.model, tiny, tmp_path / "my-llama")
    # a pickle next to the safetensors must never be read: make it garbage
    (directory / "pytorch_model.bin").write_bytes(b"not a pickle, never unpickled")
    info = register_local_model("my-llama", directory, model_store)
    assert info.kind == "local" and info.path == str(directory) and not info.random
    registry = json.loads((model_store / "registry.json").read_text())
    assert registry == {"models": {"my-llama": {"path": str(directory)}}}
    assert [i.name for i in list_models(model_store)][-1] == "my-llama"

    loaded = load_base_model("my-llama", store=model_store)
    assert not loaded.is_random
    ids = torch.tensor([[1, 50, 60, 70, 2]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, tiny.model(ids).logits)
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == (
        "<|im_start|>user\nx<|im_end|>\n"
    )


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_qwen2_and_mistral_directories_load(
    family: str, tiny: LoadedModel, model_store: Path, tmp_path: Path
) -> None:
    shape: dict[str, Any] = {  # keyword arguments of both configs' constructors
        "vocab_size": 512,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    torch.manual_seed(0)
    model = (
        Qwen2ForCausalLM(Qwen2Config(**shape))
        if family == "qwen2"
        else MistralForCausalLM(MistralConfig(**shape))
    )
    register_local_model(family, save_local(model, tiny, tmp_path / family), model_store)
    loaded = load_base_model(family, store=model_store)
    assert type(loaded.model) is type(model)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, model.eval()(ids).logits)


def _write_config(directory: Path, architectures: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": architectures, "model_type": "x"}))


def test_local_add_errors(model_store: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    with pytest.raises(ModelError, match="does not exist"):
        register_local_model("m", d, model_store)
    d.mkdir()
    with pytest.raises(ModelError, match=r"has no config\.json"):
        register_local_model("m", d, model_store)
    (d / "config.json").write_text("{broken")
    with pytest.raises(ModelError, match=r"config\.json is not valid JSON"):
        register_local_model("m", d, model_store)
    _write_config(d, ["GPT2LMHeadModel"])
    with pytest.raises(ModelError, match=r"unsupported architecture \['GPT2LMHeadModel'\].*LlamaForCausalLM"):
        register_local_model("m", d, model_store)
    _write_config(d, ["LlamaForCausalLM"])
    with pytest.raises(ModelError, match=r"no \*\.safetensors weights"):
        register_local_model("m", d, model_store)
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(
        ModelError, match=r"only pickle checkpoints \(pytorch_model.bin\); pickles are never loaded"
    ):
        register_local_model("m", d, model_store)
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match="has no tokenizer"):
        register_local_model("m", d, model_store)
    with pytest.raises(ModelError, match="is a built-in model"):
        register_local_model("tiny-llama", d, model_store)
    with pytest.raises(ModelError, match="invalid model name 'Bad Name'"):
        register_local_model("Bad Name", d, model_store)
    assert not (model_store / "registry.json").exists()  # nothing was registered


def test_registered_directory_that_lost_its_weights(
    tiny: LoadedModel, model_store: Path, tmp_path: Path
) -> None:
    directory = save_local(tiny.model, tiny, tmp_path / "gone")
    register_local_model("gone", directory, model_store)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"no \*\.safetensors weights"):
        load_base_model("gone", store=model_store)


def test_corrupt_registry_is_reported(model_store: Path) -> None:
    (model_store / "registry.json").write_text("[]")
    with pytest.raises(ModelError, match=r"registry\.json is corrupt"):
        list_models(model_store)


# ------------------------------------------------------------------------- the real SmolLM2 (slow)


@pytest.fixture(scope="module")
def smollm2(pulled_store: Path) -> LoadedModel:
    return load_base_model("smollm2-135m-instruct", store=pulled_store)


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2: LoadedModel) -> None:
    tok = smollm2.tokenizer
    assert not smollm2.is_random
    cfg = smollm2.model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (576, 30, 49152)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert isinstance(inputs, BatchEncoding)
    model = smollm2.model
    assert isinstance(model, GenerationMixin)  # transformers 5's PreTrainedModel has no generate
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_smollm2_chat_template_masks(smollm2: LoadedModel, write_jsonl: WriteJsonl) -> None:
    """SmolLM2's template adds a default system prompt; only the assistant turn is still trained."""
    row = chat(("user", "What is the capital of France?"), ("assistant", "Paris."))
    (ex,), report = read_examples(write_jsonl([row]), smollm2.tokenizer, 256)
    assert report.ok
    trained = [t for t, lab in zip(ex.input_ids, ex.labels, strict=True) if lab != IGNORE_INDEX]
    assert smollm2.tokenizer.decode(trained) == "Paris.<|im_end|>\n"
    assert "You are a helpful AI assistant named SmolLM" in smollm2.tokenizer.decode(ex.input_ids)


@pytest.mark.slow
def test_smollm2_is_dense_and_saves_as_plain_safetensors(smollm2: LoadedModel, tmp_path: Path) -> None:
    """The GGUF is dequantized on load; the model must not stay marked quantized (merged export saves it)."""
    model = smollm2.model
    assert not model.is_quantized and "quantization_config" not in model.config.to_dict()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    model.save_pretrained(tmp_path, safe_serialization=True)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, use_safetensors=True)
    ids = torch.tensor([[1, 4093, 198, 1780, 314]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_gpt2_style_tokenizer_files_are_accepted(model_store: Path, tmp_path: Path) -> None:
    d = tmp_path / "qwen"
    _write_config(d, ["Qwen2ForCausalLM"])
    (d / "model-00001-of-00001.safetensors").write_bytes(b"")
    (d / "vocab.json").write_text("{}")
    with pytest.raises(ModelError, match="has no tokenizer"):
        register_local_model("qwen", d, model_store)
    (d / "merges.txt").write_text("")
    assert register_local_model("qwen", d, model_store).kind == "local"


def test_catalog_names_upstream_ids_and_marks_test_only_models(model_store: Path) -> None:
    from worker.engine.catalog import catalog_name, upstream_id

    infos = {i.name: i for i in list_models(model_store)}
    assert infos["smollm2-135m-instruct"].upstream == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert infos["smollm2-135m-instruct"].use == "fine-tuning"
    assert infos["tiny-llama"].use == "tests" and infos["tiny-llama"].upstream == "tiny-llama"
    assert {infos[n].use for n in ("llama-1b", "llama-8b", "smollm2-135m")} == {"benchmarks"}
    for name in infos:
        assert catalog_name(upstream_id(name)) == name
