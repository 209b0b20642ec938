"""catalog rows record the file they were synced from

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 21:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# `matrix catalog sync FILES` retires only rows that came from files of those names. Rows synced before this revision
# have no recorded source (""): they are never retired by a sync of some other file, only by
# `matrix catalog sync --prune`, and take their file's name at their next sync.
TABLES = ("backend", "runtime", "marker", "fix", "case", "gate_policy", "waiver")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("source_file", sa.Text(), nullable=False, server_default=""))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("source_file")
