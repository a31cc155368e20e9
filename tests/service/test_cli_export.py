"""`loraq export merged` as a real process, from a trained run's adapter directory and its zip."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.service.test_cli_train import LORAQ, _env, _setup
from worker.engine.export import load_adapter
from worker.engine.models import load_base_model


def _export(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LORAQ, "export", "merged", *args], env=_env(tmp_path), capture_output=True, text=True, timeout=300
    )


def test_export_merged_from_a_zip_matches_base_plus_adapter(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, max_steps=3)
    train = subprocess.run([*LORAQ, "train", str(cfg)], env=_env(tmp_path), capture_output=True, text=True)
    assert train.returncode == 0, train.stderr
    adapter = tmp_path / "out" / "adapter"
    archive = tmp_path / "adapter.zip"  # the layout `loraq jobs download` gives
    with zipfile.ZipFile(archive, "w") as zf:
        for f in adapter.iterdir():
            zf.write(f, f.name)

    proc = _export(tmp_path, str(archive), "-o", str(tmp_path / "merged"))
    assert proc.returncode == 0, proc.stderr
    assert "merged tiny-llama + adapter" in proc.stdout

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    engine = load_base_model("tiny-llama", store=tmp_path / "var" / "models")
    load_adapter(adapter, engine.model)
    engine.model.eval()
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (merged(input_ids=ids).logits - engine.model(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-4


def test_export_merged_errors_name_the_problem(tmp_path: Path) -> None:
    not_zip = tmp_path / "adapter.zip"
    not_zip.write_bytes(b"not a zip")
    proc = _export(tmp_path, str(not_zip), "-o", str(tmp_path / "m"))
    assert proc.returncode == 2 and "is not a zip file" in proc.stderr

    empty = tmp_path / "empty.zip"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("README", "nothing")
    proc = _export(tmp_path, str(empty), "-o", str(tmp_path / "m"))
    assert proc.returncode == 2 and "holds no adapter_config.json" in proc.stderr

    (tmp_path / "dir").mkdir()
    proc = _export(tmp_path, str(tmp_path / "dir"), "-o", str(tmp_path / "m"))
    assert proc.returncode == 1 and "is not a PEFT adapter directory" in proc.stderr
    assert not (tmp_path / "m").exists()
