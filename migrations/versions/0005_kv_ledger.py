"""attempts carry their KV-transfer ledger (transfers, bytes, seconds, GB/s from the engines' counters)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 23:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # '{}' for every earlier attempt: no ledger was kept then (not "no transfer happened").
    with op.batch_alter_table("cell_run", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kv_ledger", sa.JSON(), nullable=False, server_default=sa.text("'{}'")))


def downgrade() -> None:
    with op.batch_alter_table("cell_run", schema=None) as batch_op:
        batch_op.drop_column("kv_ledger")
