"""What the CLI does before and after a command's own work (M17: fast where users wait), checked by what
happens rather than by the clock: which modules a command imports, how the catalog is read, whether the
database is closed at the end, when the cyclic GC runs. The times themselves are measured by
`tests/bench/bench_cli_startup.py`.
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.campaign import expected_durations
from matrix.catalog.queries import case_info, load_catalog_view, runtime_info
from matrix.cli.app import App, pause_gc, resume_gc
from matrix.db.engine import create_db_engine
from matrix.db.models import Case, Runtime
from tests.helpers.campaigns import add_campaign
from tests.helpers.cli import Matrix

IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", re.MULTILINE)


def test_one_cell_run_imports_no_rich_and_no_venv_machinery(seeded: Matrix) -> None:
    """`matrix run -q` of a builtin runtime draws nothing and builds nothing: Rich (which httpx's own command
    line would pull in, with Pygments) and the venv provider with its recipe parser are not imported."""
    env = {**seeded.env, "PYTHONPROFILEIMPORTTIME": "1"}
    argv = ["run", "--backend", "reference", "--case", "reference_disaggregated", "--no-report", "-q"]
    done = subprocess.run([sys.executable, "-m", "matrix", *argv], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "1 passed" in done.stdout
    imported = set(IMPORTED.findall(done.stderr))
    assert "matrix.runner" in imported and "httpx" in imported  # the report lists what a run does import
    unwanted = {"rich", "pygments", "matrix.launch.providers.venv", "matrix.launch.providers.recipe"}
    assert not imported & unwanted, sorted(imported & unwanted)


def test_plan_reads_the_catalog_without_configuring_the_orm(seeded: Matrix) -> None:
    """Planning reads rows with Core: the ORM's mappers (every table's) are never configured on its path."""
    code = (
        "from matrix.db.engine import create_db_engine, session_factory\n"
        "from matrix.db.models import Case\n"
        "from matrix.catalog.queries import plan_from_db\n"
        "from matrix.plan import Selection\n"
        f"factory = session_factory(create_db_engine({seeded.url!r}))\n"
        "with factory() as session:\n"
        "    plan = plan_from_db(session, Selection(cases=('reference_disaggregated',)))\n"
        "print(len(plan.cells), Case.__mapper__.configured)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "False"]


@pytest.mark.all_databases
def test_catalog_view_is_what_the_orm_reads(seeded: Matrix) -> None:
    """The Core reading gives the same cases (markers in order, required fixes) and runtimes (components) as
    the ORM objects do, and leaves out retired rows the same way."""
    seeded.sql('UPDATE "case" SET retired = ? WHERE name = ?', True, "reference_disaggregated")
    seeded.sql("UPDATE runtime SET retired = ? WHERE version = ?", True, "0.1.0")
    engine = create_db_engine(seeded.url)
    try:
        with Session(engine) as session:
            cases, runtimes, markers, backends = load_catalog_view(session)
            orm_cases = session.scalars(select(Case).where(Case.retired.is_(False)).order_by(Case.name)).all()
            orm_runtimes = session.scalars(select(Runtime).where(Runtime.retired.is_(False)).order_by(Runtime.id))
            assert cases == [case_info(case) for case in orm_cases]
            assert runtimes == [runtime_info(runtime) for runtime in orm_runtimes]
    finally:
        engine.dispose()
    assert "reference_disaggregated" not in {case.name for case in cases}
    assert all(runtime.version != "0.1.0" for runtime in runtimes)
    assert any(case.required_fixes for case in cases) and any(runtime.components for runtime in runtimes)
    assert any(len(case.marker_texts) > 3 for case in cases)
    assert "pre_merge" in markers and "reference" in backends


def test_a_command_closes_the_database_when_it_ends(seeded: Matrix) -> None:
    """The connections are closed with the command, not whenever the GC reaches the engine: SQLite then
    checkpoints its write-ahead log and removes it. In-process, with the GC off, nothing else closes them."""
    wal = seeded.db_path.with_name(seeded.db_path.name + "-wal")
    enabled = gc.isenabled()
    gc.disable()
    try:
        result = seeded("plan", "--case", "reference_disaggregated")
        assert result.exit_code == 0, result.output
        assert not wal.exists()
    finally:
        if enabled:
            gc.enable()


def test_the_matrix_process_leaves_no_open_database_at_exit(seeded: Matrix) -> None:
    """`matrix` leaves what is left at exit to the OS (the GC does not walk it): the database must have been
    closed before that, or its write-ahead log would stay behind after every command."""
    wal = seeded.db_path.with_name(seeded.db_path.name + "-wal")
    done = seeded.subprocess("plan", "--case", "reference_disaggregated", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "1 cells" in done.stdout
    assert not wal.exists()


def test_gc_is_paused_for_the_start_up_until_the_database_is_open(seeded: Matrix) -> None:
    enabled = gc.isenabled()
    try:
        gc.enable()
        pause_gc()
        assert not gc.isenabled()
        app = App(str(seeded.db_path))
        app.engine()
        assert gc.isenabled()  # a long command collects its garbage as usual
        app.close()
        gc.disable()  # paused by someone else: not ours to turn back on
        pause_gc()
        resume_gc()
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        (gc.enable if enabled else gc.disable)()


def test_a_run_reads_the_history_of_its_own_cases_only(seeded: Matrix) -> None:
    """The expected durations a run schedules by come from its cases' attempts, not from every case's."""
    add_campaign(seeded, [("reference_disaggregated", 1, "passed"), ("reference_equivalence", 1, "passed")])
    seeded.sql("UPDATE cell_run SET total_s = id * 10")
    ids = dict(seeded.sql('SELECT name, id FROM "case" WHERE name IN (?, ?)', "reference_disaggregated",
                          "reference_equivalence"))  # fmt: skip
    engine = create_db_engine(seeded.url)
    try:
        with Session(engine) as session:
            everything = expected_durations(session)
            own = expected_durations(session, {ids["reference_disaggregated"]})
    finally:
        engine.dispose()
    assert set(everything) == set(ids.values())
    assert own == {ids["reference_disaggregated"]: everything[ids["reference_disaggregated"]]}
