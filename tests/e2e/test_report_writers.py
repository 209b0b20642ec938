"""Two runners of one campaign refresh one report at once (`matrix run --resume` beside a running `matrix run`;
CI failed on it: one runner moved the other's staged page away, `FileNotFoundError` in `os.replace`). Each writer
stages its pages and the refresh state under names of its own, so neither loses a page to the other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.reports import attempt, campaign, db, sync

pytestmark = pytest.mark.e2e

WRITER = """
import sys
from pathlib import Path

from matrix.db.engine import create_db_engine, session_factory
from matrix.report import write_report

engine = create_db_engine(sys.argv[1])
for _ in range(4):
    with session_factory(engine)() as session:
        write_report(session, Path(sys.argv[2]))
"""


def test_three_writers_of_one_report_at_once_all_succeed(matrix: Matrix, tmp_path: Path) -> None:
    sync(matrix)
    with db(matrix) as s:
        first = campaign(s)
        attempt(s, first, "vllm_agg_check", "vllm=0.29.0", "passed")
        attempt(s, first, "vllm_disaggregated", "vllm=0.29.0", "failed", failure_kind="validation")
        attempt(s, campaign(s), "reference_disaggregated", "reference=0.1.0", "passed")
    out = tmp_path / "report"
    argv = [sys.executable, "-c", WRITER, f"sqlite:///{matrix.db_path}", str(out)]
    writers = [subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    errors = [w.communicate(timeout=120)[1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0, 0], errors
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert "</html>" in (out / "index.html").read_text() and (out / "runtime-vllm-0.29.0.html").is_file()
