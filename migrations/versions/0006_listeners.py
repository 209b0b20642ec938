"""attempts record every socket their processes listened on (role, protocol, address, port)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 21:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # '[]' for every earlier attempt: nothing was recorded then (not "listened on nothing").
    with op.batch_alter_table("cell_run", schema=None) as batch_op:
        batch_op.add_column(sa.Column("listeners", sa.JSON(), nullable=False, server_default=sa.text("'[]'")))


def downgrade() -> None:
    with op.batch_alter_table("cell_run", schema=None) as batch_op:
        batch_op.drop_column("listeners")
