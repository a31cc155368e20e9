"""Pickles never run. A pickle whose unpickling writes a marker file is handed to every place a
user or the store can put one: an uploaded training file that a worker then runs, a model
directory registered with `loraq models add`, and a checkpoint's training state tampered with in
the store before a resume. Each is refused, and the marker is never written. A control first
shows the payload is live: plain `pickle.load` in a child process does write the marker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service import jobs
from service.db.session import session_scope
from service.schemas import JobCreate
from tests.conftest import ApiClient, job_body, store_file


class WritesMarker:
    """Unpickling this calls `exec`, which creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def evil_pickle(path: Path, marker: Path) -> Path:
    """A torch-format file (zip + pickle, as `torch.save` writes) holding the payload."""
    import torch

    torch.save({"step": 1, "payload": WritesMarker(marker)}, path)
    return path


def assert_live(path: Path, marker: Path) -> None:
    code = "import sys, torch; torch.load(sys.argv[1], weights_only=False)"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, capture_output=True)
    assert marker.read_text() == "pwned"  # the payload really runs when unpickled
    marker.unlink()


def test_uploaded_pickle_training_file_is_rejected_and_never_unpickled(
    api: ApiClient, tmp_path: Path
) -> None:
    from worker.runner import run_claimed_job

    marker = tmp_path / "marker"
    payload = evil_pickle(tmp_path / "train.pt", marker)
    assert_live(payload, marker)
    file_id = api.upload(payload.read_bytes(), filename="train.jsonl")
    # validated as JSONL at upload: the file is `error` and a job on it is refused
    assert api.get(f"/v1/files/{file_id}").json()["status"] == "error"
    r = api.post("/v1/fine_tuning/jobs", json=job_body(file_id))
    assert r.status_code == 400 and r.json()["error"]["param"] == "training_file", r.text
    assert not marker.exists()
    # The worker, too, reads it as JSONL only: a row stored without the upload's check
    stored = store_file(api.tenant_id, payload.read_bytes())
    with session_scope() as s:
        job_id = jobs.create_job(s, tenant_id=api.tenant_id, spec=JobCreate(**job_body(stored))).id
    assert run_claimed_job(job_id, worker_id="test") == "failed"
    job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["status"] == "failed" and job["error"]["param"] == "training_file", job
    assert "not JSON" in job["error"]["message"] or "line 1" in job["error"]["message"], job["error"]
    assert not marker.exists()


def test_model_directory_with_a_pickle_is_refused(tmp_path: Path) -> None:
    from worker.engine.catalog import register_local_model
    from worker.engine.types import ModelError

    marker = tmp_path / "marker"
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    evil_pickle(directory / "pytorch_model.bin", marker)
    assert_live(directory / "pytorch_model.bin", marker)
    with pytest.raises(ModelError, match="pickles are never loaded"):
        register_local_model("evil", directory, tmp_path / "models")
    assert not marker.exists()


def test_tampered_checkpoint_state_is_refused_on_resume(tmp_path: Path) -> None:
    """Our own training state is read with `torch.load(weights_only=True)`: a checkpoint whose
    `training_state.pt` was replaced in the store cannot run code when a job resumes from it."""
    import pickle

    from tests.engine.recipe_helpers import Recorder, tiny_config
    from worker.engine.checkpoint import TRAINING_STATE
    from worker.engine.recipe import train

    marker = tmp_path / "marker"
    first = Recorder()
    train(tiny_config(tmp_path / "a", max_steps=4, checkpoint_every=2), first)
    ckpt = first.checkpoints[0].path
    evil_pickle(ckpt / TRAINING_STATE, marker)
    assert_live(ckpt / TRAINING_STATE, marker)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        train(tiny_config(tmp_path / "b", max_steps=4, checkpoint_every=2, resume_from=ckpt), Recorder())
    assert not marker.exists()
