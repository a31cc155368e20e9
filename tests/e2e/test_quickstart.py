"""The README's first fine-tune, as a newcomer runs it: `loraq up`, then the quickstart's `loraq`
commands exactly as the README writes them (every hyperparameter `auto`) on the real
SmolLM2-135M-Instruct and `tests/data/pirate/train.jsonl`, on the CPU.

What must hold is what a newcomer looks for: the adapter visibly changed the model. On the 20
held-out prompts of `tests/data/pirate/heldout_prompts.jsonl` (topics and phrasings in neither
data file), answered through the API's chat completions, the fine-tuned model speaks pirate on
most of them and the base model on none to speak of. Also: `jobs watch` prints the plan and an ETA
from the first step on, and the plan says at least 48 steps (packing once made this 3 steps, and
the model did not change). The README states how long this takes next to the commands.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.procs import ROOT, clean_env
from tests.e2e.test_up import running_up
from tests.engine.conftest import TEST_MODEL_STORE, pull_test_model
from worker.engine.training_config import AUTO_MIN_STEPS

PIRATE = ROOT / "tests" / "data" / "pirate"
PIRATE_WORDS = re.compile(r"\b(arr+|matey|treasure|yo ho|ahoy)\b", re.IGNORECASE)
MODEL = "smollm2-135m-instruct"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def quickstart_commands() -> list[str]:
    """The `loraq …` lines of the README's first sh block after "first real fine-tune"."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("run a first real fine-tune")
    block = readme[readme.index("```sh", start) + 5 : readme.index("```", readme.index("```sh", start) + 5)]
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    return [line for line in lines if line.startswith("loraq ")]


def pirate_rate(answers: list[str]) -> float:
    return sum(bool(PIRATE_WORDS.search(a)) for a in answers) / len(answers)


def answers(url: str, key: str, model: str, prompts: list[str]) -> list[str]:
    """`model`'s greedy answers to `prompts`, in order. Asked all at once, as several users
    would: the inference worker decodes them in one batch. One at a time, each of the 16 tokens
    of each answer read all of SmolLM2's fp32 weights on its own (~1.8 s a request on the 2-core
    machine, 37 s for 20); a batch of 20 takes about 8 s."""

    def ask(c: httpx.Client, prompt: str) -> str:
        r = c.post(
            "/chat/completions",
            json={
                "model": model,
                "temperature": 0,
                "max_tokens": 16,
                "messages": [{"role": "user", "content": prompt}],
            },
        )
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    with (
        httpx.Client(base_url=url + "/v1", headers={"Authorization": f"Bearer {key}"}, timeout=300) as c,
        ThreadPoolExecutor(max_workers=len(prompts)) as pool,
    ):
        return list(pool.map(lambda prompt: ask(c, prompt), prompts))


def test_readme_quickstart_visibly_changes_the_model(tmp_path: Path) -> None:
    pull_test_model(MODEL)  # cached across runs; `loraq models pull` below finds it
    shutil.copytree(TEST_MODEL_STORE / MODEL, tmp_path / "var" / "models" / MODEL)
    commands = quickstart_commands()
    assert [c.split()[1:3] for c in commands] == [
        ["models", "pull"],
        ["files", "upload"],
        ["jobs", "create"],
        ["jobs", "watch"],
        ["jobs", "download"],
    ], commands
    prompts = [
        json.loads(line)["prompt"] for line in (PIRATE / "heldout_prompts.jsonl").read_text().splitlines()
    ]

    key = "sk-quickstart-0123456789abcdef"
    with running_up(tmp_path, LORAQ_API_KEY=key) as (_proc, url, _data_dir):
        env = clean_env(LORAQ_URL=url, LORAQ_API_KEY=key, COLUMNS="200")
        ids: dict[str, str] = {}
        outputs: dict[str, str] = {}
        started = time.monotonic()
        for command in commands:
            argv = command.split()[1:]
            argv = [ids.get(a.split("-")[0], a) if a.endswith("-...") else a for a in argv]
            done = subprocess.run(
                [sys.executable, "-m", "service.cli", *argv],
                env=env,
                cwd=tmp_path if argv[:2] == ["jobs", "download"] else ROOT,
                capture_output=True,
                text=True,
                timeout=1500,
            )
            assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
            outputs[argv[0] + " " + argv[1]] = done.stdout
            for prefix in ("file", "ftjob"):
                found = re.search(rf"\b{prefix}-[A-Za-z0-9_-]{{8,}}", done.stdout)
                if found and prefix not in ids:
                    ids[prefix] = found.group(0)
        took = time.monotonic() - started
        assert (tmp_path / "adapter.zip").stat().st_size > 0

        watch = outputs["jobs watch"]
        plan = re.search(r"Plan: .*?-> (\d+) optimizer steps", watch)
        assert plan is not None and int(plan.group(1)) >= AUTO_MIN_STEPS, watch
        first = re.search(r"step 1/\d+ .* ETA (\S+)", watch)
        assert first is not None and first.group(1) != "-", watch  # an ETA from the first step on

        job = httpx.get(
            f"{url}/v1/fine_tuning/jobs/{ids['ftjob']}", headers={"Authorization": f"Bearer {key}"}
        )
        tuned_model = job.json()["fine_tuned_model"]
        assert job.json()["hyperparameters"]["batch_size"] != "auto"  # planned, and shown
        base = answers(url, key, MODEL, prompts)
        tuned = answers(url, key, tuned_model, prompts)
    print(
        f"\nquickstart: {took:.0f} s from `models pull` to the download; pirate words "
        f"base {pirate_rate(base):.0%} -> adapter {pirate_rate(tuned):.0%}; e.g. {tuned[0]!r}"
    )
    assert pirate_rate(base) <= 0.10, base
    assert pirate_rate(tuned) >= 0.75, tuned
