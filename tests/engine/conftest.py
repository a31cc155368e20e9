"""Fixtures shared by the engine tests.

- `model_store`: an empty model store (a tmp dir) for tests that register or list models;
- `tiny`: tiny-llama loaded once per session (fp32, CPU); tests must not modify its weights
  (wrap or deepcopy the model first);
- `pulled_store`: a store holding the real pulled smollm2-135m-instruct, cached across sessions under
  the git-ignored `var/test-models/` so the suite downloads it once;
- `write_jsonl`: writes rows (dicts, or raw strings for bad lines) to a JSONL file in tmp_path.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from worker.engine.models import LoadedModel, load_base_model
from worker.engine.types import LoraConfig, TrainConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
# A data dir whose model store (`<data dir>/models`, as Settings.model_store) caches the pulled model.
TEST_DATA_DIR = REPO_ROOT / "var" / "test-models"


def loaded_after(code: str, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` a fresh interpreter has imported after running `code`."""
    probe = f"{code}\nimport sys\nprint(','.join(m for m in {modules!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return [m for m in out.stdout.strip().split(",") if m]


TEST_MODEL_STORE = TEST_DATA_DIR / "models"
PIRATE_DATA = REPO_ROOT / "tests" / "data" / "pirate"


def smollm2_pirate_config(
    store: Path, output_dir: Path, *, max_steps: int, learning_rate: float
) -> TrainConfig:
    """A short CPU fine-tune of the real SmolLM2 on the pirate data (r=8, 4 rows of <= 128 tokens)."""
    return TrainConfig(
        model="smollm2-135m-instruct",
        train_file=PIRATE_DATA / "train.jsonl",
        output_dir=output_dir,
        model_store=store,
        lora=LoraConfig(r=8, alpha=16.0),
        max_seq_len=128,
        batch_size=4,
        max_steps=max_steps,
        learning_rate=learning_rate,
        device="cpu",
    )


WriteJsonl = Callable[..., Path]


@pytest.fixture
def model_store(tmp_path: Path) -> Path:
    store = tmp_path / "models"
    store.mkdir()
    return store


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_base_model("tiny-llama", store=TEST_MODEL_STORE)


def pull_test_model(name: str = "smollm2-135m-instruct") -> Path:
    """Pull `name` into TEST_MODEL_STORE (once: the store is kept across sessions); returns the store.
    A file lock makes the suite's xdist workers take turns: the first pulls, the others find it
    verified, and none copies or checks the directory while another writes into it."""
    from worker.engine.pull import pull_model

    TEST_DATA_DIR.mkdir(parents=True, exist_ok=True)
    with open(TEST_DATA_DIR / ".pull.lock", "a") as lock:  # beside the store, not in the model's dir
        fcntl.flock(lock, fcntl.LOCK_EX)
        pull_model(name, TEST_MODEL_STORE)
    return TEST_MODEL_STORE


@pytest.fixture(scope="session")
def pulled_store() -> Path:
    return pull_test_model()


@pytest.fixture
def write_jsonl(tmp_path: Path) -> WriteJsonl:
    """write_jsonl(rows, name="train.jsonl"): a dict row is JSON-encoded; a str row is written as is."""

    def write(rows: list[Any], name: str = "train.jsonl") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
        path.write_text("".join(line + "\n" for line in lines))
        return path

    return write


def chat(*turns: tuple[str, str] | tuple[str, str, int]) -> dict[str, Any]:
    """chat(("user", "hi"), ("assistant", "hello", 0)) -> {"messages": [...]} (third item = weight)."""
    messages: list[dict[str, Any]] = []
    for turn in turns:
        msg: dict[str, Any] = {"role": turn[0], "content": turn[1]}
        if len(turn) == 3:
            msg["weight"] = turn[2]
        messages.append(msg)
    return {"messages": messages}
