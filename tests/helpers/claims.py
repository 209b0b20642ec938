"""A database with the shipped catalog and campaigns of the reference cells, for the claims tests."""

from __future__ import annotations

from matrix.campaign import RunOptions, _selected_cells
from matrix.catalog.load import default_catalog_files, load_catalog
from matrix.catalog.queries import plan_from_db
from matrix.catalog.sync import sync_catalog
from matrix.cells import Cell
from matrix.db.engine import create_db_engine, session_factory, transaction
from matrix.db.migrate import ensure_schema
from matrix.plan import Selection

REFERENCE = Selection(backends=("reference",))


def reference_cells(factory) -> list[Cell]:  # type: ignore[no-untyped-def]
    with factory() as session:
        return list(plan_from_db(session, REFERENCE).cells)


def new_campaign(factory) -> int:  # type: ignore[no-untyped-def]
    with transaction(factory) as session:
        campaign_id, _ = _selected_cells(session, RunOptions(selection=REFERENCE), lambda _: None)
        return campaign_id


def catalog_factory(db_url: str):  # type: ignore[no-untyped-def]
    """A session factory on a migrated database with the shipped catalog (the body of a `factory` fixture)."""
    engine = create_db_engine(db_url)
    ensure_schema(engine)
    factory = session_factory(engine)
    with transaction(factory) as session:
        sync_catalog(session, load_catalog(default_catalog_files()))
    yield factory
    engine.dispose()
