"""Migrations, schema checks and database URLs, on real SQLite files and (marked tests) real PostgreSQL."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from alembic import command
from alembic.util.exc import CommandError
from sqlalchemy import inspect, text

from matrix.db.engine import create_db_engine, display_url
from matrix.db.migrate import (
    alembic_config,
    current_revision,
    downgrade,
    ensure_schema,
    head_revision,
    quick_head,
    read_head,
    upgrade,
)
from matrix.errors import DatabaseError
from tests.helpers.cli import Matrix


@pytest.mark.all_databases
def test_new_database_is_created_and_upgraded_on_first_use(db_url: str) -> None:
    engine = create_db_engine(db_url)
    assert current_revision(engine) is None
    ensure_schema(engine)
    assert current_revision(engine) == head_revision(engine)


@pytest.mark.fresh_database
def test_the_first_command_creates_the_sqlite_file_and_migrates_it(matrix: Matrix) -> None:
    assert not matrix.db_path.exists()
    assert matrix("catalog", "sync").exit_code == 0
    assert matrix.sql("SELECT version_num FROM alembic_version") == [(quick_head(),)]
    assert matrix.sql("SELECT count(*) FROM backend") != [(0,)]


def test_sqlite_pragmas(tmp_path: Path) -> None:
    engine = create_db_engine(f"sqlite:///{tmp_path / 'p.db'}")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000


@pytest.mark.all_databases
def test_alembic_check_finds_no_drift(db_url: str) -> None:
    engine = create_db_engine(db_url)
    upgrade(engine)
    # Raises CommandError "New upgrade operations detected" when the models and migrations disagree.
    command.check(alembic_config(engine))


@pytest.mark.all_databases
def test_downgrade_to_base_and_upgrade_again(db_url: str) -> None:
    engine = create_db_engine(db_url)
    upgrade(engine)
    assert "cell_run" in inspect(engine).get_table_names()
    downgrade(engine, "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(engine)
    assert current_revision(engine) == head_revision(engine)


@pytest.mark.all_databases
def test_out_of_date_schema_stops_commands(matrix) -> None:  # type: ignore[no-untyped-def]
    assert matrix("catalog", "sync").exit_code == 0
    matrix.sql("UPDATE alembic_version SET version_num = '0000'")
    result = matrix("plan")
    assert result.exit_code == 2
    assert "database schema is at 0000" in result.output
    assert "this matrix does not know" in result.output or "run `matrix db upgrade`" in result.output


@pytest.mark.all_databases
def test_behind_schema_message_names_the_upgrade_command(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = create_db_engine(db_url)
    upgrade(engine)
    current = current_revision(engine)
    # Pretend this matrix ships a newer migration than the database has.
    monkeypatch.setattr("matrix.db.migrate.head_revision", lambda _engine: "9999")
    monkeypatch.setattr("matrix.db.migrate.quick_head", lambda: "9999")
    with pytest.raises(
        DatabaseError,
        match=rf"database schema is at {current}, this matrix needs 9999: run `matrix db upgrade`",
    ):
        ensure_schema(engine)


@pytest.mark.all_databases
def test_foreign_database_is_refused(db_url: str) -> None:
    engine = create_db_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE users (id INTEGER)"))
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


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_unreachable_postgres_server_is_a_clear_error_without_the_password() -> None:
    with pytest.raises(DatabaseError) as caught:
        create_db_engine(f"postgresql://matrix:s3cret@127.0.0.1:{_closed_port()}/matrix")
    message = str(caught.value)
    assert "s3cret" not in message
    assert "cannot open database postgresql://matrix:***@127.0.0.1" in message
    assert "that the server is running" in message


def test_missing_postgres_driver_names_the_extra() -> None:
    # pg8000 is a real PostgreSQL driver that matrix does not install.
    with pytest.raises(DatabaseError) as caught:
        create_db_engine(f"postgresql+pg8000://matrix:s3cret@127.0.0.1:{_closed_port()}/matrix")
    assert "s3cret" not in str(caught.value)
    assert "driver is not installed" in str(caught.value)
    assert "disagg-matrix[postgres]" in str(caught.value)


def test_invalid_url_error_does_not_echo_the_url() -> None:
    with pytest.raises(DatabaseError, match="invalid database URL") as caught:
        create_db_engine("postgresql+psycopg://matrix:s3cret@host:notaport/db")
    assert "s3cret" not in str(caught.value)


def test_cli_with_unreachable_postgres_exits_2_without_the_password(matrix) -> None:  # type: ignore[no-untyped-def]
    result = matrix("--db", f"postgresql://matrix:s3cret@127.0.0.1:{_closed_port()}/matrix", "plan")
    assert result.exit_code == 2
    assert "s3cret" not in result.output
    assert "cannot open database" in result.output


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_wrong_postgres_password_is_not_printed(db_url: str) -> None:
    from sqlalchemy.engine import make_url

    wrong = make_url(db_url).set(password="not-the-password-xyz").render_as_string(hide_password=False)
    with pytest.raises(DatabaseError) as caught:
        create_db_engine(wrong)
    assert "not-the-password-xyz" not in str(caught.value)
    assert "password authentication failed" in str(caught.value)


@pytest.mark.all_databases
def test_unknown_revision_is_an_error(db_url: str) -> None:
    engine = create_db_engine(db_url)
    with pytest.raises(CommandError):
        upgrade(engine, "nope")


# --- the schema check without Alembic ([M17] goal 1) -------------------------------------------------


def test_the_quick_head_is_alembics_head(tmp_path: Path) -> None:
    assert quick_head() == head_revision(create_db_engine(f"sqlite:///{tmp_path / 'x.db'}"))


def _migration(directory: Path, revision: str, down: str) -> None:
    directory.mkdir(exist_ok=True)
    (directory / f"{revision}_m.py").write_text(
        f'revision: str = "{revision}"\ndown_revision: str | None = {down}\n', encoding="utf-8"
    )


def test_the_quick_reading_gives_up_on_anything_but_one_plain_chain(tmp_path: Path) -> None:
    chain = tmp_path / "chain"
    _migration(chain, "a1", "None")
    _migration(chain, "b2", '"a1"')
    assert read_head(chain) == "b2"
    branched = tmp_path / "branched"
    for rev, down in (("a1", "None"), ("b2", '"a1"'), ("c3", '"a1"')):
        _migration(branched, rev, down)
    assert read_head(branched) is None  # two heads
    merged = tmp_path / "merged"
    for rev, down in (("a1", "None"), ("b2", '"a1"'), ("c3", '("a1", "b2")')):
        _migration(merged, rev, down)
    assert read_head(merged) is None  # a merge revision: Alembic's business


