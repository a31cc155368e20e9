"""Hub models pulled through the real `huggingface_hub` client from the suite's own Hub
(tests/fake_hub.py, a real HTTP server reached through HF_ENDPOINT): the files land verified and
the model loads as the published one; a stopped pull resumes with an HTTP Range; HF_TOKEN goes as
a bearer token and opens a gated repository; a pickle-only, gated or missing repository is
refused saying what to do; two processes pulling one model download it once; `loraq models pull`
and `loraq models list` show the pull and each base's family, size and context."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hub_constants
from transformers import AutoModelForCausalLM

from tests.e2e.procs import ROOT, wait_for
from tests.engine.tiny_families import save_tiny_family
from tests.fake_hub import CHUNK, FakeHub, hub_endpoint
from tests.worker.test_first_use_pull import PULL_SCRIPT
from worker.engine import hub
from worker.engine.catalog import HUB_MARKER, get_model_info, hub_dir
from worker.engine.models import load_base_model
from worker.engine.pull import PULL_LOCK, ensure_pulled, pull_model
from worker.engine.types import ModelError, StopRequested

REPO = "tiny-org/tiny-qwen3"
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_family("Qwen3ForCausalLM", tmp_path_factory.mktemp("tiny") / "qwen3")


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> Iterator[FakeHub]:
    with hub_endpoint(monkeypatch, REPO, tiny_dir) as served:
        yield served


def test_a_pull_lands_every_file_verified_and_the_model_loads_as_published(
    fake_hub: FakeHub, tiny_dir: Path, tmp_path: Path
) -> None:
    store = tmp_path / "models"
    before = get_model_info(REPO, store)
    assert (before.kind, before.pulled, before.path) == ("hub", False, str(hub_dir(REPO, store)))
    reports: list[tuple[str, int, int]] = []
    directory = pull_model(REPO, store, progress=lambda *r: reports.append(r))
    assert directory == hub_dir(REPO, store)
    published = fake_hub.repos[REPO]
    for name, data in published.files.items():
        assert (directory / name).read_bytes() == data, name
    marker = json.loads((directory / HUB_MARKER).read_text())
    assert marker == {
        "repo_id": REPO,
        "revision": "main",
        "commit": published.commit,
        "files": sorted(published.files),
    }
    total = sum(len(d) for d in published.files.values())
    assert reports[-1] == ("download", total, total)
    assert all(0 <= done <= total for _, done, _ in reports)

    info = get_model_info(REPO, store)
    assert (info.pulled, info.path, info.upstream) == (True, str(directory), REPO)
    assert (info.family, info.context_length) == ("Qwen3", 256)
    source = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert info.parameters == sum(p.numel() for p in source.parameters())
    loaded = load_base_model(REPO, store=store)
    ids = torch.tensor([[5, 17, 42, 9]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model(input_ids=ids).logits, source(input_ids=ids).logits, rtol=0, atol=0
        )

    # a second pull downloads nothing: the files are verified where they are
    gets = len([s for s in fake_hub.seen if s.method == "GET" and "/resolve/" in s.path])
    pull_model(REPO, store)
    assert len([s for s in fake_hub.seen if s.method == "GET" and "/resolve/" in s.path]) == gets


def test_a_stopped_pull_resumes_where_it_stopped(
    fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # huggingface_hub writes (and reports) the body in DOWNLOAD_CHUNK_SIZE pieces, 10 MB by
    # default: the tiny model's weights are 16 KiB pieces here so a stop lands part-way
    monkeypatch.setattr(hub_constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    store = tmp_path / "models"
    size = len(fake_hub.repos[REPO].files[WEIGHTS])
    reports = 0

    def stop_in_the_weights() -> bool:
        nonlocal reports
        reports += 1
        return (hub_dir(REPO, store) / hub.PARTIAL_DIR).is_dir() and any(
            p.name.startswith(WEIGHTS) and p.stat().st_size >= 3 * CHUNK
            for p in (hub_dir(REPO, store) / hub.PARTIAL_DIR).iterdir()
        )

    notes: list[str] = []
    with pytest.raises(StopRequested, match=f"stopped while downloading base model {REPO}"):
        ensure_pulled(REPO, store, notes.append, should_stop=stop_in_the_weights)
    (partial,) = (hub_dir(REPO, store) / hub.PARTIAL_DIR).glob(f"{WEIGHTS}.*.incomplete")
    kept = partial.stat().st_size
    assert 3 * CHUNK <= kept < size
    assert not get_model_info(REPO, store).pulled and not (hub_dir(REPO, store) / WEIGHTS).exists()

    assert ensure_pulled(REPO, store, notes.append) is True
    first, second = fake_hub.downloads(REPO, WEIGHTS)
    assert (first.range, second.range) == (None, f"bytes={kept}-")  # the rest only
    assert (hub_dir(REPO, store) / WEIGHTS).read_bytes() == fake_hub.repos[REPO].files[WEIGHTS]
    assert not partial.exists() and get_model_info(REPO, store).pulled
    assert notes[0].startswith(f"Downloading base model {REPO} (0.2 MB, 6 files, commit ")
    assert notes[-1] == f"Base model {REPO}: every file matches the Hub's digests; the model is local"
    assert any(n.startswith(f"Downloading base model {REPO}: ") for n in notes), notes


def test_hf_token_is_sent_as_a_bearer_token_and_opens_a_gated_repository(
    fake_hub: FakeHub, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gated = "meta-like/gated-tiny"
    fake_hub.publish_dir(gated, tiny_dir, gated_token="hf_allowed")
    store = tmp_path / "models"
    with pytest.raises(hub.HubError) as refused:
        pull_model(gated, store)
    assert refused.value.code == "model_gated"
    assert str(refused.value) == (
        f"Hub model {gated} is gated and {fake_hub.url} refused it without a token (HF_TOKEN is not set): "
        "accept its terms on its Hub page with your account, then set HF_TOKEN to a token of that account"
    )
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    with pytest.raises(hub.HubError, match="refused it with the token in HF_TOKEN"):
        pull_model(gated, store)
    assert not (hub_dir(gated, store) / "config.json").exists()

    monkeypatch.setenv("HF_TOKEN", "hf_allowed")
    pull_model(gated, store)
    assert get_model_info(gated, store).pulled
    sent = [s for s in fake_hub.seen if gated in s.path]
    assert {s.authorization for s in sent[-13:]} == {"Bearer hf_allowed"}  # look-up + HEAD/GET of 6 files


def test_weights_redirected_to_a_cdn_are_fetched_there_without_the_token(
    fake_hub: FakeHub, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on the Hub: an LFS file's resolve answers 302 to a CDN on another host (X-Linked-Etag,
    X-Linked-Size); the token goes to the Hub, never to the CDN."""
    repo = "meta-like/cdn-tiny"
    fake_hub.publish_dir(repo, tiny_dir, gated_token="hf_allowed", cdn=True)
    monkeypatch.setenv("HF_TOKEN", "hf_allowed")
    store = tmp_path / "models"
    pull_model(repo, store)
    assert (hub_dir(repo, store) / WEIGHTS).read_bytes() == fake_hub.repos[repo].files[WEIGHTS]
    (cdn,) = fake_hub.downloads(repo, WEIGHTS)
    assert cdn.path.startswith("/cdn/") and cdn.authorization is None
    head = [
        s
        for s in fake_hub.seen
        if s.method == "HEAD" and s.path.endswith(f"/resolve/{fake_hub.repos[repo].commit}/{WEIGHTS}")
    ]
    assert [s.authorization for s in head] == ["Bearer hf_allowed"]


def test_a_repository_with_only_pickles_is_refused_before_any_download(
    fake_hub: FakeHub, tiny_dir: Path, tmp_path: Path
) -> None:
    files = {p.name: p.read_bytes() for p in tiny_dir.iterdir() if p.name != WEIGHTS}
    fake_hub.publish("old-org/pickled", {**files, "pytorch_model.bin": b"\x80\x02pickle"})
    with pytest.raises(hub.HubError) as refused:
        pull_model("old-org/pickled", tmp_path / "models")
    assert refused.value.code == "unsupported_model"
    assert str(refused.value) == (
        "Hub model old-org/pickled at main holds only pickle checkpoints (pytorch_model.bin); Loraq "
        "loads safetensors only (pickles can run code): pick a repository or revision with safetensors "
        "weights, or convert them and register the directory with `loraq models add`"
    )
    assert not [s for s in fake_hub.seen if "/resolve/" in s.path]


def test_missing_repository_and_revision_say_so(fake_hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(hub.HubError) as missing:
        pull_model("nobody/nothing", tmp_path / "models")
    assert missing.value.code == "model_not_on_hub"
    assert str(missing.value) == (
        f"Hub model nobody/nothing does not exist on {fake_hub.url}, or is private and was asked without "
        "a token (HF_TOKEN is not set): check the id, or set HF_TOKEN to a token that can read it"
    )
    with pytest.raises(hub.HubError, match=f"Hub model {REPO} has no revision 'v9'") as revision:
        pull_model(REPO, tmp_path / "models", revision="v9")
    assert revision.value.code == "revision_not_found"
    with pytest.raises(ModelError, match="--revision is for Hugging Face Hub models"):
        pull_model("smollm2-135m-instruct", tmp_path / "models", revision="main")


@pytest.mark.slow
def test_two_processes_pulling_one_model_download_it_once(fake_hub: FakeHub, tmp_path: Path) -> None:
    release = fake_hub.repos[REPO].hold = threading.Event()  # the weights wait after their first piece
    store = tmp_path / "models"
    env = {**os.environ, "HF_ENDPOINT": fake_hub.url}

    def start(name: str) -> subprocess.Popen[str]:
        out = (tmp_path / name).open("w")
        return subprocess.Popen(
            [sys.executable, "-c", PULL_SCRIPT, REPO, str(store)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def lines(name: str) -> list[object]:
        return [json.loads(x) for x in (tmp_path / name).read_text().splitlines() if x.startswith(("{", '"'))]

    first = start("first.out")
    try:
        wait_for(
            lambda: bool(fake_hub.downloads(REPO, WEIGHTS)), "the first pull's download of the weights", 60
        )
        assert (hub_dir(REPO, store) / PULL_LOCK).exists()
        second = start("second.out")
        waiting = f"Waiting for another job's download of base model {REPO}"
        wait_for(lambda: waiting in lines("second.out"), "the second pull to wait for the lock", 60)
    finally:
        release.set()
    assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 0, (
        lines("first.out"),
        lines("second.out"),
    )
    assert lines("first.out")[-1] == {"downloaded": True}
    assert lines("second.out") == [
        waiting,
        f"Base model {REPO} is local now (downloaded by another job); not downloading it again",
        {"downloaded": False},
    ]
    assert len(fake_hub.downloads(REPO, WEIGHTS)) == 1


@pytest.mark.slow
def test_cli_pulls_a_revision_with_progress_and_lists_each_base(fake_hub: FakeHub, tmp_path: Path) -> None:
    env = {**os.environ, "HF_ENDPOINT": fake_hub.url, "LORAQ_DATA_DIR": str(tmp_path), "COLUMNS": "250"}
    commit = fake_hub.repos[REPO].commit
    cli = [sys.executable, "-m", "service.cli", "models"]
    pulled = subprocess.run(
        [*cli, "pull", REPO, "--revision", commit], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert (
        f"downloading {REPO}" in pulled.stdout
        and f"{REPO} ready at {hub_dir(REPO, tmp_path / 'models')}" in pulled.stdout
    )
    assert json.loads((hub_dir(REPO, tmp_path / "models") / HUB_MARKER).read_text())["revision"] == commit

    listed = subprocess.run([*cli, "list", "--wide"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    # a borderless table: columns are apart by 2+ spaces, a cell never holds two in a row
    rows = {r[0]: r[1:] for r in (re.split(r"\s{2,}", line.strip()) for line in listed.stdout.splitlines())}
    assert get_model_info(REPO, tmp_path / "models").parameters == 51392  # 51.4K
    assert rows[REPO][:5] == ["hub", "Qwen3", "51.4K", "256", "local"]
    assert rows["smollm2-135m-instruct"][:5] == ["pretrained", "Llama", "135M", "8192", "not pulled"]
    assert rows["llama-8b"][:5] == ["random", "Llama", "8.03B", "8192", "built-in"]

    wrong = subprocess.run(
        [*cli, "pull", "nobody/nothing"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert wrong.returncode == 1 and "Hub model nobody/nothing does not exist on" in wrong.stderr
