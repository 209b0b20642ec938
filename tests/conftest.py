"""Shared fixtures: an isolated data directory and database per test, and ways to run the real CLI.

Tests marked `all_databases` run once on SQLite and once on PostgreSQL. The PostgreSQL variant needs
`MATRIX_TEST_POSTGRES_URL` (a database URL whose user may create databases; `.ci/postgres start` prints
one) and gets a fresh database of its own, dropped afterwards; without the variable it is skipped.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from matrix.cli import cli

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data"
POSTGRES_ENV = "MATRIX_TEST_POSTGRES_URL"
DATABASES = ("sqlite", "postgresql")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "all_databases: run the test on SQLite and on PostgreSQL")
    config.addinivalue_line("markers", "fresh_database: the `matrix` fixture leaves the SQLite file uncreated")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "database" in metafunc.fixturenames and metafunc.definition.get_closest_marker("all_databases"):
        metafunc.parametrize("database", DATABASES, indirect=True)


@pytest.fixture
def database(request: pytest.FixtureRequest) -> str:
    """Which database the test's `db_url` is on: SQLite unless the test is marked `all_databases`."""
    return str(getattr(request, "param", "sqlite"))


@pytest.fixture
def db_url(database: str, tmp_path: Path) -> Iterator[str]:
    """A URL to an empty database of the test's own."""
    if database == "sqlite":
        yield f"sqlite:///{tmp_path / 'test.db'}"
        return
    admin = os.environ.get(POSTGRES_ENV)
    if not admin:
        pytest.skip(f"{POSTGRES_ENV} is not set (`.ci/postgres start DIR` prints one)")
    name = f"matrix_test_{uuid.uuid4().hex[:12]}"
    engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
        with engine.connect() as conn:
            # FORCE: a runner a failed test left behind must not keep the database alive.
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        engine.dispose()


@dataclass
class Matrix:
    """Runs `matrix` against one test's own database (a SQLite file unless `db_url` says otherwise)."""

    home: Path
    db_path: Path
    db_url: str | None = None

    @property
    def url(self) -> str:
        return self.db_url or f"sqlite:///{self.db_path}"

    @property
    def on_sqlite(self) -> bool:
        return self.db_url is None or self.db_url.startswith("sqlite")

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "MATRIX_HOME": str(self.home), "MATRIX_DB": self.db_url or str(self.db_path)}

    def __call__(self, *args: str) -> Result:
        """In-process (fast), for commands that start no processes."""
        runner = CliRunner()
        return runner.invoke(cli, list(args), env=self.env, catch_exceptions=False)

    def subprocess(self, *args: str, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
        """A real `matrix` process, for commands that launch pairs or get signals.

        When the test is stopped while it waits (its own timeout, pytest-timeout, Ctrl-C) `matrix` gets
        SIGTERM first, so it tears down its pairs and provisioning like a user's Ctrl-C would, instead of a
        SIGKILL that would leave them running on loopback.
        """
        argv = [sys.executable, "-m", "matrix", *args]
        with subprocess.Popen(
            argv,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **kw,  # type: ignore[call-overload]
        ) as proc:
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
            except BaseException:
                stop_gracefully(proc)
                raise
        return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "matrix", *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def exists(self) -> bool:
        """Whether the database has been created (has any table)."""
        if self.on_sqlite:
            return self.db_path.exists()
        return bool(self.sql("SELECT 1 FROM information_schema.tables WHERE table_schema = 'public' LIMIT 1"))

    def dump(self) -> str:
        """Every row of every table, for "the database is unchanged" checks."""
        if self.on_sqlite:
            if not self.db_path.exists():
                return ""
            with sqlite3.connect(self.db_path) as conn:
                return "\n".join(conn.iterdump())
        engine = create_engine(self.url)
        try:
            lines = []
            with engine.connect() as conn:
                for table in sorted(inspect(conn).get_table_names()):
                    lines.append(f"TABLE {table}")
                    rows = conn.execute(text(f'SELECT * FROM "{table}"')).all()
                    lines += sorted(repr(tuple(row)) for row in rows)
            return "\n".join(lines)
        finally:
            engine.dispose()

    def sql(self, query: str, *params: object) -> list[tuple[object, ...]]:
        """Run one statement with `?` placeholders on either database; the rows it returns."""
        if self.on_sqlite:
            with sqlite3.connect(self.db_path) as conn:
                return conn.execute(query, params).fetchall()
        engine = create_engine(self.url)
        try:
            with engine.begin() as conn:
                # psycopg's placeholder is %s; without parameters the query is sent as written.
                result = (
                    conn.exec_driver_sql(query.replace("?", "%s"), tuple(params))
                    if params
                    else conn.exec_driver_sql(query)
                )
                return [tuple(row) for row in result.all()] if result.returns_rows else []
        finally:
            engine.dispose()


def stop_gracefully(proc: subprocess.Popen[str], grace: float = 60) -> None:
    """SIGTERM, time to tear down, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.fixture
def matrix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, database: str, request: pytest.FixtureRequest) -> Matrix:
    """The test's own data directory and database. On SQLite the database starts migrated to head (a copy of
    a template migrated once per session) unless the test is marked `fresh_database`: running every
    migration again for each test cost a quarter of the unit suite, and the path that creates and migrates
    a new database has tests of its own (`tests/unit/test_db.py` and every `fresh_database` test)."""
    home = tmp_path / "home"
    home.mkdir()
    db_url = None if database == "sqlite" else str(request.getfixturevalue("db_url"))
    monkeypatch.setenv("MATRIX_HOME", str(home))
    monkeypatch.setenv("MATRIX_DB", db_url or str(home / "matrix.db"))
    m = Matrix(home=home, db_path=home / "matrix.db", db_url=db_url)
    if m.on_sqlite and not request.node.get_closest_marker("fresh_database"):
        _copy_sqlite(request.getfixturevalue("migrated_sqlite_template"), m.db_path)
    return m


def _copy_sqlite(source_path: Path, target_path: Path) -> None:
    # The backup API copies a consistent database (whatever its journal mode), not a file mid-write.
    with sqlite3.connect(source_path) as source, sqlite3.connect(target_path) as target:
        source.backup(target)
    source.close()
    target.close()


@pytest.fixture(scope="session")
def migrated_sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty SQLite database migrated to head by the product's own first-use path, once per session."""
    path = tmp_path_factory.mktemp("migrated") / "matrix.db"
    result = CliRunner().invoke(cli, ["--db", str(path), "db", "upgrade"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture(scope="session")
def seeded_sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database with the seed catalog synced, made once per session: `seeded` copies it, which is
    the same rows as syncing again (the seed files do not change during a run) at a fraction of the cost."""
    path = tmp_path_factory.mktemp("seeded") / "matrix.db"
    result = CliRunner().invoke(cli, ["--db", str(path), "catalog", "sync"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture
def seeded(matrix: Matrix, request: pytest.FixtureRequest) -> Matrix:
    if matrix.on_sqlite:
        _copy_sqlite(request.getfixturevalue("seeded_sqlite_template"), matrix.db_path)
        return matrix
    result = matrix("catalog", "sync")
    assert result.exit_code == 0, result.output
    return matrix


def toml_value(value: Any) -> str:
    """An inline TOML value (JSON is close enough for strings, lists and tables of them)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)
