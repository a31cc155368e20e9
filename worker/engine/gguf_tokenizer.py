"""Write a GGUF model's fast tokenizer files (`tokenizer.json`, its config and chat template) into
`<model dir>/tokenizer/`, so the API's torch-free counter (`worker.engine.token_count`) counts what
the engine tokenizes: the files are transformers' own conversion of the GGUF
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), the very tokenizer `worker.engine.models` loads.

A subdirectory, not beside the .gguf: transformers reads tokenizer files it finds in the GGUF's
directory instead of the GGUF's own metadata, and would then load the engine's tokenizer without
its special tokens. The files are saved into a temp directory and renamed into place,
`tokenizer.json` last: the counter keys on it, so a reader never sees it without its chat template.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILE = "tokenizer.json"


def tokenizer_dir(model_dir: Path) -> Path:
    """Where a GGUF model's converted tokenizer files live."""
    return model_dir / TOKENIZER_DIR


def write_tokenizer_files(tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> None:
    """Save `tokenizer` (loaded from a GGUF in `model_dir`) into its tokenizer dir; a no-op if there."""
    target = tokenizer_dir(model_dir)
    if (target / TOKENIZER_FILE).is_file():
        return
    target.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tokenizer-", dir=model_dir) as tmp:
        tokenizer.save_pretrained(tmp)
        for file in sorted(Path(tmp).iterdir(), key=lambda p: p.name == TOKENIZER_FILE):
            file.chmod(0o644)  # the store is shared with the worker and the API
            os.replace(file, target / file.name)


def write_gguf_tokenizer(model_dir: Path, gguf_file: str) -> None:
    """Convert the tokenizer of `model_dir / gguf_file` with transformers and write its files."""
    if (tokenizer_dir(model_dir) / TOKENIZER_FILE).is_file():
        return
    load_gguf_tokenizer(model_dir, gguf_file)


def load_gguf_tokenizer(model_dir: Path, gguf_file: str) -> PreTrainedTokenizerBase:
    """The engine's tokenizer of `model_dir / gguf_file`: from its converted files where they are,
    else converted from the GGUF (and the files written). The files are that same conversion, saved
    (same vocabulary, merges, special tokens and chat template); reading them skips re-parsing the
    GGUF's 49k-token vocabulary, about 7 s of every load of SmolLM2 on a CPU."""
    from transformers import AutoTokenizer  # the worker's dependency; the API's counter never loads it

    if (tokenizer_dir(model_dir) / TOKENIZER_FILE).is_file():
        saved: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(tokenizer_dir(model_dir))
        return saved
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
    write_tokenizer_files(tokenizer, model_dir)
    return tokenizer
