"""Alembic migrations applied from code, plus the schema-version check every command runs first."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Engine, inspect

from matrix.errors import DatabaseError
from matrix.resources import resource_dir


def alembic_config(engine: Engine) -> Config:
    """An in-memory Alembic config bound to `engine` (no alembic.ini needed at run time)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(resource_dir("migrations")))
    cfg.attributes["engine"] = engine
    return cfg


def head_revision(engine: Engine) -> str:
    head = ScriptDirectory.from_config(alembic_config(engine)).get_current_head()
    if head is None:  # pragma: no cover - the package always ships migrations
        raise DatabaseError("no migrations found: the matrix installation is broken; reinstall it")
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade to `revision`; returns (before, after)."""
    before = current_revision(engine)
    command.upgrade(alembic_config(engine), revision)
    return before, current_revision(engine)


def downgrade(engine: Engine, revision: str) -> tuple[str | None, str | None]:
    before = current_revision(engine)
    config = alembic_config(engine)
    try:
        command.downgrade(config, revision)
    except CommandError as exc:
        # Alembic resolves the target before it runs any migration, so nothing has changed.
        known = [rev.revision for rev in ScriptDirectory.from_config(config).walk_revisions()]
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "not a revision"
        raise DatabaseError(
            f"cannot downgrade to {revision!r}: {reason}. Give one of: base, {', '.join(known)} "
            "(`matrix db current` shows where the database is)"
        ) from None
    return before, current_revision(engine)


def ensure_schema(engine: Engine) -> None:
    """Create a brand-new database; refuse to work on one whose schema is not this matrix's."""
    current = current_revision(engine)
    head = head_revision(engine)
    if current == head:
        return
    if current is None:
        tables = set(inspect(engine).get_table_names())
        if not tables:
            upgrade(engine)
            return
        raise DatabaseError(
            "the database has tables but no matrix schema version "
            f"({', '.join(sorted(tables)[:5])}...): it is not a matrix database. Pass another --db"
        )
    known = {rev.revision for rev in ScriptDirectory.from_config(alembic_config(engine)).walk_revisions()}
    if current not in known:
        raise DatabaseError(
            f"database schema is at {current}, which this matrix does not know (it needs {head}): "
            "the database was upgraded by a newer matrix; upgrade matrix"
        )
    raise DatabaseError(f"database schema is at {current}, this matrix needs {head}: run `matrix db upgrade`")
