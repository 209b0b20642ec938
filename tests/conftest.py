"""Shared fixtures: an isolated data directory and database per test, and ways to run the real CLI."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from matrix.cli import cli

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data"


@dataclass
class Matrix:
    """Runs `matrix` against one test's own database."""

    home: Path
    db_path: Path

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "MATRIX_HOME": str(self.home), "MATRIX_DB": str(self.db_path)}

    def __call__(self, *args: str) -> Result:
        """In-process (fast), for commands that start no processes."""
        runner = CliRunner()
        return runner.invoke(cli, list(args), env=self.env, catch_exceptions=False)

    def subprocess(self, *args: str, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
        """A real `matrix` process, for commands that launch pairs or get signals."""
        return subprocess.run(
            [sys.executable, "-m", "matrix", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kw,  # type: ignore[arg-type]
        )

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "matrix", *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def dump(self) -> str:
        """Every row of every table, for "the database is unchanged" checks."""
        if not self.db_path.exists():
            return ""
        with sqlite3.connect(self.db_path) as conn:
            return "\n".join(conn.iterdump())

    def sql(self, query: str, *params: object) -> list[tuple[object, ...]]:
        with sqlite3.connect(self.db_path) as conn:
            return conn.execute(query, params).fetchall()


@pytest.fixture
def matrix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Matrix]:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("MATRIX_HOME", str(home))
    monkeypatch.setenv("MATRIX_DB", str(home / "matrix.db"))
    yield Matrix(home=home, db_path=home / "matrix.db")


@pytest.fixture
def seeded(matrix: Matrix) -> Matrix:
    result = matrix("catalog", "sync")
    assert result.exit_code == 0, result.output
    return matrix
