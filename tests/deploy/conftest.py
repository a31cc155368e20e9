"""Deploy tests reuse the e2e fixtures (a private redis-server) and add a fresh PostgreSQL database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import redis_url
from tests.servers import create_pg_database, drop_pg_database

__all__ = ["pg_db_url", "redis_url"]


@pytest.fixture
def pg_db_url() -> Iterator[str]:
    """A new database on the suite's PostgreSQL (what a deployment shares), dropped afterwards."""
    name, url = create_pg_database("loraq_deploy")
    yield url
    drop_pg_database(name)
