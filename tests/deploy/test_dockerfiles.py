"""Structural checks of the images' Dockerfiles (no Docker engine on CI: nothing is built here)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.dockerfile import Dockerfile, parse

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
    assert entrypoint.index("prepare_database_and_key") < entrypoint.index("exec loraq api")


def api_excluded_deps() -> list[str]:
    """The `worker` extra of pyproject.toml: what the API image must not install."""
    return [Requirement(r).name for r in _pyproject()["project"]["optional-dependencies"]["worker"]]


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def locked(name: str) -> dict[str, str]:
    """Package name (normalised) -> pinned version of requirements/<name>.txt; every pin hashed."""
    text = (ROOT / "requirements" / f"{name}.txt").read_text()
    pins: dict[str, str] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        m = re.match(r"([A-Za-z0-9_.\-]+(?:\[[^\]]*\])?)==(\S+)", block)
        if m:
            assert "--hash=sha256:" in block, f"{name}.txt: {m.group(1)} has no hash"
            pins[canonicalize_name(Requirement(m.group(1)).name)] = m.group(2)
    return pins


@pytest.mark.parametrize(
    ("lock", "extras"),
    [("api", []), ("cpu", ["worker", "integrations", "dev"]), ("cuda", ["worker", "integrations", "bench"])],
)
def test_locks_satisfy_pyproject(lock: str, extras: list[str]) -> None:
    """Each lock pins every dependency its install asks for, at a version the range admits: a
    range changed without `make lock` fails here."""
    project = _pyproject()["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        wanted += [Requirement(r) for r in project["optional-dependencies"][extra]]
    pins = locked(lock)
    for req in wanted:
        name = canonicalize_name(req.name)
        assert name in pins, f"requirements/{lock}.txt lacks {req.name}: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements/{lock}.txt pins {req.name}=={pins[name]}, outside {req.specifier}: run `make lock`"
        )
    excluded = {canonicalize_name(n) for n in api_excluded_deps()}
    if lock == "api":
        assert not excluded & set(pins), excluded & set(pins)
    else:
        assert excluded <= set(pins)


def test_cpu_lock_takes_the_cpu_torch_and_cuda_lock_a_cuda_one() -> None:
    assert locked("cpu")["torch"].endswith("+cpu")
    cuda = locked("cuda")
    assert "+" not in cuda["torch"] and "nvidia-cuda-runtime" in cuda


def test_ml_packages_have_upper_bounds() -> None:
    project = _pyproject()["project"]
    reqs = [
        Requirement(r)
        for extra in ("worker", "dev", "bench")
        for r in project["optional-dependencies"][extra]
    ]
    for req in reqs:
        if canonicalize_name(req.name) in {"torch", "transformers", "peft", "accelerate"}:
            assert any(s.operator in {"<", "<=", "=="} for s in req.specifier), f"{req} has no upper bound"


def test_images_install_from_the_locks() -> None:
    for image, lock in (("api", "api"), ("worker", "cuda")):
        runs = " ".join(r.args for r in parse(ROOT / "docker" / f"{image}.Dockerfile").stages[0].all("RUN"))
        assert f"--require-hashes --no-deps -r requirements/{lock}.txt" in runs, image
        assert "pip install --no-deps -e ." in runs, image


def test_worker_image_cuda_matches_torch_build_and_builds_kernels() -> None:
    df = _worker()
    build, runtime = df.stages[0], df.final
    assert re.match(r"nvidia/cuda:\d+\.\d+\.\d+-devel-ubuntu\d+\.\d+$", build.image), build.image
    cuda_major, cuda_minor = re.findall(r"cuda:(\d+)\.(\d+)", build.image)[0]
    # The locked torch's CUDA runtime (nvidia-cuda-runtime==13.0.x) is the base image's CUDA.
    runtime_pin = locked("cuda")["nvidia-cuda-runtime"]
    assert runtime_pin.split(".")[:2] == [cuda_major, cuda_minor], (runtime_pin, build.image)
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
