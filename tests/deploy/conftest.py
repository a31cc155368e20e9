"""Deploy tests reuse the e2e fixtures (a private redis-server) and add a fresh PostgreSQL database."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import PG_ADMIN_URL, redis_url

__all__ = ["pg_db_url", "redis_url"]


@pytest.fixture
def pg_db_url() -> Iterator[str]:
    """A new database in the local PostgreSQL (what a deployment shares), dropped afterwards."""
    import psycopg

    name = f"loraq_deploy_{secrets.token_hex(4)}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
