"""`load_base_model(name)`: one entry point for every base model in the catalog.

- pretrained (smollm2-135m-instruct): the pulled GGUF, dequantized by transformers' GGUF support
  (~13 s of CPU on a 2-core machine: the tokenizer comes from its converted files, and the GGUF's
  metadata is parsed once and gguf's name map built once, see `_gguf_parsed_once`). Nothing is
  cached across loads, so a caller that loads it repeatedly keeps the returned LoadedModel.
- random presets (tiny-llama, llama-1b, llama-8b, smollm2-135m): seeded random init, created
  directly on the target device (an 8B model never passes through host memory); with nf4/int8
  quantization, a decoder layer at a time, each quantized as it is made (a 70B shape fits one
  80 GB GPU without ever existing in bf16).
- local directories registered with `loraq models add`: safetensors only, never pickles; of a
  multimodal checkpoint (Gemma 3 4B and up) the language model only, as its family's causal LM.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from worker.engine.catalog import PRESET_SHAPES, PRETRAINED, PresetShape, get_model_info, validate_model_dir
from worker.engine.families import Multimodal, multimodal_of_config
from worker.engine.gguf_tokenizer import load_gguf_tokenizer
from worker.engine.lora import CHECKPOINT_PATHS
from worker.engine.quantize import QuantizeReport, quantize_model, use_gguf_blocks
from worker.engine.tiny import build_tiny_llama, build_tiny_tokenizer
from worker.engine.types import ConfigError, ModelError, QuantizationName

PRESET_SEED = 0


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    is_random: bool
    quantization: QuantizationName | None = None  # how its frozen linear layers are stored
    note: str | None = None  # what quantizing it did, in words (a job's event)


def load_base_model(
    name: str,
    *,
    store: Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: QuantizationName | None = None,
) -> LoadedModel:
    """Load `name` in eval mode on `device` with floating-point weights in `dtype`; with
    `quantization`, its decoder linear layers quantized (worker/engine/quantize.py)."""
    info = get_model_info(name, store)
    device = torch.device(device)
    if quantization == "gguf" and info.kind != "pretrained":
        raise ConfigError(
            "quantization",
            f'quantization "gguf" keeps a GGUF file\'s blocks; model {name!r} is not a GGUF base '
            "(use nf4 or int8)",
        )
    if name == "tiny-llama":
        model, tokenizer = build_tiny_llama()
        loaded = LoadedModel(_move(model, device, dtype), tokenizer, name, is_random=True)
    elif info.kind == "random":
        loaded = _load_preset(name, device, dtype, quantization)
    elif info.kind == "pretrained":
        loaded = _load_pretrained(name, store, device, dtype, keep_blocks=quantization == "gguf")
    else:
        assert info.path is not None
        loaded = _load_local(name, Path(info.path), device, dtype, quantization)
    if quantization in ("nf4", "int8") and loaded.quantization is None:
        report = quantize_model(loaded.model, quantization, device=device, dtype=dtype)
        loaded.note = report.sentence(quantization)
    loaded.quantization = quantization
    loaded.model.eval()
    _ensure_pad_token(loaded.tokenizer)
    return loaded


def load_tokenizer(name: str, *, store: Path) -> PreTrainedTokenizerBase:
    """The tokenizer `load_base_model(name)` would come with, without loading any weights (a
    dry run of a llama-8b job must not allocate 8B parameters)."""
    info = get_model_info(name, store)
    if info.kind == "random":
        tokenizer: PreTrainedTokenizerBase = build_tiny_tokenizer()
    elif info.kind == "pretrained":
        source = PRETRAINED[name]
        if not (store / name / source.filename).is_file():
            raise ModelError(f"model {name!r} is not pulled yet; run `loraq models pull {name}`")
        tokenizer = load_gguf_tokenizer(store / name, source.filename)
    else:
        assert info.path is not None
        if info.kind == "local":  # a Hub model's tokenizer is there before its weights (a submit)
            validate_model_dir(Path(info.path))
        tokenizer = AutoTokenizer.from_pretrained(info.path)
    _ensure_pad_token(tokenizer)
    return tokenizer


def _load_preset(
    name: str, device: torch.device, dtype: torch.dtype, quantization: QuantizationName | None = None
) -> LoadedModel:
    """Random init directly on `device`, seeded; tokenizer from tiny-llama.

    The ids of the tiny tokenizer (< 512) are valid in every preset's vocabulary, so benchmarks can
    feed real text.
    """
    return load_random_shape(PRESET_SHAPES[name], name, device=device, dtype=dtype, quantization=quantization)


def load_random_shape(
    shape: PresetShape,
    name: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    quantization: QuantizationName | None = None,
) -> LoadedModel:
    """A seeded random-init Llama of `shape` on `device`, named `name`, with tiny-llama's
    tokenizer. Dense: the whole model built there at once (torch's device context). With nf4 or
    int8: built a decoder layer at a time (`random_quantized_llama`), so a 70B shape, 140 GB in
    bf16, never exists dense anywhere."""
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        **shape.config_kwargs(),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(PRESET_SEED)
        if quantization in ("nf4", "int8"):
            model, report = random_quantized_llama(config, quantization, device=device, dtype=dtype)
            note = report.sentence(quantization) + " (random init, one decoder layer at a time)"
            return LoadedModel(model, tokenizer, name, True, quantization, note)
        with _default_dtype(dtype), device:
            model = LlamaForCausalLM(config)
    return LoadedModel(model, tokenizer, name, is_random=True)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def random_quantized_llama(
    config: LlamaConfig,
    method: Literal["nf4", "int8"],
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = PRESET_SEED,
) -> tuple[LlamaForCausalLM, QuantizeReport]:
    """A random-init LlamaForCausalLM whose decoder linears are quantized as each layer is made:
    the embeddings, final norm and LM head are built dense first (a model of no layers), then
    each decoder layer in turn is allocated dense on `device` (empty, from the meta device), given
    HF's init (linears N(0, initializer_range), norms 1; seeded `seed` + 1 + its index), quantized
    linear by linear and appended. The device holds the quantized model so far plus one dense
    layer (and one linear's quantization temporaries) at any time."""
    layers = config.num_hidden_layers
    config.num_hidden_layers = 0
    try:
        with _default_dtype(dtype), device:
            model = LlamaForCausalLM(config)
    finally:
        config.num_hidden_layers = layers
    report = QuantizeReport(0)
    std = config.initializer_range
    for index in range(layers):
        with torch.device("meta"):
            layer = LlamaDecoderLayer(config, layer_idx=index)
        layer = layer.to(dtype=dtype).to_empty(device=device)
        generator = torch.Generator(device=device).manual_seed(seed + 1 + index)
        for name, param in layer.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:  # a linear's (out, in) weight
                param.normal_(0.0, std, generator=generator)
        report = report + quantize_model(layer, method, dtype=dtype)
        model.model.layers.append(layer)
    return model, report


# Held while a GGUF load swaps gguf's functions (below): two loads at once never restore each
# other's swap.
_GGUF_LOAD_LOCK = threading.Lock()


@contextmanager
def _gguf_parsed_once(path: Path) -> Iterator[None]:
    """While a load of the GGUF at `path` runs: its metadata parsed once, its name map built once.

    transformers parses the whole GGUF with gguf's GGUFReader once for the config and again for
    the weights (again for the tokenizer if it converts one), and each parse of SmolLM2's file
    (49k vocabulary strings, 49k merges) takes ~4 s on a CPU; it maps tensor names by walking every
    submodule (hundreds for 30 layers) and building the architecture's whole TensorNameMap at each,
    ~9 s more. Both give the same objects every time and are only read, so meanwhile one parsed
    reader of `path` and one map per (architecture, layer count) serve every call. transformers
    imports both from `gguf` at each call, so the module attributes are what it finds; other files,
    and writable opens, get gguf's own."""
    import gguf

    with _GGUF_LOAD_LOCK:
        reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        parsed = reader_class(path)
        resolved = os.path.realpath(path)

        def reader(file: str | os.PathLike[str], mode: str = "r") -> gguf.GGUFReader:
            if mode == "r" and os.path.realpath(file) == resolved:
                return parsed
            return reader_class(file, mode)  # type: ignore[arg-type]

        setattr(gguf, "GGUFReader", reader)  # noqa: B010
        setattr(gguf, "get_tensor_name_map", functools.cache(name_map))  # noqa: B010
        try:
            yield
        finally:
            setattr(gguf, "GGUFReader", reader_class)  # noqa: B010
            setattr(gguf, "get_tensor_name_map", name_map)  # noqa: B010


def _load_pretrained(
    name: str, store: Path, device: torch.device, dtype: torch.dtype, *, keep_blocks: bool = False
) -> LoadedModel:
    source = PRETRAINED[name]
    directory = store / name
    if not (directory / source.filename).is_file():
        raise ModelError(f"model {name!r} is not pulled yet; run `loraq models pull {name}`")
    with _gguf_parsed_once(directory / source.filename):
        tokenizer = load_gguf_tokenizer(directory, source.filename)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=source.filename, dtype=dtype)
    _drop_gguf_marks(model)
    if not keep_blocks:
        return LoadedModel(_move(model, device), tokenizer, name, is_random=False)
    # the linear layers take the file's blocks (before the move: their dense copies go)
    counts = use_gguf_blocks(model, directory / source.filename, device=device, dtype=dtype)
    kept = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
    note = f"Base keeps its GGUF file's blocks as frozen linear weights ({kept}): nothing re-quantized"
    return LoadedModel(_move(model, device), tokenizer, name, False, "gguf", note)


def _drop_gguf_marks(model: PreTrainedModel) -> None:
    """Unmark a GGUF-loaded model as quantized: its weights are already dense `dtype` tensors.

    transformers dequantizes GGUF on load but keeps the quantizer and `quantization_config`, so
    `save_pretrained` (merged export) refuses the model and PEFT would treat it as quantized.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and getattr(module.config, "_is_quantized", False):
            module.config._is_quantized = False


def _load_local(
    name: str,
    directory: Path,
    device: torch.device,
    dtype: torch.dtype,
    quantization: QuantizationName | None = None,
) -> LoadedModel:
    # Validate again: the directory may have changed since `loraq models add`.
    family = validate_model_dir(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    multimodal = multimodal_of_config(json.loads((directory / "config.json").read_text()))
    if multimodal is not None:
        model = _load_text_model(directory, family.architecture, multimodal, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, use_safetensors=True)
    if type(model).__name__ != family.architecture:
        # transformers picks the class from `model_type`: a config whose two fields disagree
        # (a multimodal Gemma 3 config naming Gemma3ForCausalLM) would train another model
        raise ModelError(
            f"{directory / 'config.json'} names {family.architecture} but its model_type "
            f"{model.config.model_type!r} loads {type(model).__name__}"
        )
    if quantization in ("nf4", "int8"):
        # on the device, one layer at a time, before the rest moves: a GPU never holds the
        # dense model
        report = quantize_model(model, quantization, device=device, dtype=dtype)
        return LoadedModel(
            _move(model, device), tokenizer, name, False, quantization, report.sentence(quantization)
        )
    return LoadedModel(_move(model, device), tokenizer, name, is_random=False)


def _load_text_model(
    directory: Path, architecture: str, multimodal: Multimodal, dtype: torch.dtype
) -> PreTrainedModel:
    """The language model of a multimodal checkpoint (Gemma 3 4B and up) as its family's causal
    LM: built from the text config, its weights read under the checkpoint's language-model
    prefixes; the vision tower's weights are never loaded. Marked (`CHECKPOINT_PATHS`) so that
    adapters are exported and read by the module paths of the multimodal model, as PEFT and vLLM
    load them on it."""
    config = AutoConfig.from_pretrained(directory).get_text_config()
    # a nested config names no class; the engine reads the family from it (step_memory's plan)
    config.architectures = [architecture]
    with _quiet_load_report():  # it lists every vision weight left out as "unexpected"
        loaded = AutoModelForCausalLM.from_pretrained(
            directory,
            config=config,
            key_mapping=dict(multimodal.weight_prefixes),
            dtype=dtype,
            use_safetensors=True,
            output_loading_info=True,
        )
    model, info = cast(tuple[PreTrainedModel, dict[str, Any]], loaded)
    missing = sorted(info["missing_keys"])
    if missing:  # transformers would train them from their random init
        raise ModelError(
            f"{directory} ({multimodal.architecture}) lacks weights of its language model: "
            f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
        )
    setattr(model, CHECKPOINT_PATHS, multimodal)
    return model


@contextmanager
def _quiet_load_report() -> Iterator[None]:
    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _move(model: PreTrainedModel, device: torch.device, dtype: torch.dtype | None = None) -> PreTrainedModel:
    # nn.Module.to directly: transformers wraps PreTrainedModel.to in a decorator mypy cannot type.
    moved = torch.nn.Module.to(model, device=device, dtype=dtype)
    return cast(PreTrainedModel, moved)


def _ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    """Batching pads with pad_token_id (labels are -100 there); fall back to EOS when a model has none."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ModelError("the model's tokenizer has neither a pad token nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
