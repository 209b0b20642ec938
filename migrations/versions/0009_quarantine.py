"""quarantined cells (entries and exits with their reasons) and the owner of a waiver

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 16:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A new table and no backfill: nothing was muted before; existing waivers name no owner ("").
    op.create_table(
        "quarantine",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("case_id", sa.Integer(), nullable=False),
        sa.Column("runtime_id", sa.Integer(), nullable=True),
        sa.Column("roles_key", sa.String(length=128), server_default="", nullable=False),
        sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("until", sa.Date(), nullable=True),
        sa.Column("entry", sa.String(length=16), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("clean_runs", sa.Integer(), nullable=True),
        sa.Column("entered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("exited_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("exit", sa.String(length=16), nullable=True),
        sa.Column("exit_reason", sa.Text(), nullable=False),
        sa.Column("exit_evidence", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["case_id"], ["case.id"], name=op.f("fk_quarantine_case_id_case")),
        sa.ForeignKeyConstraint(["runtime_id"], ["runtime.id"], name=op.f("fk_quarantine_runtime_id_runtime")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_quarantine")),
    )
    with op.batch_alter_table("quarantine", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_quarantine_case_id"), ["case_id"], unique=False)
    with op.batch_alter_table("waiver", schema=None) as batch_op:
        batch_op.add_column(sa.Column("owner", sa.Text(), server_default="", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("waiver", schema=None) as batch_op:
        batch_op.drop_column("owner")
    with op.batch_alter_table("quarantine", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_quarantine_case_id"))
    op.drop_table("quarantine")
