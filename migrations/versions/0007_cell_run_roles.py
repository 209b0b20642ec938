"""attempts record the runtime of each role of a version-skew cell (prefill, decode, frontend)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 22:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_UQ = "uq_cell_run_campaign_id_case_id_runtime_id_attempt"
_NEW_UQ = "uq_cell_run_campaign_id_case_id_runtime_id_roles_key_attempt"


def upgrade() -> None:
    # '{}' and '' for every earlier attempt: all of its roles ran the row's runtime.
    with op.batch_alter_table("cell_run", schema=None) as batch_op:
        batch_op.add_column(sa.Column("roles", sa.JSON(), nullable=False, server_default=sa.text("'{}'")))
        batch_op.add_column(sa.Column("roles_key", sa.String(length=128), nullable=False, server_default=""))
        batch_op.drop_constraint(batch_op.f(_OLD_UQ), type_="unique")
        batch_op.create_unique_constraint(
            batch_op.f(_NEW_UQ), ["campaign_id", "case_id", "runtime_id", "roles_key", "attempt"]
        )


def downgrade() -> None:
    # Skew attempts cannot be told apart without roles_key: a downgrade drops them rather than merge cells.
    op.execute("DELETE FROM cell_run WHERE roles_key != ''")
    with op.batch_alter_table("cell_run", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f(_NEW_UQ), type_="unique")
        batch_op.create_unique_constraint(batch_op.f(_OLD_UQ), ["campaign_id", "case_id", "runtime_id", "attempt"])
        batch_op.drop_column("roles_key")
        batch_op.drop_column("roles")
