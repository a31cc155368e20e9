"""tests/servers.py: a server binary the suite needs and cannot find fails the test, naming the
Debian package to install; it is never a skip, so a missing server cannot pass CI silently.

The lookup is pointed at empty directories (PATH, and Debian's versioned PostgreSQL bin dirs), so
these run the same whether or not the binaries are installed here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import servers

ROOT = Path(__file__).resolve().parents[1]

# Each package the README's apt-get line names, and the binaries the suite runs from it; written
# out rather than read from servers.PACKAGES, so a wrong entry there fails here.
BINARIES_OF_PACKAGE = {
    "redis-server": ["redis-server"],
    "postgresql": ["initdb", "postgres"],
    "chromium": ["chromium"],
    "prometheus": ["prometheus", "promtool"],
    "iproute2": ["ip"],
    "socat": ["socat"],
}
EXPECTED_PACKAGES = {binary: package for package, bins in BINARIES_OF_PACKAGE.items() for binary in bins}


@pytest.fixture
def no_binaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH and the PostgreSQL bin-dir glob both lead only to empty directories; returns PATH's."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(servers, "POSTGRES_BIN_GLOB", f"{tmp_path / 'no-postgresql'}/*/bin")
    monkeypatch.delenv("LORAQ_TEST_REDIS_URL", raising=False)
    monkeypatch.delenv("LORAQ_TEST_DATABASE_URL", raising=False)
    return empty


def outcome_of(call: Callable[[], object]) -> BaseException:
    """What `call` raised. pytest's skip and fail are BaseExceptions, and a skip escaping
    `pytest.raises(pytest.fail.Exception)` would skip this test instead of failing it: so both are
    caught here and the caller asserts which one it got."""
    try:
        call()
    except BaseException as e:  # skip and fail alike: the outcome is what is checked
        return e
    raise AssertionError(f"{call} raised nothing")


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_every_binary_the_suite_looks_up_is_known() -> None:
    assert servers.PACKAGES == EXPECTED_PACKAGES


@pytest.mark.parametrize(("binary", "package"), sorted(EXPECTED_PACKAGES.items()))
def test_a_missing_binary_fails_naming_its_package(no_binaries: Path, binary: str, package: str) -> None:
    failed = outcome_of(lambda: servers.require_binary(binary))
    assert type(failed) is pytest.fail.Exception, repr(failed)
    assert failed.msg == f"`{binary}` is not installed: apt-get install -y {package}"


def test_the_suites_throwaway_servers_fail_naming_the_package(no_binaries: Path, tmp_path: Path) -> None:
    redis = outcome_of(lambda: servers.start_redis(tmp_path / "redis"))
    assert type(redis) is pytest.fail.Exception, repr(redis)
    assert str(redis) == "`redis-server` is not installed: apt-get install -y redis-server"
    postgres = outcome_of(servers.start_postgres)
    assert type(postgres) is pytest.fail.Exception, repr(postgres)
    assert str(postgres) == "`initdb` is not installed: apt-get install -y postgresql"


def test_an_installed_binary_is_found(
    no_binaries: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failures above come from the empty lookup, not from a helper that always fails."""
    redis = executable(no_binaries / "redis-server")
    assert servers.require_binary("redis-server") == str(redis)
    # PostgreSQL's server binaries are off PATH on Debian: the newest versioned dir wins.
    base = tmp_path / "postgresql"
    monkeypatch.setattr(servers, "POSTGRES_BIN_GLOB", f"{base}/*/bin")
    executable(base / "9" / "bin" / "initdb")
    newest = executable(base / "16" / "bin" / "initdb")
    assert servers.require_binary("initdb") == str(newest)


def test_a_session_without_redis_reports_an_error_not_a_skip(no_binaries: Path, tmp_path: Path) -> None:
    """As the suite uses it: a test whose fixture needs the session's Redis, run by pytest."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's config
    (tmp_path / "test_needs_redis.py").write_text(
        "import pytest\n"
        "from tests.servers import shared_redis_url\n\n"
        "@pytest.fixture\n"
        "def redis_url() -> str:\n"
        "    return shared_redis_url()\n\n"
        "def test_uses_redis(redis_url: str) -> None:\n"
        "    pass\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # PATH: the empty dir from `no_binaries`
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 1, text  # 1: tests failed or errored (a run of skips alone exits 0)
    assert "1 error" in text and "skipped" not in text, text
    assert "`redis-server` is not installed: apt-get install -y redis-server" in text, text


def test_the_readme_lists_every_package() -> None:
    line = next(
        line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("OS packages")
    )
    assert all(f" {package}" in line for package in BINARIES_OF_PACKAGE), line
