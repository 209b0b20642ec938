"""[M30] the nightly path end to end with a real Dynamo nightly: `discover --channel dev` -> `plan --new` ->
`run --new` on the mocker pair.

The index is the real package index with one project narrowed: `ai-dynamo`'s page lists only the nightly
1.6.0.dev20261023 (PyPI's own files), so what `discover` finds does not move as new nightlies appear; every
other project is the real index's page, so `discover` resolves the nightly's requirements with uv for real.
The catalog is the seed's with its newest Dynamo release (1.6.1) left out, because a nightly counts as new
only above the catalog's newest. Provisioning then builds the nightly from the real index like any release.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from matrix.discover import default_index_url
from tests.helpers.cli import DATA, Matrix
from tests.helpers.pep691 import serve_index, upstream_project
from tests.helpers.processes import assert_nothing_left

NIGHTLY = "1.6.0.dev20261023"
CASES = ("dynamo_mocker_disaggregated", "dynamo_mocker_aggregated_control")
pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.timeout(1200)]


def _catalog_without_dynamo_1_6_1(tmp_path: Path) -> list[str]:
    text = (DATA / "runtimes.toml").read_text()
    block = re.compile(r'\[\[runtime\]\]\nbackend = "dynamo"\nversion = "1\.6\.1"\n.*?\n\n', re.S)
    trimmed, count = block.subn("", text)
    assert count == 1, "the seed catalog's dynamo 1.6.1 runtime moved: update this test's trim"
    (tmp_path / "runtimes.toml").write_text(trimmed)
    others = [str(p) for p in sorted(DATA.glob("*.toml")) if p.name != "runtimes.toml"]
    return [*others, str(tmp_path / "runtimes.toml")]


@pytest.fixture(scope="module")
def nightly(tmp_path_factory: pytest.TempPathFactory) -> tuple[Matrix, dict[str, object], dict[str, object]]:
    home = tmp_path_factory.mktemp("nightly")
    m = Matrix(home=home, db_path=home / "matrix.db")
    assert m.subprocess("catalog", "sync", *_catalog_without_dynamo_1_6_1(home)).returncode == 0
    upstream = default_index_url()
    root = home / "index"
    root.mkdir()
    (root / "ai-dynamo.json").write_text(json.dumps(upstream_project(upstream, "ai-dynamo", {NIGHTLY})))
    with serve_index(root, upstream=upstream) as url:
        found = m.subprocess("discover", "dynamo", "--channel", "dev", "--index-url", url, "--json", timeout=300)
    assert found.returncode == 0, found.stdout[-3000:] + found.stderr[-3000:]
    planned = m.subprocess("plan", "--new", "--json")
    assert planned.returncode == 0, planned.stderr
    # The catalog's own releases have not run either (this database is new): the nightly alone runs here.
    selection = ["--runtime", f"dynamo={NIGHTLY}", *(a for case in CASES for a in ("--case", case))]
    ran = m.subprocess("run", "--new", *selection, "--no-report", timeout=900)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    return m, json.loads(found.stdout), json.loads(planned.stdout)


def test_discover_adds_the_nightly_as_a_dev_runtime_after_resolving_it(
    nightly: tuple[Matrix, dict[str, object], dict[str, object]],
) -> None:
    m, found, _ = nightly
    assert [(v["version"], v["action"]) for v in found["versions"]] == [(NIGHTLY, "added")]  # type: ignore[attr-defined]
    rows = m.sql("SELECT r.channel, r.source FROM runtime r JOIN backend b ON b.id = r.backend_id "
                 "WHERE b.name = 'dynamo' AND r.version = ?", NIGHTLY)  # fmt: skip
    assert [row[0] for row in rows] == ["dev"]


def test_plan_new_lists_the_nightlys_cells_and_run_new_ran_them(
    nightly: tuple[Matrix, dict[str, object], dict[str, object]],
) -> None:
    m, _, planned = nightly
    cells = {c["cell"] for c in planned["cells"]}  # type: ignore[attr-defined]
    assert {f"{case}@dynamo-{NIGHTLY}" for case in CASES} <= cells
    rows = m.sql('SELECT c.name, r.status, r.message, r.uid FROM cell_run r JOIN "case" c ON c.id = r.case_id')
    statuses = {str(name): (str(status), str(message)) for name, status, message, _ in rows}
    assert set(statuses) == set(CASES)
    # Whatever the nightly does is the result; on 2026-12-05 both cells passed as on 1.6.1 (a control passes
    # when its check fails).
    for case in CASES:
        assert statuses[case][0] == "passed", (case, statuses[case][1])
    for *_, uid in rows:
        assert_nothing_left(m, str(uid))
