"""Reference cases run through the real runner in-process: a catalog text synced into a database of the test's
own, each case planned and run as one cell whose outcome the test reads (the traffic, topology and peer-loss
modules)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SEED_FILES = ("backends.toml", "markers.toml", "fixes.toml", "runtimes.toml")
# A short teardown grace, as a `launch` table's tail, for the faults that spend all of it on purpose (a process
# that ignores SIGTERM, a child that escaped its group). Every other cell keeps the default 5 s, which costs
# nothing when the processes exit on SIGTERM: a frontend on a loaded 2-core host took 0.5 s to do so.
SHORT_GRACE = {"ignore-sigterm": ", teardown_grace_s = 0.5", "escaped-child": ", teardown_grace_s = 0.5"}


@dataclass(frozen=True)
class Ran:
    """What a test reads of one cell's outcome."""

    status: str
    checks: dict[str, str]
    message: str
    ports: tuple[int, ...]
    peaks: dict[str, object]
    log_dir: Path


def run_reference_cases(home: Path, catalog_text: str, cases: Iterable[str], prefix: str) -> dict[str, Ran]:
    """Sync `catalog_text` (with the seed's backends, markers, fixes and runtimes) into `home`, then run each
    of `cases` once as cell id `PREFIX-CASE`, logs in `home/runs/CASE`."""
    catalog = home / "catalog" / f"{prefix}.toml"
    catalog.parent.mkdir(parents=True, exist_ok=True)
    catalog.write_text(catalog_text)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MATRIX_HOME", str(home))
        from matrix.catalog.load import load_catalog
        from matrix.catalog.queries import plan_from_db
        from matrix.catalog.sync import sync_catalog
        from matrix.db.engine import create_db_engine, session_factory, transaction
        from matrix.db.migrate import ensure_schema
        from matrix.hardware.ports import PortAllocator
        from matrix.paths import port_registry_path
        from matrix.plan import Selection
        from matrix.runner import run_cell

        engine = create_db_engine(f"sqlite:///{home / f'{prefix}.db'}")
        ensure_schema(engine)
        with transaction(session_factory(engine)) as session:
            sync_catalog(session, load_catalog([catalog, *(REPO / "data" / name for name in SEED_FILES)]))
            cells = {c.case.name: c for c in plan_from_db(session, Selection(cases=tuple(cases))).cells}
        allocator = PortAllocator(port_registry_path())
        out = {}
        for name, cell in cells.items():
            log_dir = home / "runs" / name
            outcome = run_cell(cell, f"{prefix}-{name}", log_dir, allocator)
            out[name] = Ran(outcome.status, {c.name: c.message for c in outcome.checks}, outcome.message,
                            tuple(outcome.ports.values()), dict(outcome.peaks), log_dir)  # fmt: skip
        return out
