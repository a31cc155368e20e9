"""`loraq train CONFIG.yaml` as a real process: a full run, a config error, and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LORAQ = [sys.executable, "-m", "service.cli"]


def _setup(tmp_path: Path, max_steps: int) -> Path:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"what is the {a}?"},
                {"role": "assistant", "content": f"the {a} is an animal."},
            ]
        }
        for a in ["cat", "dog", "bird", "fish"] * 4
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "model: tiny-llama\ntrain_file: train.jsonl\noutput_dir: out\n"
        f"max_steps: {max_steps}\nbatch_size: 2\nmax_seq_len: 64\nlearning_rate: 5e-3\n"
        "lora: {r: 4, alpha: 8}\n"
    )
    return cfg


def _env(tmp_path: Path) -> dict[str, str]:
    # a wide "terminal": rich wraps error panels at its width (80 without a tty), which would
    # split the long tmp paths in the messages the tests match
    wide = {"COLUMNS": "1000", "TERMINAL_WIDTH": "1000"}
    return {**os.environ, **wide, "LORAQ_DATA_DIR": str(tmp_path / "var"), "PYTHONPATH": str(REPO)}


def test_train_runs_and_exports_an_adapter(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, max_steps=3)
    proc = subprocess.run(
        [*LORAQ, "train", str(cfg)], env=_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "Done: 3 steps" in proc.stdout
    assert "step 3/3" in proc.stdout
    adapter = tmp_path / "out" / "adapter"
    assert (
        json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-llama"
    )


def test_config_error_names_the_field(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, max_steps=3)
    cfg.write_text(cfg.read_text() + "grad_accum: 0\n")
    proc = subprocess.run(
        [*LORAQ, "train", str(cfg)], env=_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "grad_accum must be >= 1, got 0" in " ".join(proc.stderr.split())


def test_ctrl_c_stops_cleanly_with_a_checkpoint(tmp_path: Path) -> None:
    cfg = _setup(tmp_path, max_steps=100_000)
    proc = subprocess.Popen(
        [*LORAQ, "train", str(cfg)],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the engine's "Training data: ..." event precedes the first step
            if line.startswith("Training data"):
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Stopped at step" in out
    checkpoints = list((tmp_path / "out" / "checkpoints").iterdir())
    assert len(checkpoints) == 1 and (checkpoints[0] / "training_state.pt").is_file()
    assert "Traceback" not in err


def _pairs(tmp_path: Path) -> Path:
    """The config of `_setup` on preference pairs (DPO's format) instead of chats."""
    cfg = _setup(tmp_path, max_steps=2)
    rows = [
        {
            "input": {"messages": [{"role": "user", "content": f"what is the {a}?"}]},
            "preferred_output": [{"role": "assistant", "content": f"the {a} is an animal."}],
            "non_preferred_output": [{"role": "assistant", "content": "no idea"}],
        }
        for a in ["cat", "dog", "bird", "fish"] * 2
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg.write_text(cfg.read_text().replace("train_file: train.jsonl", "train_file: pairs.jsonl"))
    return cfg


def test_method_dpo_with_beta_from_the_command_line(tmp_path: Path) -> None:
    """`--method dpo --beta 0.2 --rpo-alpha 0.5` trains a config that names no method with DPO at
    that beta and NLL weight (as its checkpoint records); --beta or --rpo-alpha without --method dpo
    is refused before anything runs."""
    cfg = _pairs(tmp_path)
    proc = subprocess.run(
        [*LORAQ, "train", str(cfg), "--method", "dpo", "--beta", "0.2", "--rpo-alpha", "0.5"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Preparing DPO" in proc.stdout and "Done: 2 steps" in proc.stdout
    state = json.loads((tmp_path / "out" / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["config"]["method"] == {"type": "dpo", "beta": 0.2, "rpo_alpha": 0.5}

    for flag, said in (("--beta", "--beta is DPO's beta"), ("--rpo-alpha", "--rpo-alpha is DPO's rpo_alpha")):
        refused = subprocess.run(
            [*LORAQ, "train", str(cfg), flag, "0.2"], env=_env(tmp_path), capture_output=True, text=True
        )
        assert refused.returncode == 2
        assert f"{said}: give it with --method dpo" in " ".join(refused.stderr.split())


def test_method_flags_override_the_files_method(tmp_path: Path) -> None:
    """--method replaces the file's method; --method dpo keeps the file's DPO beta and rpo_alpha
    unless --beta or --rpo-alpha gives one."""
    from service.cli_train import method_overrides
    from worker.engine.config_file import load_config_file
    from worker.engine.training_config import DpoTraining, MethodType, SupervisedTraining

    cfg = _pairs(tmp_path)
    cfg.write_text(cfg.read_text() + "method: {type: dpo, beta: 0.3, rpo_alpha: 0.25}\n")

    def method(flag: MethodType | None, beta: float | None, rpo_alpha: float | None = None) -> object:
        overrides = method_overrides(flag, beta, rpo_alpha)
        return load_config_file(cfg, default_model_store=tmp_path / "models", overrides=overrides).method

    assert method(None, None) == method("dpo", None) == DpoTraining(beta=0.3, rpo_alpha=0.25)
    assert method("dpo", 0.5) == DpoTraining(beta=0.5, rpo_alpha=0.25)
    assert method("dpo", None, 0.0) == DpoTraining(beta=0.3, rpo_alpha=0.0)
    assert method("supervised", None) == SupervisedTraining()
