"""The version-skew grid on real engines: the Dynamo mocker of ai-dynamo 1.4.2, 1.5.1 and 1.6.1 as frontend x
prefill x decode (27 cells, about a second each once the three environments are built from PyPI).

Each process must run in its own role's environment (the log's `starting ROLE:` line names the interpreter, and
that environment's ai-dynamo is the role's version); every cell gets an outcome class; the diagonal works;
nothing is left running. What the off-diagonal pairs do is recorded, not assumed: docs/results/skew.md explains
it from the logs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.cli import Matrix
from tests.helpers.processes import assert_nothing_left

CASE = "dynamo_mocker_disaggregated"
VERSIONS = ("1.4.2", "1.5.1", "1.6.1")
pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.timeout(1500)]
_STARTING = re.compile(r"\[matrix\] starting (\w+): (\S+)")


@pytest.fixture(scope="module")
def skew_grid(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    home = tmp_path_factory.mktemp("skew")
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync").returncode == 0
    result = m.subprocess("run", "--case", CASE, "--skew", "--skew-frontend", "--no-report", timeout=1200)
    # 1 is allowed: a pair that fails is a finding, classified below; 2 and 3 are not.
    assert result.returncode in (0, 1), result.stdout[-4000:] + result.stderr[-4000:]
    return m


def _installed_dynamo(python: str) -> str:
    site = next(Path(python).parent.parent.glob("lib/python3*/site-packages"))
    (info,) = site.glob("ai_dynamo-*.dist-info")
    return info.name.removeprefix("ai_dynamo-").removesuffix(".dist-info")


def test_every_cell_is_classified_and_the_diagonal_works(skew_grid: Matrix) -> None:
    result = skew_grid("skew", CASE, "--json")
    assert result.exit_code == 0, result.output
    cells = json.loads(result.output)["cells"]
    assert len(cells) == 27
    assert {(c["frontend"], c["prefill"], c["decode"]) for c in cells} == {
        (f, p, d) for f in VERSIONS for p in VERSIONS for d in VERSIONS}  # fmt: skip
    assert all(c["class"] != "not-run" for c in cells), [c for c in cells if c["class"] == "not-run"]
    for c in cells:
        if c["frontend"] == c["prefill"] == c["decode"]:
            assert c["class"] == "works", c
    # The grid and every off-diagonal reason go to the test's output: the evidence outlives the temporary
    # data directory (an intermittent pair is explained from this, not from memory).
    print("skew grid:", json.dumps([(c["frontend"], c["prefill"], c["decode"], c["class"]) for c in cells]))
    for c in cells:
        if c["class"] != "works":
            print(f"skew {c['cell']}: {c['class']}: {c['reason']}")


def test_each_process_runs_its_own_roles_runtime(skew_grid: Matrix) -> None:
    rows = skew_grid.sql('SELECT r.roles, r.log_dir, r.uid FROM cell_run r JOIN "case" c ON c.id = r.case_id '
                    "WHERE c.name = ? AND r.roles_key != ''", CASE)  # fmt: skip
    assert len(rows) == 24
    for roles_json, log_dir, uid in rows:
        roles = roles_json if isinstance(roles_json, dict) else json.loads(str(roles_json))
        for role in ("frontend", "prefill", "decode"):
            log = (Path(str(log_dir)) / f"{role}.log").read_text(encoding="utf-8", errors="replace")
            started = _STARTING.search(log)
            assert started and started.group(1) == role, log[:400]
            assert _installed_dynamo(started.group(2)) == roles[role], (uid, role, started.group(2))
        assert_nothing_left(skew_grid, str(uid))
