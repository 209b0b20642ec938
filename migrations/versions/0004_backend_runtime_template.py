"""backends carry the recipe template `matrix discover` turns new index versions into runtimes with

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 21:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # NULL: the backend declares no template, so `matrix discover` cannot add runtimes to it.
    with op.batch_alter_table("backend", schema=None) as batch_op:
        batch_op.add_column(sa.Column("runtime_template", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("backend", schema=None) as batch_op:
        batch_op.drop_column("runtime_template")
