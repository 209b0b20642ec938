"""The schema check in a fresh interpreter: a current database is settled without importing Alembic."""

from __future__ import annotations

import subprocess
import sys

import pytest

from matrix.db.engine import create_db_engine
from matrix.db.migrate import (
    ensure_schema,
)

pytestmark = pytest.mark.e2e


@pytest.mark.all_databases
def test_a_current_database_is_checked_without_importing_alembic(db_url: str) -> None:
    ensure_schema(create_db_engine(db_url))  # created and upgraded: Alembic needed here
    code = (
        "import sys\n"
        "from matrix.db.engine import create_db_engine\n"
        "from matrix.db.migrate import ensure_schema\n"
        f"ensure_schema(create_db_engine({db_url!r}))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
