"""The New-job form takes a Hugging Face Hub id typed in instead of a listed base (a real Chromium,
the app on a real HTTP server, the suite's Hub through HF_ENDPOINT): a missing repository is the
submit's 400 shown on that field, naming the model; an existing one makes the job, and the list
shows the model afterwards with its family, size, context and "not local"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DATASET, ApiClient
from tests.dashboard.conftest import keyed_page
from tests.dashboard.test_browser import CHROMIUM_ARGS
from tests.engine.tiny_families import save_tiny_family
from tests.fake_hub import FakeHub, hub_endpoint
from tests.live_server import serve
from tests.servers import require_binary

pytestmark = pytest.mark.browser

REPO = "tiny-org/tiny-mistral"


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    with hub_endpoint(monkeypatch, REPO, save_tiny_family("MistralForCausalLM", tmp_path / "m")) as served:
        yield served


@pytest.fixture
def served(api: ApiClient, fake_hub: FakeHub) -> Iterator[str]:
    from service.app import create_app

    with serve(create_app()) as url:
        yield url


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_hub_id_typed_in_the_form_is_the_jobs_model(served: str, api: ApiClient, fake_hub: FakeHub) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=require_binary("chromium"), args=CHROMIUM_ARGS)
        with keyed_page(browser, api.key, 1360) as (page, errors):
            page.goto(f"{served}/new")
            expect(page.locator(f"#model option[value='{REPO}']")).to_have_count(0)  # not known yet
            page.fill("#hub_model", "nobody/nothing")
            page.set_input_files(
                "#trainfile", {"name": "train.jsonl", "mimeType": "application/jsonl", "buffer": DATASET}
            )
            expect(page.locator("#submit")).to_be_enabled()
            page.click("#submit")
            expect(page.locator("#submiterror")).to_contain_text("Hub model nobody/nothing does not exist on")
            expect(page.locator("#hub_model")).to_have_attribute("aria-invalid", "true")

            page.fill("#hub_model", REPO)
            page.click("#submit")
            page.wait_for_url(f"{served}/jobs/*")
            job_id = page.url.rsplit("/", 1)[-1]
            assert api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["model"] == REPO

            page.goto(f"{served}/new")  # the submit fetched its config: the list shows it now
            expect(page.locator(f"#model option[value='{REPO}']")).to_have_text(
                f"{REPO} (Mistral, 60.6K parameters, context 256; not local: downloaded on first use)"
            )
            assert errors == []
