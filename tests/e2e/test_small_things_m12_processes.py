"""A file that is not SQLite, named so by a real `matrix` process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import Matrix

pytestmark = pytest.mark.e2e


def test_a_file_that_is_not_sqlite_is_called_that(tmp_path: Path) -> None:
    bogus = tmp_path / "notes.db"
    bogus.write_text("these are my notes, not a database\n" * 100)
    m = Matrix(home=tmp_path, db_path=bogus)
    result = m.subprocess("runtimes", "list")
    assert result.returncode == 2
    assert f"{bogus} is not a SQLite database" in result.stderr
    assert "server" not in result.stderr
    assert bogus.read_text().startswith("these are my notes")
