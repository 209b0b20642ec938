"""Alembic environment: runs against the engine matrix hands over (or `sqlalchemy.url` for the CLI)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from matrix.db.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = config.attributes.get("engine")
    if engine is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "sqlite://")
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            # SQLite cannot ALTER most things; batch mode recreates tables instead.
            render_as_batch=True,
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()


if context.is_offline_mode():
    raise SystemExit("matrix migrations run online only: use `matrix db upgrade`")
run_migrations_online()
