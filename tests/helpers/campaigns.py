"""Campaign rows written straight into a test's real database, for commands that read campaigns."""

from __future__ import annotations

from sqlalchemy import select

from matrix.db.engine import create_db_engine, resolve_url, session_factory, transaction
from matrix.db.models import Campaign, Case, CellRun, Runtime, utcnow
from tests.helpers.cli import Matrix


def add_campaign(m: Matrix, statuses: list[tuple[str, int, str]], key: str = "", **fields: object) -> int:
    """A campaign whose rows are (case name, attempt, status) on the reference runtime 0.1.0."""
    engine = create_db_engine(resolve_url(m.db_url or str(m.db_path)))
    try:
        with transaction(session_factory(engine)) as session:
            runtime = session.scalars(select(Runtime).where(Runtime.version == "0.1.0")).one()
            cells = sorted({name for name, _, _ in statuses})
            selection: dict[str, object] = {"cells": [f"{c}@reference-0.1.0" for c in cells]}
            if key:
                selection["campaign_key"] = key
            campaign = Campaign(selection=selection, **fields)
            session.add(campaign)
            session.flush()
            for index, (name, attempt, status) in enumerate(statuses):
                case = session.scalars(select(Case).where(Case.name == name)).one()
                finished = utcnow() if status not in ("pending", "running") else None
                session.add(CellRun(uid=f"u{campaign.id}x{index}", campaign_id=campaign.id, case_id=case.id,
                                    runtime_id=runtime.id, attempt=attempt, status=status, checks=[],
                                    started_at=finished, finished_at=finished))  # fmt: skip
            return campaign.id
    finally:
        engine.dispose()
