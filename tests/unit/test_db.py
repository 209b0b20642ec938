"""Migrations, schema checks and database URLs, on real SQLite files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from alembic import command
from alembic.util.exc import CommandError

from matrix.db.engine import create_db_engine, display_url
from matrix.db.migrate import (
    alembic_config,
    current_revision,
    downgrade,
    ensure_schema,
    head_revision,
    upgrade,
)
from matrix.errors import DatabaseError


def test_new_database_is_created_and_upgraded_on_first_use(tmp_path: Path) -> None:
    engine = create_db_engine(f"sqlite:///{tmp_path / 'new.db'}")
    assert current_revision(engine) is None
    ensure_schema(engine)
    assert current_revision(engine) == head_revision(engine)


def test_sqlite_pragmas(tmp_path: Path) -> None:
    engine = create_db_engine(f"sqlite:///{tmp_path / 'p.db'}")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000


def test_alembic_check_finds_no_drift(tmp_path: Path) -> None:
    engine = create_db_engine(f"sqlite:///{tmp_path / 'drift.db'}")
    upgrade(engine)
    # Raises CommandError "New upgrade operations detected" when the models and migrations disagree.
    command.check(alembic_config(engine))


def test_downgrade_to_base_and_upgrade_again(tmp_path: Path) -> None:
    engine = create_db_engine(f"sqlite:///{tmp_path / 'round.db'}")
    upgrade(engine)
    downgrade(engine, "base")
    with engine.connect() as conn:
        tables = {r[0] for r in conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables <= {"alembic_version"}
    upgrade(engine)
    assert current_revision(engine) == head_revision(engine)


def test_out_of_date_schema_stops_commands(matrix) -> None:  # type: ignore[no-untyped-def]
    assert matrix("catalog", "sync").exit_code == 0
    with sqlite3.connect(matrix.db_path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0000'")
    result = matrix("plan")
    assert result.exit_code == 2
    assert "database schema is at 0000" in result.output
    assert "this matrix does not know" in result.output or "run `matrix db upgrade`" in result.output


def test_behind_schema_message_names_the_upgrade_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = create_db_engine(f"sqlite:///{tmp_path / 'old.db'}")
    upgrade(engine)
    current = current_revision(engine)
    # Pretend this matrix ships a newer migration than the database has.
    monkeypatch.setattr("matrix.db.migrate.head_revision", lambda _engine: "9999")
    with pytest.raises(
        DatabaseError,
        match=rf"database schema is at {current}, this matrix needs 9999: run `matrix db upgrade`",
    ):
        ensure_schema(engine)


def test_foreign_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE users (id INTEGER)")
    engine = create_db_engine(f"sqlite:///{path}")
    with pytest.raises(DatabaseError, match="not a matrix database"):
        ensure_schema(engine)


def test_unopenable_urls_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DatabaseError, match=r"directory .* does not exist"):
        create_db_engine(f"sqlite:///{tmp_path / 'missing' / 'x.db'}")
    with pytest.raises(DatabaseError, match="invalid database URL"):
        create_db_engine("not a url://")
    with pytest.raises(DatabaseError, match=r"driver is not installed|cannot open database"):
        create_db_engine("nosuchdialect://u@h/db")


def test_passwords_are_hidden() -> None:
    assert "s3cret" not in display_url("postgresql://matrix:s3cret@db.example/matrix")


def test_unknown_revision_is_an_error(tmp_path: Path) -> None:
    engine = create_db_engine(f"sqlite:///{tmp_path / 'r.db'}")
    with pytest.raises(CommandError):
        upgrade(engine, "nope")
