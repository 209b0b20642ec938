"""Open the database: resolve the URL, apply SQLite pragmas, and check the schema version.

A brand-new database (no tables at all) is created and upgraded on first use. A database whose schema
is behind (or ahead of) this matrix stops every command except `matrix db upgrade` with a message that
says what to run. PostgreSQL URLs without a driver (`postgresql://`, `postgres://`) use psycopg 3, the
driver the `postgres` extra installs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, inspect
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from matrix.errors import DatabaseError
from matrix.paths import default_db_path

SQLITE_BUSY_TIMEOUT_MS = 30_000
# Seconds to wait for a database server before saying it cannot be reached (instead of the OS's minutes).
CONNECT_TIMEOUT_S = 10
POSTGRES_DRIVER_HINT = "for psycopg 3: pip install 'disagg-matrix[postgres]' and a postgresql+psycopg:// URL"


def resolve_url(url: str | None) -> str:
    """`--db` wins, then `$MATRIX_DB`, then the default SQLite file in the data directory.

    A plain filesystem path is accepted as a SQLite database.
    """
    raw = url or os.environ.get("MATRIX_DB")
    if not raw:
        path = default_db_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path}"
    if "://" not in raw:
        return f"sqlite:///{Path(raw).expanduser().resolve()}"
    return raw


def display_url(url: str) -> str:
    """The URL with any password hidden, safe for logs and reports."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        return "<invalid database URL>"


def _parse(url: str) -> URL:
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        # The URL itself may hold a password: the message names the expected shape, not the input.
        raise DatabaseError(
            "invalid database URL: use a SQLAlchemy URL such as "
            "sqlite:////path/to/matrix.db or postgresql+psycopg://user@host/db"
        ) from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def _without_secret(text: str, parsed: URL) -> str:
    password = parsed.password
    return text.replace(str(password), "***") if password else text


def _set_sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (reports) run while a campaign writes; the busy timeout makes concurrent runners
    # wait for each other's short transactions instead of failing with "database is locked".
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def create_db_engine(url: str) -> Engine:
    """Create an engine and prove it can connect; errors become a `DatabaseError` naming the URL."""
    parsed = _parse(url)
    shown = display_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        parent = Path(parsed.database).expanduser().parent
        if not parent.is_dir():
            raise DatabaseError(
                f"cannot open database {shown}: directory {parent} does not exist. "
                "Create it, or pass another --db / MATRIX_DB"
            )
    options: dict[str, Any] = {}
    if parsed.get_backend_name() == "postgresql":
        # Shared databases sit behind networks that drop idle connections: check before use.
        options["pool_pre_ping"] = True
        if "connect_timeout" not in parsed.query:
            options["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    try:
        engine = create_engine(parsed, **options)
    except (NoSuchModuleError, ImportError) as exc:
        hint = POSTGRES_DRIVER_HINT if parsed.get_backend_name() == "postgresql" else "or use a SQLite URL"
        raise DatabaseError(
            f"cannot open database {shown}: the driver is not installed ({_without_secret(str(exc), parsed)}). "
            f"Install it ({hint})"
        ) from None
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _set_sqlite_pragmas)
    try:
        with engine.connect() as conn:
            inspect(conn).get_table_names()
    except SQLAlchemyError as exc:
        engine.dispose()
        orig = getattr(exc, "orig", None)
        reason = _without_secret(str(orig) if orig is not None else str(exc), parsed)
        reason = reason.strip().splitlines()[0]
        if parsed.get_backend_name() != "sqlite":
            hint = "Check the URL, permissions and that the server is running"
        elif "not a database" in reason:
            hint = f"{parsed.database} is not a SQLite database: pass a matrix database (or a new path) with --db"
        else:
            hint = "Check the path and that this user may read and write the file and its directory"
        raise DatabaseError(f"cannot open database {shown}: {reason}. {hint}") from None
    return engine


# PostgreSQL's SQLSTATE for a write in a read-only transaction (`default_transaction_read_only`, a standby).
_PG_READ_ONLY = "25006"


def read_only_error(exc: SQLAlchemyError, url: str) -> DatabaseError | None:
    """The user's error for a write refused because the database is read-only; None for anything else.

    SQLite says "attempt to write a readonly database" (file or directory not writable, a read-only
    filesystem); PostgreSQL refuses with SQLSTATE 25006. Nothing was written: the transaction failed whole.
    """
    orig = getattr(exc, "orig", None)
    text = (str(orig if orig is not None else exc).strip().splitlines() or [""])[0]
    if "readonly database" not in text and getattr(orig, "sqlstate", None) != _PG_READ_ONLY:
        return None
    how = (
        "make the file and its directory writable by this user"
        if url.startswith("sqlite")
        else "use a user and server that accept writes"
    )
    return DatabaseError(
        f"database {display_url(url)} is read-only ({_without_secret(text, _parse(url))}): {how}, "
        "or pass another --db / MATRIX_DB"
    )


def session_factory(engine: Engine) -> sessionmaker[Session]:
    from matrix.db.textguard import install

    return install(sessionmaker(engine, expire_on_commit=False))


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One unit of work: commit if the block succeeds, roll back everything if it raises."""
    with factory() as session, session.begin():
        yield session
