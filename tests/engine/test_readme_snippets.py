"""The README's "Use your adapter" section, run as written on the real SmolLM2 with no network.

- The install line pins the versions of requirements/cpu.txt, torch's CPU build from PyTorch's CPU
  index, and covers what the snippet imports (quick; no download: the CPU index is not reachable).
- The rest (slow): a two-step fine-tune of smollm2-135m-instruct gives a real adapter, zipped as
  `loraq jobs download` gives it. In a directory holding only `adapter.zip` and the Python snippet
  saved as `use_adapter.py`, the section's shell lines run verbatim in bash: unzip, then the
  snippet on the GGUF that `loraq models path` names, whose answer must differ from the base's;
  beside it `loraq export merged`, verbatim, then the merged-model snippet, verbatim. Each runs
  offline: HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, an empty HF_HOME (no hub cache to fall back
  on), proxies on a closed port, and in a network namespace of its own where `unshare` may make one.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import TEST_DATA_DIR, smollm2_pirate_config
from worker.engine.models import load_base_model
from worker.engine.recipe import train
from worker.engine.sampling import greedy_samples
from worker.engine.types import NullCallbacks

ROOT = Path(__file__).resolve().parents[2]
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CLOSED_PORT_PROXY = "http://127.0.0.1:9"  # discard port: nothing listens, a request fails at once
SNIPPET_FILE = "use_adapter.py"  # the name the README saves the snippet under


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def code_blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def sh_block_with(section: str, needle: str) -> str:
    (block,) = [b for b in code_blocks(section, "sh") if needle in b]
    return block


def locked_versions() -> dict[str, str]:
    """requirements/cpu.txt's pins: {"torch": "2.13.0+cpu", ...}."""
    text = (ROOT / "requirements" / "cpu.txt").read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, flags=re.M))


def test_install_line_pins_the_cpu_lock() -> None:
    section = readme_section("Use your adapter")
    (line,) = [
        line for line in sh_block_with(section, "pip install").splitlines() if line.startswith("pip install")
    ]
    args = shlex.split(line)
    pins = dict(arg.split("==") for arg in args if "==" in arg)
    locked = locked_versions()
    assert {name: locked[name] for name in pins} == pins  # every pin is the lock's
    assert pins["torch"].endswith("+cpu")  # the CPU build: only PyTorch's CPU index has it
    assert args[args.index("--extra-index-url") + 1] == CPU_INDEX
    assert f"`torch=={pins['torch'].removesuffix('+cpu')}`" in section  # the macOS note, same version
    # Everything the snippet imports, and what transformers needs to read a GGUF.
    peft_snippet = code_blocks(section, "python")[0]
    imported = {
        alias.name.split(".")[0] if isinstance(node, ast.Import) else str(node.module).split(".")[0]
        for node in ast.walk(ast.parse(peft_snippet))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert (imported - sys.stdlib_module_names) | {"torch", "gguf"} == set(pins)


@cache
def no_network_prefix() -> tuple[str, ...]:
    """`unshare` into a user + network namespace (no interfaces but a down loopback), if allowed here."""
    argv = ("unshare", "--net", "--map-root-user")
    if shutil.which("unshare") and subprocess.run([*argv, "true"], capture_output=True).returncode == 0:
        return argv
    return ()


def start_offline(argv: list[str], cwd: Path, hf_home: Path, log: Path) -> subprocess.Popen[str]:
    """Start `argv` offline; its stdout goes to `log`, its stderr to `log` + ".err" (files, not pipes:
    two of these run at once, and a full pipe would stall one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORAQ_", "HF_"))}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(hf_home),
        LORAQ_DATA_DIR=str(TEST_DATA_DIR),
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",  # `python` and `loraq` of this venv
    )
    for proxy in ("http_proxy", "https_proxy", "all_proxy"):
        env[proxy] = env[proxy.upper()] = CLOSED_PORT_PROXY
    env.pop("no_proxy", None)
    env.pop("NO_PROXY", None)
    with log.open("w") as out, log.with_suffix(".err").open("w") as err:
        return subprocess.Popen(
            [*no_network_prefix(), *argv], cwd=cwd, env=env, stdout=out, stderr=err, text=True
        )


def output_of(proc: subprocess.Popen[str], log: Path) -> str:
    """Wait for `proc`; its stdout, after checking it exited 0."""
    proc.wait(timeout=600)
    stdout, stderr = log.read_text(), log.with_suffix(".err").read_text()
    assert proc.returncode == 0, f"{proc.args!r} failed:\n{stdout}\n{stderr}"
    return stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_use_your_adapter_runs_offline_as_written(pulled_store: Path, tmp_path: Path) -> None:
    section = readme_section("Use your adapter")
    peft_snippet, merged_snippet = code_blocks(section, "python")
    run_lines = sh_block_with(section, SNIPPET_FILE)
    export_line = sh_block_with(section, "loraq export merged").strip()
    (prompt,) = re.findall(r'"content": "([^"]+)"', peft_snippet)

    # The base's greedy answer to the snippet's prompt, to tell that the snippet applied the adapter.
    loaded = load_base_model("smollm2-135m-instruct", store=pulled_store)
    (base_answer,) = greedy_samples(loaded.model, loaded.tokenizer, [prompt], torch.device("cpu"), 32)

    # A real adapter: two steps on the pirate data.
    config = smollm2_pirate_config(pulled_store, tmp_path / "run", max_steps=2, learning_rate=1e-3)
    adapter = train(config, NullCallbacks(), loaded=loaded).adapter_dir
    del loaded
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == HUB_ID

    work = tmp_path / "work"
    work.mkdir()
    shutil.make_archive(str(work / "adapter"), "zip", adapter)  # what `loraq jobs download` gives
    (work / SNIPPET_FILE).write_text(peft_snippet)
    hf_home = tmp_path / "hf-home"
    hf_home.mkdir()  # empty: no hub cache to fall back on

    logs = tmp_path / "logs"
    logs.mkdir()
    # The export runs beside the snippet (each loads the base; two cores, half the wall time).
    export = start_offline(shlex.split(export_line), work, hf_home, logs / "export.out")
    try:
        bash = ["bash", "-euo", "pipefail", "-c", run_lines]
        snippet = start_offline(bash, work, hf_home, logs / "peft.out")
        answer = output_of(snippet, logs / "peft.out").strip()
        assert answer, "the PEFT snippet printed no answer"
        common = min(len(answer), len(base_answer))
        assert answer[:common] != base_answer[:common], f"the adapter changed nothing: {answer!r}"
        output_of(export, logs / "export.out")
    finally:
        export.kill()  # a no-op once it has exited
    assert (work / "merged" / "config.json").is_file()
    merged = start_offline([sys.executable, "-c", merged_snippet], work, hf_home, logs / "merged.out")
    assert output_of(merged, logs / "merged.out").strip()
    assert not any(hf_home.iterdir()), "something wrote to the hub cache"
