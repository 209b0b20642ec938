"""Helpers for the report tests: a catalog with a few extra cases, and attempts written straight into the
database (unit tests need many precise outcomes fast; the end-to-end tests use real runs instead).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from click.testing import Result
from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.db.engine import create_db_engine, session_factory, transaction
from matrix.db.models import Backend, Campaign, Case, CellRun, Runtime, utcnow
from tests.helpers.cli import DATA, Matrix

# The seed's backends, markers and fixes; runtimes and cases of our own, so that the seed catalog can
# grow without changing what these tests expect.
SEED = ("backends.toml", "markers.toml", "fixes.toml")

RUNTIMES = (
    "".join(
        f'[[runtime]]\nbackend = "vllm"\nversion = "{version}"\nprovider = {{ kind = "host" }}\n'
        f'components = {{ vllm = "{vllm}", vllm-rs = "{rs}" }}\n\n'
        for version, vllm, rs in [
            ("0.28.0", "0.28.0", "0.28.0"),
            ("0.29.0", "0.29.0", "0.29.0"),
            ("0.29.1rc0", "0.29.1rc0", "0.29.1rc0"),
            ("0.29.1rc1.dev347+gdee37d891", "0.29.0", "0.29.1rc1.dev347+gdee37d891"),
            ("0.30.0", "0.30.0", "0.30.0"),
        ]
    )
    + """
[[runtime]]
backend = "reference"
version = "0.1.0"
provider = { kind = "builtin" }
components = { matrix-reference = "0.1.0" }
"""
)

EXTRA_CASES = """
[[case]]
name = "reference_disaggregated"
backend = "reference"
arm = "reference"
model = "matrix-reference-tiny"
markers = ["pre_merge", "core", "e2e", "gpu_0"]

[[case]]
name = "vllm_disaggregated"
backend = "vllm"
arm = "dynamo"
model = "Qwen/Qwen3-0.6B"
markers = ["pre_merge", "sidecar", "vllm", "e2e", "gpu_1"]
requires_fixes = ["vllm#54814"]

[[case]]
name = "vllm_agg_check"
backend = "vllm"
arm = "dynamo"
model = "Qwen/Qwen3-0.6B"
markers = ["pre_merge", "vllm", "e2e", "gpu_1"]

[[case]]
name = "vllm_long_prompt"
backend = "vllm"
arm = "dynamo"
model = "Qwen/Qwen3-0.6B"
markers = ["post_merge", "vllm", "e2e", "gpu_1"]

[[case]]
name = "vllm_new_only"
backend = "vllm"
arm = "dynamo"
model = "Qwen/Qwen3-0.6B"
markers = ["nightly", "vllm", "e2e", "gpu_1"]
version_constraint = ">=0.30.0"

[[case]]
name = "vllm_nightly_only"
backend = "vllm"
arm = "dynamo"
model = "Qwen/Qwen3-0.6B"
markers = ["nightly", "vllm", "e2e", "gpu_1"]
"""


def sync(m: Matrix, *extra: str) -> None:
    """Sync the test catalog plus any further TOML texts (gates, waivers, runtimes...)."""
    directory = m.home / "catalog"
    directory.mkdir(exist_ok=True)
    files = [str(DATA / name) for name in SEED]
    texts = [RUNTIMES, EXTRA_CASES, *extra]
    for index, text in enumerate(texts):
        path = directory / f"extra{index}.toml"
        path.write_text(text)
        files.append(str(path))
    if not any("[[gate]]" in t for t in extra):
        files.append(str(DATA / "gates.toml"))
    result = m("catalog", "sync", *files)
    assert result.exit_code == 0, result.output


@contextmanager
def db(m: Matrix) -> Iterator[Session]:
    engine = create_db_engine(f"sqlite:///{m.db_path}")
    try:
        with transaction(session_factory(engine)) as session:
            yield session
    finally:
        engine.dispose()


def campaign(session: Session, **kw: Any) -> Campaign:
    row = Campaign(status="finished", host="ci-host", git_sha="abc123def456", finished_at=utcnow(), **kw)
    session.add(row)
    session.flush()
    return row


def runtime(session: Session, spec: str) -> Runtime:
    backend, _, version = spec.partition("=")
    row = session.scalar(select(Runtime).join(Backend).where(Backend.name == backend, Runtime.version == version))
    assert row is not None, spec
    return row


def attempt(
    session: Session, camp: Campaign, case: str, spec: str, status: str, *, attempt_no: int = 1, **fields: Any
) -> CellRun:
    """One attempt row; timings default to plausible values for passed/failed rows."""
    case_row = session.scalar(select(Case).where(Case.name == case))
    assert case_row is not None, case
    defaults: dict[str, Any] = {"ready_s": 1.0, "request_s": 0.5, "total_s": 2.0} if status != "skipped" else {}
    row = CellRun(
        uid=uuid.uuid4().hex[:13], campaign=camp, case=case_row, runtime=runtime(session, spec), attempt=attempt_no,
        status=status, started_at=utcnow(), finished_at=utcnow(), **{"checks": [], **defaults, **fields},
    )  # fmt: skip
    session.add(row)
    session.flush()
    return row


def invoke(m: Matrix, *args: str) -> Result:
    return m(*args)


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")
