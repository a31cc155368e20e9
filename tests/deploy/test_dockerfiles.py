"""Structural checks of the images' Dockerfiles (no Docker engine on CI: nothing is built here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.dockerfile import Dockerfile, instructions, parse

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
# name:tag where the tag carries at least major.minor (e.g. 3.11.11-slim-bookworm, 13.0.2-devel-...).
PINNED_TAG = re.compile(r"^[\w./-]+:v?\d+\.\d+[\w.-]*$")


def test_both_images_exist() -> None:
    assert {p.name for p in DOCKERFILES} >= {"api.Dockerfile", "worker.Dockerfile"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_bases_pinned_multistage_nonroot(path: Path) -> None:
    df = parse(path)
    assert len(df.stages) >= 2, f"{path.name}: expected a multi-stage build"
    stage_names = {s.name for s in df.stages if s.name}
    for stage in df.stages:
        if stage.image in stage_names:
            continue  # FROM an earlier stage
        assert "$" not in stage.image, f"{path.name}: FROM {stage.image} uses an ARG without a default"
        assert PINNED_TAG.match(stage.image), f"{path.name}: base {stage.image!r} is not pinned to a version"
    users = df.final.all("USER")
    assert users, f"{path.name}: final stage has no USER"
    assert users[-1].args.split(":")[0] not in {"root", "0"}, f"{path.name}: final stage runs as root"
    # Nothing runs as root after the final USER.
    last_user_line = users[-1].line
    assert not [i for i in df.final.all("RUN") if i.line > last_user_line]
    # Nothing copied from the build context into the final stage: it takes the build stage's output.
    for copy in df.final.all("COPY"):
        assert copy.args.startswith("--from="), f"{path.name}:{copy.line}: final stage COPY from context"


def _api() -> Dockerfile:
    return parse(ROOT / "docker" / "api.Dockerfile")


def _worker() -> Dockerfile:
    return parse(ROOT / "docker" / "worker.Dockerfile")


def test_api_image_is_slim_python_without_cuda_or_torch() -> None:
    df = _api()
    assert all(re.match(r"python:3\.\d+\.\d+-slim", s.image) for s in df.stages), df.stages
    text = (ROOT / "docker" / "api.Dockerfile").read_text()
    assert "cuda" not in " ".join(s.image for s in df.stages).lower()
    assert "--no-deps" in text
    excluded = api_excluded_deps()
    assert "torch" in excluded
    # The healthcheck hits /readyz, and the entrypoint migrates before serving.
    (health,) = df.final.all("HEALTHCHECK")
    assert "/readyz" in health.args
    (entry,) = df.final.all("ENTRYPOINT")
    entrypoint = (ROOT / entry.args.strip('[]"').replace("/app/", "", 1)).read_text()
    assert entrypoint.index("prepare_database_and_key") < entrypoint.index("exec uvicorn")


def api_excluded_deps() -> list[str]:
    for ins in instructions((ROOT / "docker" / "api.Dockerfile").read_text()):
        if ins.keyword == "ARG" and ins.args.startswith("WORKER_ONLY_DEPS="):
            return ins.args.partition("=")[2].strip('"').split()
    raise AssertionError("api.Dockerfile has no ARG WORKER_ONLY_DEPS")


def test_worker_image_cuda_matches_torch_build_and_builds_kernels() -> None:
    df = _worker()
    build, runtime = df.stages[0], df.final
    assert re.match(r"nvidia/cuda:\d+\.\d+\.\d+-devel-ubuntu\d+\.\d+$", build.image), build.image
    cuda_major, cuda_minor = re.findall(r"cuda:(\d+)\.(\d+)", build.image)[0]
    args = {a.args.partition("=")[0]: a.args.partition("=")[2] for a in build.all("ARG")}
    # torch's wheel index names the CUDA it was built against: cu130 <-> CUDA 13.0.
    assert args["TORCH_INDEX_URL"].endswith(f"/cu{cuda_major}{cuda_minor}"), args["TORCH_INDEX_URL"]
    assert runtime.image.startswith(f"nvidia/cuda:{cuda_major}.{cuda_minor}.")
    runs = " ".join(r.args for r in build.all("RUN"))
    assert "python -m gpu_kernels.build" in runs
    volumes = " ".join(v.args for v in runtime.all("VOLUME"))
    assert "/data" in volumes and "/data/models" in volumes


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    ignored = {
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"
    }
    assert {".git", ".venv", "var", "**/*.so"} <= ignored


def test_requirements_exclusion_matches_pyproject() -> None:
    script = ROOT / "docker" / "requirements_from_pyproject.py"
    run = [sys.executable, str(script), str(ROOT / "pyproject.toml")]
    excluded = api_excluded_deps()
    out = subprocess.run([*run, "--exclude", *excluded], capture_output=True, text=True, check=True)
    names = {re.split(r"[\[<>=!~; ]", line)[0].lower() for line in out.stdout.split()}
    assert "fastapi" in names and "celery" in names
    assert not names & set(excluded)
    stale = subprocess.run([*run, "--exclude", "not-a-dependency"], capture_output=True, text=True)
    assert stale.returncode != 0 and "not-a-dependency" in stale.stderr
