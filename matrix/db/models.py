"""SQLAlchemy 2.0 typed models: the catalog (what to test) and the execution record (what happened).

Catalog rows that have results are retired, never deleted, so old results keep their meaning.
Worker ids are unsigned 64-bit integers; they are stored as decimal strings because no portable SQL
integer type holds values above 2**63 - 1.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from matrix.cells import skew_cell_key

# A naming convention makes constraint names deterministic, which Alembic's batch mode on SQLite needs to
# drop or alter constraints in later migrations.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Backend(Base):
    __tablename__ = "backend"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    description: Mapped[str] = mapped_column(Text, default="")
    retired: Mapped[bool] = mapped_column(Boolean, default=False)
    # The name of the catalog file this row was last synced from ("" when unknown): sync retires only
    # rows that came from files of the names it is given.
    source_file: Mapped[str] = mapped_column(Text, default="", server_default="")
    # The catalog's `runtime_template` (package, channel, provider, components with `{version}`): what
    # `matrix discover` turns a new version on the index into. None: the backend declares none.
    runtime_template: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True, default=None)

    runtimes: Mapped[list[Runtime]] = relationship(back_populates="backend")


class Runtime(Base):
    __tablename__ = "runtime"
    __table_args__ = (UniqueConstraint("backend_id", "version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    backend_id: Mapped[int] = mapped_column(ForeignKey("backend.id"), index=True)
    version: Mapped[str] = mapped_column(String(64))
    tag: Mapped[str] = mapped_column(String(64))
    channel: Mapped[str] = mapped_column(String(32), default="release")
    provider: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    retired: Mapped[bool] = mapped_column(Boolean, default=False)
    # The name of the catalog file this row was last synced from ("" when unknown): sync retires only
    # rows that came from files of the names it is given.
    source_file: Mapped[str] = mapped_column(Text, default="", server_default="")
    notes: Mapped[str] = mapped_column(Text, default="")
    # "catalog" rows are owned by `matrix catalog sync`; "cli" rows were added by hand and "discovered" rows by
    # `matrix discover`: sync leaves both.
    source: Mapped[str] = mapped_column(String(16), default="catalog")

    backend: Mapped[Backend] = relationship(back_populates="runtimes")
    components: Mapped[list[RuntimeComponent]] = relationship(
        back_populates="runtime", cascade="all, delete-orphan", order_by="RuntimeComponent.name"
    )

    @property
    def label(self) -> str:
        return f"{self.backend.name}-{self.version}"


class RuntimeComponent(Base):
    __tablename__ = "runtime_component"
    __table_args__ = (UniqueConstraint("runtime_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    runtime_id: Mapped[int] = mapped_column(ForeignKey("runtime.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(64))

    runtime: Mapped[Runtime] = relationship(back_populates="components")


class Marker(Base):
    __tablename__ = "marker"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[str] = mapped_column(String(32), default="other")
    description: Mapped[str] = mapped_column(Text, default="")
    parametrised: Mapped[bool] = mapped_column(Boolean, default=False)
    retired: Mapped[bool] = mapped_column(Boolean, default=False)
    # The name of the catalog file this row was last synced from ("" when unknown): sync retires only
    # rows that came from files of the names it is given.
    source_file: Mapped[str] = mapped_column(Text, default="", server_default="")
    source: Mapped[str] = mapped_column(String(16), default="catalog")


class Fix(Base):
    __tablename__ = "fix"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(128), unique=True)
    component: Mapped[str] = mapped_column(String(64))
    # First version containing the fix on each release line, e.g. ["0.29.1rc0", "0.30.0"].
    fixed_in: Mapped[list[Any]] = mapped_column(JSON, default=list)
    link: Mapped[str] = mapped_column(Text, default="")
    description: Mapped[str] = mapped_column(Text, default="")
    retired: Mapped[bool] = mapped_column(Boolean, default=False)
    # The name of the catalog file this row was last synced from ("" when unknown): sync retires only
    # rows that came from files of the names it is given.
    source_file: Mapped[str] = mapped_column(Text, default="", server_default="")


class Case(Base):
    __tablename__ = "case"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    backend_id: Mapped[int] = mapped_column(ForeignKey("backend.id"), index=True)
    arm: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(256))
    description: Mapped[str] = mapped_column(Text, default="")
    # Request payload overrides: prompt, max_tokens.
    payload: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Absolute KV bound, e.g. {"bytes": 1119388000} or {"tokens": 2048}.
    kv_bound: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    startup_timeout_s: Mapped[float] = mapped_column(Float, default=300.0)
    request_timeout_s: Mapped[float] = mapped_column(Float, default=60.0)
    # Arm-specific launch options (engine, script, environment, faults...).
    launch: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Directory that relative launch scripts of this case are resolved against.
    source_dir: Mapped[str] = mapped_column(Text, default="")
    version_constraint: Mapped[str] = mapped_column(String(128), default="")
    weights_gib: Mapped[float] = mapped_column(Float, default=0.0)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    retired: Mapped[bool] = mapped_column(Boolean, default=False)
    # The name of the catalog file this row was last synced from ("" when unknown): sync retires only
    # rows that came from files of the names it is given.
    source_file: Mapped[str] = mapped_column(Text, default="", server_default="")

    backend: Mapped[Backend] = relationship()
    markers: Mapped[list[CaseMarker]] = relationship(
        back_populates="case", cascade="all, delete-orphan", order_by="CaseMarker.id"
    )
    fixes: Mapped[list[CaseFix]] = relationship(back_populates="case", cascade="all, delete-orphan")


class CaseMarker(Base):
    __tablename__ = "case_marker"
    __table_args__ = (UniqueConstraint("case_id", "marker_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    case_id: Mapped[int] = mapped_column(ForeignKey("case.id", ondelete="CASCADE"), index=True)
    marker_id: Mapped[int] = mapped_column(ForeignKey("marker.id"), index=True)
    # The marker as written in the catalog, e.g. "requested_vllm_kv_cache_bytes(1119388000)".
    text: Mapped[str] = mapped_column(String(256))

    case: Mapped[Case] = relationship(back_populates="markers")
    marker: Mapped[Marker] = relationship()


class CaseFix(Base):
    __tablename__ = "case_fix"
    __table_args__ = (UniqueConstraint("case_id", "fix_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    case_id: Mapped[int] = mapped_column(ForeignKey("case.id", ondelete="CASCADE"), index=True)
    fix_id: Mapped[int] = mapped_column(ForeignKey("fix.id"), index=True)

    case: Mapped[Case] = relationship(back_populates="fixes")
    fix: Mapped[Fix] = relationship()


class GatePolicy(Base):
    __tablename__ = "gate_policy"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    expression: Mapped[str] = mapped_column(Text)
    description: Mapped[str] = mapped_column(Text, default="")
    # e.g. {"flaky_blocks": false, "regressions_block": true}
    rules: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    retired: Mapped[bool] = mapped_column(Boolean, default=False)
    # The name of the catalog file this row was last synced from ("" when unknown): sync retires only
    # rows that came from files of the names it is given.
    source_file: Mapped[str] = mapped_column(Text, default="", server_default="")


class Waiver(Base):
    __tablename__ = "waiver"

    id: Mapped[int] = mapped_column(primary_key=True)
    case_id: Mapped[int] = mapped_column(ForeignKey("case.id"), index=True)
    # A PEP 440 specifier on the case's backend version, e.g. "==0.29.0" or "<0.30".
    runtime_spec: Mapped[str] = mapped_column(String(128), default="")
    reason: Mapped[str] = mapped_column(Text)
    link: Mapped[str] = mapped_column(Text, default="")
    expires: Mapped[dt.date | None] = mapped_column(Date, nullable=True)
    retired: Mapped[bool] = mapped_column(Boolean, default=False)
    # The name of the catalog file this row was last synced from ("" when unknown): sync retires only
    # rows that came from files of the names it is given.
    source_file: Mapped[str] = mapped_column(Text, default="", server_default="")
    # Who answers for the waived failure ("" when the catalog names nobody).
    owner: Mapped[str] = mapped_column(Text, default="", server_default="")

    case: Mapped[Case] = relationship()


class Quarantine(Base):
    """A muted cell (`matrix.quarantine`): its attempts still run and are recorded, its failures do not block a
    gate. Rows are never deleted: an exit fills the exit columns, so every entry and exit stays on record."""

    __tablename__ = "quarantine"

    id: Mapped[int] = mapped_column(primary_key=True)
    case_id: Mapped[int] = mapped_column(ForeignKey("case.id"), index=True)
    # None: every runtime of the case (a manual quarantine without --runtime).
    runtime_id: Mapped[int | None] = mapped_column(ForeignKey("runtime.id"), nullable=True)
    # The role tuple of a skew pair ("": the cell whose roles all run the runtime).
    roles_key: Mapped[str] = mapped_column(String(128), default="", server_default="")
    owner: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text)
    # Muted through this day (UTC); None: until it exits otherwise (an automatic entry's clean runs).
    until: Mapped[dt.date | None] = mapped_column(Date, nullable=True)
    # manual | automatic
    entry: Mapped[str] = mapped_column(String(16))
    # Automatic entry: the uids of the pass and the failure of the same tuple that showed the flake.
    evidence: Mapped[list[Any]] = mapped_column(JSON, default=list)
    # Automatic entry: consecutive passes after entry that end the quarantine; None: none do (manual).
    clean_runs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    entered_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    exited_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # manual | expired | clean-runs (None while muted)
    exit: Mapped[str | None] = mapped_column(String(16), nullable=True)
    exit_reason: Mapped[str] = mapped_column(Text, default="")
    # The clean runs' uids (exit by clean runs).
    exit_evidence: Mapped[list[Any]] = mapped_column(JSON, default=list)

    case: Mapped[Case] = relationship()
    runtime: Mapped[Runtime | None] = relationship()


class Campaign(Base):
    __tablename__ = "campaign"

    id: Mapped[int] = mapped_column(primary_key=True)
    started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # running | finished | interrupted
    status: Mapped[str] = mapped_column(String(32), default="running")
    selection: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    host: Mapped[str] = mapped_column(String(256), default="")
    executor: Mapped[str] = mapped_column(String(32), default="local")
    git_sha: Mapped[str] = mapped_column(String(64), default="")
    matrix_version: Mapped[str] = mapped_column(String(32), default="")
    owner_pid: Mapped[int | None] = mapped_column(Integer, nullable=True)

    cells: Mapped[list[CellRun]] = relationship(back_populates="campaign", order_by="CellRun.id")


class CellRun(Base):
    """One attempt of one case on one runtime."""

    __tablename__ = "cell_run"
    # One row per attempt: two runners racing for the same attempt of a cell cannot both insert it.
    # A cell's attempts, oldest first, are a range of `ix_cell_run_cell`: what the statistics read (its newest).
    __table_args__ = (
        UniqueConstraint("campaign_id", "case_id", "runtime_id", "roles_key", "attempt"),
        Index("ix_cell_run_cell", "case_id", "runtime_id", "id"),
        # The cases with skew attempts (`matrix.report.skew.skew_cases`): those rows alone.
        Index(
            "ix_cell_run_skew",
            "case_id",
            sqlite_where=text("roles_key != ''"),
            postgresql_where=text("roles_key != ''"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    # The MATRIX_CELL_ID every process of this attempt carries.
    uid: Mapped[str] = mapped_column(String(64), unique=True)
    campaign_id: Mapped[int] = mapped_column(ForeignKey("campaign.id"), index=True)
    case_id: Mapped[int] = mapped_column(ForeignKey("case.id"), index=True)
    runtime_id: Mapped[int] = mapped_column(ForeignKey("runtime.id"), index=True)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    # pending | running | passed | failed | error | timeout | skipped | interrupted | not-run
    status: Mapped[str] = mapped_column(String(32), default="pending", index=True)
    # config | startup | health | request | validation | teardown | infra
    failure_kind: Mapped[str | None] = mapped_column(String(32), nullable=True)
    message: Mapped[str] = mapped_column(Text, default="")
    checks: Mapped[list[Any]] = mapped_column(JSON, default=list)
    # "lacks vllm#54814" when a failure is expected because a required fix is missing.
    expected_failure: Mapped[str] = mapped_column(Text, default="")
    unexpected_pass: Mapped[bool] = mapped_column(Boolean, default=False)
    flaky: Mapped[bool] = mapped_column(Boolean, default=False)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    heartbeat_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    owner_host: Mapped[str] = mapped_column(String(256), default="")
    owner_pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    ready_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    request_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    ttft_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    teardown_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    total_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    prefill_worker_id: Mapped[str | None] = mapped_column(String(20), nullable=True)
    decode_worker_id: Mapped[str | None] = mapped_column(String(20), nullable=True)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    completion_excerpt: Mapped[str] = mapped_column(Text, default="")
    ports: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    exit_codes: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    log_dir: Mapped[str] = mapped_column(Text, default="")
    gpu: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    peaks: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    components: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # {"transfers", "bytes", "seconds", "gb_per_s", "source"}: the KV-transfer ledger (`matrix.check.ledger`).
    kv_ledger: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # [{"role", "proto", "address", "port"}]: every socket the attempt's processes listened on.
    listeners: Mapped[list[Any]] = mapped_column(JSON, default=list)
    # A version-skew cell's {role: version} (`matrix.skew`), and the same as text for the unique key
    # (`matrix.cells.roles_key`); {} and '' when every role ran `runtime`, as all attempts before them did.
    roles: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    roles_key: Mapped[str] = mapped_column(String(128), default="", server_default="")

    campaign: Mapped[Campaign] = relationship(back_populates="cells")
    case: Mapped[Case] = relationship()
    runtime: Mapped[Runtime] = relationship()

    @property
    def cell_key(self) -> str:
        return skew_cell_key(self.case.name, self.runtime.backend.name, self.runtime.version, self.roles or {})




class Notification(Base):
    """One episode event (`matrix.notify`) and its delivery to the webhook: recorded before it is posted, so a
    failed post is retried by the next run and a sent one is never posted again."""

    __tablename__ = "notification"

    id: Mapped[int] = mapped_column(primary_key=True)
    # sha256 of (case, runtime, event, attempt uid): the same event gets the same key in every run, and it is
    # the Idempotency-Key header, so a receiver can drop a post two racing runners both made.
    key: Mapped[str] = mapped_column(String(64), unique=True)
    # opened | closed
    event: Mapped[str] = mapped_column(String(16))
    # The attempt that opened or closed the episode.
    attempt_uid: Mapped[str] = mapped_column(String(64))
    # The JSON body as built when the event was recorded (redacted): a retry posts the same body.
    payload: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # pending | sent | failed
    state: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    tries: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    sent_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
