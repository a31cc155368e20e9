"""The README's "Use your adapter" snippets, run as written, on the real SmolLM2 (slow).

A two-step fine-tune of smollm2-135m-instruct gives a real adapter; its adapter_config.json must
name the upstream base, `HuggingFaceTB/SmolLM2-135M-Instruct`. The tests have no network, so the
hub id resolves to a local copy of the base: a directory of that relative name in the snippets'
working directory (the GGUF the store holds, dequantized and saved as safetensors), which is where
transformers looks first. Then, each in its own process, with HF_HUB_OFFLINE=1:
- the transformers + PEFT snippet, verbatim;
- `loraq export merged adapter.zip -o merged`, verbatim, then the merged-model snippet, verbatim.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.conftest import TEST_DATA_DIR, smollm2_pirate_config
from worker.engine.models import load_base_model
from worker.engine.recipe import train
from worker.engine.types import NullCallbacks

ROOT = Path(__file__).resolve().parents[2]
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def code_blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def run(argv: list[str], cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAQ_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", LORAQ_DATA_DIR=str(TEST_DATA_DIR))
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # `loraq` of this venv
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{argv} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_use_your_adapter_snippets_run(pulled_store: Path, tmp_path: Path) -> None:
    section = readme_section("Use your adapter")
    python_snippets = code_blocks(section, "python")
    assert len(python_snippets) == 2, "the section's Python snippets changed: update this test"
    peft_snippet, merged_snippet = python_snippets
    export_line = next(
        line for block in code_blocks(section, "sh") for line in block.splitlines()
        if line.startswith("loraq export merged")
    )  # fmt: skip

    # A real adapter: two steps on the pirate data.
    loaded = load_base_model("smollm2-135m-instruct", store=pulled_store)
    config = smollm2_pirate_config(pulled_store, tmp_path / "run", max_steps=2, learning_rate=1e-3)
    adapter = train(config, NullCallbacks(), loaded=loaded).adapter_dir
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == HUB_ID

    work = tmp_path / "work"
    shutil.copytree(adapter, work / "adapter")
    shutil.make_archive(str(work / "adapter"), "zip", adapter)  # what `loraq jobs download` gives
    loaded.model.save_pretrained(work / HUB_ID, safe_serialization=True)  # the "hub" copy of the base
    loaded.tokenizer.save_pretrained(work / HUB_ID)
    del loaded

    answer = run([sys.executable, "-c", peft_snippet], work)
    assert answer.strip(), "the PEFT snippet printed no answer"

    run(shlex.split(export_line), work)
    assert (work / "merged" / "config.json").is_file()
    answer = run([sys.executable, "-c", merged_snippet], work)
    assert answer.strip()
