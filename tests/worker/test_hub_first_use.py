"""A job on a Hub model that is not local yet (the suite's Hub, tests/fake_hub.py, through the real
huggingface_hub client): a cancel while its weights download ends it `cancelled` and keeps the
partial weights; the next job on the model resumes that download with an HTTP Range, then trains."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants as hub_constants

from service import jobs
from service.db.session import session_scope
from tests.e2e.datasets import chat_lines
from tests.engine.tiny_families import save_tiny_family
from tests.fake_hub import CHUNK, FakeHub, hub_endpoint
from tests.worker.conftest import WorkerEnv
from tests.worker.test_runner import events, explain, job_row
from worker import runner
from worker.engine import hub
from worker.engine.catalog import get_model_info, hub_dir

pytestmark = [pytest.mark.slow]  # a real job, in process: ~15 s

REPO = "tiny-org/tiny-phi3"
WEIGHTS = "model.safetensors"


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    # huggingface_hub reports (and so the job asks should_stop) every DOWNLOAD_CHUNK_SIZE bytes
    monkeypatch.setattr(hub_constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    with hub_endpoint(monkeypatch, REPO, save_tiny_family("Phi3ForCausalLM", tmp_path / "phi3")) as served:
        yield served


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_a_cancel_mid_download_keeps_the_part_and_the_next_job_resumes_it(
    worker_env: WorkerEnv, fake_hub: FakeHub
) -> None:
    release = fake_hub.repos[REPO].hold = threading.Event()  # the weights wait after their first piece
    file_id = worker_env.upload(chat_lines(8))
    first = worker_env.create_job(file_id, model=REPO)
    store = worker_env.data_dir / "models"

    def cancel_once_the_weights_download() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not fake_hub.downloads(REPO, WEIGHTS):
            time.sleep(0.05)
        with session_scope() as s:
            jobs.request_cancel(s, tenant_id=worker_env.tenant_id, job_id=first)
        time.sleep(runner.CANCEL_CACHE_SECONDS + 0.2)  # past the worker's cached answer
        release.set()  # the next piece's progress report asks should_stop

    canceller = threading.Thread(target=cancel_once_the_weights_download)
    canceller.start()
    try:
        assert runner.run_claimed_job(first) == "cancelled", explain(first)
    finally:
        release.set()
        canceller.join()
    assert job_row(first).status == "cancelled"
    (partial,) = (hub_dir(REPO, store) / hub.PARTIAL_DIR).glob(f"{WEIGHTS}.*.incomplete")
    kept = partial.stat().st_size
    assert 0 < kept < len(fake_hub.repos[REPO].files[WEIGHTS])
    assert not get_model_info(REPO, store).pulled

    second = worker_env.create_job(file_id, model=REPO)
    assert runner.run_claimed_job(second) == "succeeded", explain(second)
    assert [d.range for d in fake_hub.downloads(REPO, WEIGHTS)] == [None, f"bytes={kept}-"]
    messages = [e.message for e in events(second)]
    assert f"Base model {REPO}: every file matches the Hub's digests; the model is local" in messages
    assert get_model_info(REPO, store).pulled and not partial.exists()
