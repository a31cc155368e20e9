"""Migrations and models agree, on SQLite and PostgreSQL: after `upgrade head` on an empty
database, Alembic's autogenerate comparison finds nothing to change; downgrade empties it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, pool

from service.db.migrate import alembic_config, upgrade_head
from service.db.models import Base
from tests.servers import create_pg_database, drop_pg_database


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
        return
    name, url = create_pg_database("loraq_mig")
    try:
        yield url
    finally:
        drop_pg_database(name)


def diffs(url: str) -> list[object]:
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, Base.metadata))
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_migrations_match_models(empty_db: str) -> None:
    assert diffs(empty_db)  # sanity: an empty database differs from the models
    upgrade_head(empty_db)
    assert diffs(empty_db) == []
    assert set(Base.metadata.tables) <= tables(empty_db)


def test_upgrade_is_idempotent_and_downgrade_drops_everything(empty_db: str) -> None:
    upgrade_head(empty_db)
    upgrade_head(empty_db)  # a second start does nothing
    command.downgrade(alembic_config(empty_db), "base")
    assert tables(empty_db) <= {"alembic_version"}
    upgrade_head(empty_db)
    assert diffs(empty_db) == []


def test_sqlite_upgrade_creates_the_data_directory(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new' / 'dir' / 'loraq.db'}"
    upgrade_head(url)
    assert diffs(url) == []
