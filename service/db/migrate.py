"""Run Alembic migrations from code (`loraq up`, the API when asked, tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, pool

ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS_DIR = ROOT / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["database_url"] = url
    return cfg


def upgrade_head(url: str) -> None:
    """Bring the database at `url` to the newest revision (idempotent).

    On PostgreSQL an advisory lock serialises concurrent callers (`loraq up` and an API process
    starting together); SQLite serialises writers itself.
    """
    if url.startswith("sqlite"):
        _sqlite_parent(url)
        command.upgrade(alembic_config(url), "head")
        return
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql("SELECT pg_advisory_lock(724911)")
            try:
                cfg = alembic_config(url)
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
                conn.commit()
            finally:
                if conn.dialect.name == "postgresql":
                    conn.exec_driver_sql("SELECT pg_advisory_unlock(724911)")
                    conn.commit()
    finally:
        engine.dispose()


def _sqlite_parent(url: str) -> None:
    # sqlite:///relative/or/absolute.db: create the directory so a fresh data dir works
    path = url.split("///", 1)[1] if "///" in url else ""
    if path and path != ":memory:":
        Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
