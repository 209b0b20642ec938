"""Alembic migrations applied from code, plus the schema-version check every command runs first.

The check is on every command's path, and importing Alembic costs more than most commands' own work. So
when the database is current it is settled without Alembic: the head is read from the migration files'
`revision`/`down_revision` lines and the stored revision from `alembic_version` with one SELECT. Anything
unusual (no table, several rows, a merge, a file the reading does not understand, a mismatch) goes the
Alembic way, which alone upgrades, downgrades and explains.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import SQLAlchemyError

from matrix.errors import DatabaseError
from matrix.resources import resource_dir

if TYPE_CHECKING:
    from alembic.config import Config

_REVISION = re.compile(r"""^revision\s*(?::[^=]*)?=\s*["']([^"']+)["']\s*$""", re.MULTILINE)
_DOWN = re.compile(r"""^down_revision\s*(?::[^=]*)?=\s*(?:None|["']([^"']+)["'])\s*$""", re.MULTILINE)


@functools.cache
def quick_head() -> str | None:
    """The shipped migrations' head read without Alembic (see `read_head`)."""
    return read_head(resource_dir("migrations") / "versions")


def read_head(versions: Path) -> str | None:
    """The head revision of the migration files in `versions`, or None when they are not one plain chain
    this reading understands (then Alembic decides)."""
    revisions: dict[str, str | None] = {}
    for path in sorted(versions.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        revision, down = _REVISION.findall(source), _DOWN.findall(source)
        if len(revision) != 1 or len(down) != 1 or revision[0] in revisions:
            return None
        revisions[revision[0]] = down[0] or None
    heads = set(revisions) - set(revisions.values())
    return heads.pop() if len(heads) == 1 else None


def stored_revision(engine: Engine) -> str | None:
    """The revision in `alembic_version` read with one SELECT, or None when there is not exactly one."""
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT version_num FROM alembic_version")).all()
    except SQLAlchemyError:
        return None
    return str(rows[0][0]) if len(rows) == 1 else None


def alembic_config(engine: Engine) -> Config:
    """An in-memory Alembic config bound to `engine` (no alembic.ini needed at run time)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(resource_dir("migrations")))
    cfg.attributes["engine"] = engine
    return cfg


def head_revision(engine: Engine) -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config(engine)).get_current_head()
    if head is None:  # pragma: no cover - the package always ships migrations
        raise DatabaseError("no migrations found: the matrix installation is broken; reinstall it")
    return head


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade to `revision`; returns (before, after)."""
    from alembic import command

    before = current_revision(engine)
    command.upgrade(alembic_config(engine), revision)
    return before, current_revision(engine)


def downgrade(engine: Engine, revision: str) -> tuple[str | None, str | None]:
    from alembic import command
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

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
    head = quick_head()
    if head is not None and stored_revision(engine) == head:
        return  # current: settled without importing Alembic
    from alembic.script import ScriptDirectory

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
