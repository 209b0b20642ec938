"""Shared fixtures: an isolated data directory and database per test, and ways to run the real CLI.

Tests marked `all_databases` run once on SQLite and once on PostgreSQL. The PostgreSQL variant needs
`MATRIX_TEST_POSTGRES_URL` (a database URL whose user may create databases; `.ci/postgres start` prints
one) and gets a fresh database of its own, dropped afterwards; without the variable it is skipped.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from matrix.cli import cli
from tests.helpers.catalogs import TEMPLATE_CATALOG_FILES
from tests.helpers.claims import catalog_factory
from tests.helpers.cli import DATA, POSTGRES_ENV, Matrix

DATABASES = ("sqlite", "postgresql")
WORKERS_ENV = "MATRIX_TEST_WORKERS"
# Fixtures made once for several tests: their tests share a worker.
SHARED_SCOPES = ("module", "class", "package")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "all_databases: run the test on SQLite and on PostgreSQL")
    config.addinivalue_line("markers", "fresh_database: the `matrix` fixture leaves the SQLite file uncreated")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many workers `-n auto` (the default, see pyproject.toml) starts.

    The fast suite spends most of its time waiting for the servers, runners and browsers it starts, so it gets
    twice as many workers as cores, at least 4 (MATRIX_TEST_WORKERS overrides), and no more than the tests named
    one by one on the command line. The engine suite (`-m engines`) gets none: its builds of several GiB each and their
    shared store are not run side by side."""
    if os.environ.get(WORKERS_ENV):
        return int(os.environ[WORKERS_ENV])
    expression = str(config.getoption("markexpr") or "")
    if "engines" in expression and "not engines" not in expression:
        return 0
    workers = max(4, 2 * (os.cpu_count() or 1))
    # Tests named one by one (`file.py::test`): more workers than tests would only start up.
    if config.args and all("::" in arg for arg in config.args):
        workers = min(workers, len(config.args))
    return workers if workers > 1 else 0


def pytest_itemcollected(item: pytest.Item) -> None:
    """Under `--dist loadgroup` (pyproject's addopts) the workers take tests one at a time, except the tests
    of a file that use a module-, class- or package-scoped fixture: those form one group, run in one worker
    in file order, so the fixture (a report of real runs, an environment later tests reuse) is made once.
    Marked as each item is collected, before any `pytest_collection_modifyitems` (pytest-xdist reads the
    groups there, and the order of two `tryfirst` implementations is not pytest's promise)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    if any(defs[-1].scope in SHARED_SCOPES for defs in info.name2fixturedefs.values() if defs):
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.hookimpl(trylast=True)  # after pytest-xdist's worker has named each item's group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fail loudly when the groups above were lost: pytest-xdist 3.8 names a group by rewriting the item's
    `_nodeid`, which pytest 9.2 no longer reads, and a module's shared fixture then runs in two workers at once
    (two runs of one cell id kill each other's processes). pyproject pins pytest below 9.1 for that reason."""
    if not getattr(config.option, "loadgroup", False):  # not an xdist worker under --dist loadgroup
        return
    lost = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(lost)} test(s) (first: {lost[0]}): this pytest and pytest-xdist "
            "do not work together; install the versions pyproject.toml's dev extra names"
        )


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




@pytest.fixture
def catalogued(matrix: Matrix) -> Matrix:
    """The `matrix` fixture with the discovery templates' catalog files synced (the discover and wheelhouse tests)."""
    result = matrix("catalog", "sync", *(str(DATA / f"{name}.toml") for name in TEMPLATE_CATALOG_FILES))
    assert result.exit_code == 0, result.output
    return matrix


@pytest.fixture
def factory(db_url: str) -> Iterator[sessionmaker[Session]]:
    """A session factory on the test's database, migrated and with the shipped catalog (the claims tests)."""
    yield from catalog_factory(db_url)


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    """A port registry of the test's own (the allocator's JSON file, not yet written)."""
    return tmp_path / "ports.json"
