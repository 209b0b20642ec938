"""Bad input that used to crash with a traceback, through a real `matrix` process (stderr must be one line):
each is one line naming the fix, exit 2, database unchanged."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.helpers.cli import POSTGRES_ENV, Matrix

pytestmark = pytest.mark.e2e


@contextlib.contextmanager
def read_only(m: Matrix) -> Iterator[None]:
    """The test's database made read-only for real: SQLite's file immutable (root ignores file modes) or
    mode 0444; PostgreSQL's database in read-only transactions by default."""
    if not m.on_sqlite:
        (name,) = m.sql("SELECT current_database()")[0]
        # From the admin database: inside the read-only one even turning it off is refused.
        admin = create_engine(os.environ[POSTGRES_ENV], isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'))
            yield
            with admin.connect() as conn:
                conn.execute(text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = off'))
        finally:
            admin.dispose()
        return
    path = m.db_path
    if os.geteuid() != 0:
        path.chmod(0o444)
        try:
            yield
        finally:
            path.chmod(0o644)
        return
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode != 0:
        pytest.skip("as root a read-only SQLite file needs `chattr +i`, which this filesystem refuses")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def _one_line_error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("error: "), output
    return lines[0]


@pytest.mark.all_databases
@pytest.mark.parametrize(
    "args", [("runtime", "disable", "reference", "0.1.0"), ("run", "--backend", "reference", "--no-report")],
    ids=["runtime-disable", "run"],
)  # fmt: skip
def test_a_read_only_database_is_one_clear_error(seeded: Matrix, args: tuple[str, ...]) -> None:
    before = seeded.dump()
    with read_only(seeded):
        result = seeded.subprocess(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    line = _one_line_error(result.stderr)
    assert "is read-only" in line and "--db / MATRIX_DB" in line
    assert "Traceback" not in result.stderr
    assert seeded.dump() == before


@pytest.mark.parametrize("option", ["--logs-dir", "--report-dir"])
@pytest.mark.parametrize("kind", ["file", "under-a-file"])
def test_an_unusable_output_directory_stops_run_before_a_campaign(
    seeded: Matrix, tmp_path: Path, option: str, kind: str
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    target = blocker if kind == "file" else blocker / "sub"
    before = seeded.dump()
    result = seeded.subprocess("run", "--backend", "reference", option, str(target))
    assert result.returncode == 2, result.stdout + result.stderr
    line = _one_line_error(result.stderr)
    assert line.startswith(f"error: {option} {target} ")
    assert seeded.dump() == before  # no campaign, no pending rows


def test_report_out_that_cannot_be_used_is_one_clear_error(seeded: Matrix, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = seeded.subprocess("report", "--out", str(blocker / "sub"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert _one_line_error(result.stderr).startswith(f"error: --out {blocker / 'sub'} cannot be used")


@pytest.mark.all_databases
def test_downgrade_to_an_unknown_revision_names_the_known_ones(seeded: Matrix) -> None:
    before = seeded.dump()
    result = seeded.subprocess("db", "downgrade", "nosuchrev")
    assert result.returncode == 2, result.stdout + result.stderr
    line = _one_line_error(result.stderr)
    assert "cannot downgrade to 'nosuchrev'" in line and "Give one of: base, 0" in line and "0002, 0001" in line
    assert seeded.dump() == before


HUGE = "1" * 5000  # over Python's int-string limit (4300 digits)


@pytest.mark.parametrize(
    "expression", [f"foo(x={HUGE})", f"gpu_0 and requested_vllm_kv_cache_bytes(x=-{HUGE})", f"foo(n=1, x={HUGE})"]
)
def test_a_marker_integer_over_pythons_digit_limit_is_one_clear_error_in_plan(seeded: Matrix, expression: str) -> None:
    # [M21] item 10: int() raised ValueError, and `plan -m` printed a traceback.
    before = seeded.dump()
    result = seeded.subprocess("plan", "-m", expression)
    assert result.returncode == 2, result.stderr
    line = _one_line_error(result.stdout + result.stderr)
    assert "5000 digits" in line and "write a shorter number" in line and len(line) < 500, line
    assert seeded.dump() == before


def test_a_marker_integer_over_pythons_digit_limit_is_one_clear_error_in_catalog_sync(
    seeded: Matrix, tmp_path: Path
) -> None:
    before = seeded.dump()
    catalog = tmp_path / "huge.toml"
    catalog.write_text(
        f'[[case]]\nname = "huge"\nbackend = "reference"\narm = "reference"\nmodel = "matrix-reference-tiny"\n'
        f'markers = ["pre_merge", "gpu_0", "requested_vllm_kv_cache_bytes({HUGE})"]\n',
        encoding="utf-8",
    )
    result = seeded.subprocess("catalog", "sync", str(catalog))
    assert result.returncode == 2, result.stderr
    line = _one_line_error(result.stdout + result.stderr)
    assert "5000 digits" in line and "huge.toml" in line and len(line) < 500, line
    assert seeded.dump() == before


def test_a_bad_grid_start_slots_value_stops_run_before_a_campaign(
    seeded: Matrix, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = seeded.dump()
    monkeypatch.setenv("MATRIX_GRID_START_SLOTS", "two")
    result = seeded.subprocess("run", "--backend", "reference")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "MATRIX_GRID_START_SLOTS='two' is not a whole number" in _one_line_error(result.stderr)
    assert seeded.dump() == before  # no campaign, no pending rows
