"""A maximal valid upload is bounded end to end: 512 MiB of valid chat lines (the upload limit)
through a real API (uvicorn, its counting process) and a real Celery worker on SQLite, tiny-llama.

- The upload stores the file's summary: the dashboard's summary answers from it, within 1 s, twice.
- Submit answers within 5 s: the file is too large to count at submit, so the job is accepted in
  `validating_files`; the API's background count settles it (`queued`) and the API itself stays
  small (the count runs in a process of its own).
- The worker tokenizes into compact arrays: once the tokenizer is warm (its first progress line),
  its RSS grows by at most `BYTES_PER_FILE_BYTE` per byte of the file it tokenizes (its progress
  lines say how many), plus `RSS_SLACK`: the README's stated limit. (Before, its lists of ints
  took about 100 bytes per byte of file: 1.6 GB for 16 MB, measured in one process.)
- A cancel while it prepares the data ends the job `cancelled` within 10 s.

The file repeats the 64 pirate lines, written with large buffered writes (about a second). The
background count counts a repeated line once, so it takes seconds here where a file of distinct
lines takes minutes; the upload still checks every line and the worker tokenizes every line.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.e2e.procs import ROOT, clean_env, free_port, start_worker, stop_process, wait_for
from tests.servers import api_ready

MAX_UPLOAD_BYTES = 512 * 1024 * 1024  # the upload limit (LORAQ_MAX_UPLOAD_BYTES' default)
PIRATE = ROOT / "tests" / "data" / "pirate" / "train.jsonl"
BYTES_PER_FILE_BYTE = 2.0  # the README's stated limit for the worker's prepared data
RSS_SLACK = 32 * 2**20  # the allocator's own, not proportional to the file
PREP_WINDOW_S = 30.0  # how long the worker's preparation is watched before the cancel
PROGRESS = re.compile(rb"data: (\d+) of (\d+) bytes of training_file tokenized")


def maximal_file(path: Path) -> int:
    """The pirate lines repeated to just under the upload limit; returns how many lines."""
    block = PIRATE.read_bytes()
    repeats = MAX_UPLOAD_BYTES // len(block)
    with path.open("wb", buffering=1 << 24) as f:
        for _ in range(repeats):
            f.write(block)
    return repeats * block.count(b"\n")


class Stack:
    def __init__(self, tmp: Path, redis_url: str) -> None:
        db_url = f"sqlite:///{tmp / 'loraq.db'}"
        self.port = free_port()
        self.env = clean_env(
            LORAQ_DATA_DIR=str(tmp / "var"),
            LORAQ_DATABASE_URL=db_url,
            LORAQ_REDIS_URL=redis_url,
            LORAQ_PORT=str(self.port),
            LORAQ_WORKER_QUEUE=f"max-{free_port()}",
            LORAQ_HEARTBEAT_SECONDS="1",
        )
        migrate = "import sys; from service.db.migrate import upgrade_head; upgrade_head(sys.argv[1])"
        subprocess.run([sys.executable, "-c", migrate, db_url], env=self.env, cwd=ROOT, check=True)
        out = subprocess.run(
            [sys.executable, "-m", "service.cli", "keys", "create", "--tenant", "max"],
            env=self.env, cwd=ROOT, check=True, capture_output=True, text=True,
        )  # fmt: skip
        self.key = out.stdout.strip().splitlines()[-1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.logs = {"api": tmp / "api.log", "worker": tmp / "worker.log"}
        self.api = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory",
             "--host", "127.0.0.1", "--port", str(self.port), "--no-access-log"],
            env=self.env, cwd=ROOT, stdout=self.logs["api"].open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        wait_for(lambda: api_ready(self.url), "API", 60, self.api)
        self.worker = start_worker(self.env, self.logs["worker"])

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=900)

    def job(self, c: httpx.Client, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = c.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        return job

    def events(self, c: httpx.Client, job_id: str) -> list[str]:
        data = c.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
        return [e["message"] for e in reversed(data)]

    def stop(self) -> None:
        for proc in (self.worker, self.api):
            stop_process(proc)


@pytest.fixture
def stack(tmp_path: Path, redis_url: str, request: pytest.FixtureRequest) -> Iterator[Stack]:
    s = Stack(tmp_path, redis_url)
    try:
        yield s
    finally:
        s.stop()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            for name, log in s.logs.items():
                print(f"--- {name} log (tail)\n{log.read_text(errors='replace')[-6000:]}")


def rss(proc: subprocess.Popen[bytes]) -> int:
    return int(psutil.Process(proc.pid).memory_info().rss)


def progress_after(log: Path, offset: int, timeout: float = 60) -> int:
    """Bytes tokenized per the first progress line the worker logs after `offset` of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = PROGRESS.findall(log.read_bytes()[offset:])
        if found:
            return int(found[0][0])
        time.sleep(0.2)
    raise AssertionError("the worker logged no progress")


@pytest.mark.slow
def test_a_maximal_valid_file_is_bounded_end_to_end(stack: Stack, tmp_path: Path) -> None:
    path = tmp_path / "max.jsonl"
    lines = maximal_file(path)
    size = path.stat().st_size
    assert MAX_UPLOAD_BYTES - 16 * 1024 < size <= MAX_UPLOAD_BYTES
    figures: dict[str, float] = {"lines": lines, "bytes": size}
    with stack.client() as c:
        started = time.monotonic()
        with path.open("rb") as fh:
            r = c.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("max.jsonl", fh)})
        figures["upload_s"] = time.monotonic() - started
        assert r.status_code == 200, r.text
        file = r.json()
        assert file["status"] == "processed" and file["bytes"] == size

        for n in (1, 2):  # stored by the upload: never parsed again (35 s a read before)
            started = time.monotonic()
            summary = c.get(f"/dashboard/api/files/{file['id']}/summary")
            figures[f"summary_{n}_s"] = elapsed = time.monotonic() - started
            assert summary.status_code == 200 and elapsed < 1.0, (summary.text, elapsed)
            assert summary.json()["examples"] == lines and summary.json()["valid"] is True

        api_before = rss(stack.api)
        body = {
            "model": "tiny-llama",
            "training_file": file["id"],
            "seed": 1,
            "hyperparameters": {"n_epochs": 1, "batch_size": 8},
            "lora": {"r": 4, "alpha": 8},
            "max_seq_len": 256,
        }
        started = time.monotonic()
        r = c.post("/v1/fine_tuning/jobs", json=body)
        figures["submit_s"] = elapsed = time.monotonic() - started
        assert r.status_code == 200 and elapsed < 5.0, (r.text, elapsed)
        job = r.json()
        assert job["status"] == "validating_files"

        # the API's counting process settles it; the worker then claims it
        wait_for(lambda: stack.job(c, job["id"])["status"] != "validating_files", "count", 600)
        figures["validating_s"] = time.monotonic() - started
        assert stack.job(c, job["id"])["status"] in ("queued", "running")
        figures["api_rss_growth_mib"] = (rss(stack.api) - api_before) / 2**20
        assert rss(stack.api) - api_before < 64 * 2**20  # the count ran in a process of its own

        wait_for(lambda: any(m.startswith("Preparing data") for m in stack.events(c, job["id"])), "prep", 300)
        # from its first progress line on (the tokenizer warmed up): RSS against bytes tokenized
        first = progress_after(stack.logs["worker"], 0)
        base, peak = rss(stack.worker), 0
        until = time.monotonic() + PREP_WINDOW_S
        while time.monotonic() < until:
            peak = max(peak, rss(stack.worker))
            time.sleep(0.1)
        # the next progress line: at least what the peak held
        tokenized = progress_after(stack.logs["worker"], stack.logs["worker"].stat().st_size)
        figures.update(
            worker_rss_base_mib=base / 2**20,
            worker_rss_growth_mib=(peak - base) / 2**20,
            tokenized_in_window_mib=(tokenized - first) / 2**20,
        )
        assert tokenized > first
        assert peak - base <= BYTES_PER_FILE_BYTE * (tokenized - first) + RSS_SLACK, figures

        started = time.monotonic()
        r = c.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
        assert r.status_code == 200, r.text
        wait_for(lambda: stack.job(c, job["id"])["status"] == "cancelled", "cancel", 10)
        figures["cancel_s"] = time.monotonic() - started
        assert "Stop requested: stopped while tokenizing" in " ".join(stack.events(c, job["id"]))
        assert stack.worker.poll() is None  # the worker lives on for the next job
    print("figures:", {k: round(v, 2) for k, v in figures.items()})
