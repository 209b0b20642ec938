"""The real `matrix` CLI against a test's own data directory and database, and the repository's paths."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result
from sqlalchemy import create_engine, inspect, text

from matrix.cli import cli
from tests.helpers.processes import stop_gracefully

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
POSTGRES_ENV = "MATRIX_TEST_POSTGRES_URL"


def toml_value(value: Any) -> str:
    """An inline TOML value (JSON is close enough for strings, lists and tables of them)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


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


