"""Skew cells through the CI fan-out, on real reference pairs: `plan --skew --format github-matrix` -> shards
that run `matrix run --cell IDS --results-out` (no --skew) in fresh databases -> `matrix import` centrally ->
`matrix skew`, the exports and `--resume`, each role's runtime carried all the way.

Two builtin reference runtimes make the grid cheap and asymmetric: 0.2.0's environment plants
`kv-transfer-dropped`, a fault only the prefill worker acts on. So a pair fails exactly when its prefill runs
0.2.0: prefill=0.2.0/decode=0.1.0 fails, prefill=0.1.0/decode=0.2.0 works. A carrier that dropped the roles
(importing a pair as the diagonal cell of decode's runtime) or ran a role in the wrong environment would show
another grid.
"""

from __future__ import annotations

import csv
import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from matrix.cells import cell_id
from matrix.report.junit import SKEW_FINDINGS
from tests.helpers.cli import Matrix
from tests.helpers.skew import SKEW_CASE, skew_catalog, skew_classes

KEY = "github:org/repo/2020"
BROKEN = ("0.2.0", "0.1.0")  # (prefill, decode)
HEALTHY = ("0.1.0", "0.2.0")


def _home(root: Path, name: str) -> Matrix:
    home = root / name
    home.mkdir(parents=True)
    return Matrix(home=home, db_path=home / "matrix.db")


def _rows(m: Matrix) -> dict[tuple[str, str], tuple[Any, ...]]:
    """(decode's runtime, roles key) -> (uid, status, roles) of every attempt."""
    rows = m.sql("SELECT runtime.version, roles_key, uid, status, roles FROM cell_run "
                 "JOIN runtime ON runtime_id = runtime.id ORDER BY uid")  # fmt: skip
    out: dict[tuple[str, str], tuple[Any, ...]] = {}
    for version, key, uid, status, roles in rows:
        assert (version, key) not in out, f"{version} {key} has more than one attempt"
        out[(version, key)] = (uid, status, json.loads(str(roles)))
    return out


class Grid:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.catalog = skew_catalog(root / "catalog")
        planner = _home(root, "planner")
        assert planner.subprocess("catalog", "sync", *self.catalog).returncode == 0
        plan = planner.subprocess("plan", "--case", SKEW_CASE, "--skew", "--format", "github-matrix", "--max-jobs", "2")
        assert plan.returncode == 0, plan.stderr
        self.matrix = json.loads(plan.stdout)
        listed = json.loads(planner.subprocess("plan", "--case", SKEW_CASE, "--skew", "--json").stdout)["cells"]
        self.planned = {c["id"]: c["cell"] for c in listed}
        self.files: list[Path] = []
        self.runners: list[Matrix] = []
        self.runner_rows: dict[tuple[str, str], tuple[Any, ...]] = {}
        self.runner_classes: dict[tuple[str, str], str] = {}
        for entry in self.matrix["include"]:
            self.files.append(self.run_shard(entry, f"runner-{entry['shard']}"))
        self.central = _home(root, "central")
        assert self.central.subprocess("catalog", "sync", *self.catalog).returncode == 0
        self.first_import = self.central.subprocess("import", *map(str, self.files))

    def run_shard(self, entry: dict[str, Any], name: str) -> Path:
        runner = _home(self.root, name)
        assert runner.subprocess("catalog", "sync", *self.catalog).returncode == 0
        out = self.root / "artifacts" / f"{name}.json"
        result = runner.subprocess(
            "run", "--cell", entry["cells"], "--results-out", str(out), "--campaign-key", KEY, "--no-report", "-q",
            timeout=240,
        )  # fmt: skip
        assert result.returncode in (0, 1), result.stdout + result.stderr
        assert out.is_file(), result.stdout + result.stderr
        self.runners.append(runner)
        self.runner_rows.update(_rows(runner))
        self.runner_classes.update(skew_classes(runner))
        return out


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> Grid:
    return Grid(tmp_path_factory.mktemp("skewfanout"))


def test_the_skew_plan_shards_every_pair_once(grid: Grid) -> None:
    ids = [i for e in grid.matrix["include"] for i in e["cells"].split(",")]
    assert sorted(ids) == sorted(grid.planned) and len(ids) == 4  # 2 x 2, the diagonal included
    assert {cell_id(key) for key in grid.planned.values()} == set(grid.planned)
    assert f"{SKEW_CASE}@reference[prefill=0.2.0,decode=0.1.0]" in grid.planned.values()


def test_each_shard_ran_its_pairs_in_each_roles_environment(grid: Grid) -> None:
    assert len(grid.runner_rows) == 4
    broken = grid.runner_rows[("0.1.0", "prefill=0.2.0,decode=0.1.0")]
    healthy = grid.runner_rows[("0.2.0", "prefill=0.1.0,decode=0.2.0")]
    assert broken[1:] == ("failed", {"prefill": "0.2.0", "decode": "0.1.0"})
    assert healthy[1:] == ("passed", {"prefill": "0.1.0", "decode": "0.2.0"})
    assert grid.runner_rows[("0.1.0", "")][1] == "passed" and grid.runner_rows[("0.2.0", "")][1] == "failed"
    assert grid.runner_classes[HEALTHY] == "works" and grid.runner_classes[BROKEN] != "works"


def test_results_files_say_each_roles_version(grid: Grid) -> None:
    documents = [json.loads(path.read_text()) for path in grid.files]
    entries = [cell for doc in documents for cell in doc["cells"]]
    assert sorted(json.dumps(e["roles"], sort_keys=True) for e in entries) == sorted(
        ["{}", "{}", '{"decode": "0.1.0", "prefill": "0.2.0"}', '{"decode": "0.2.0", "prefill": "0.1.0"}']
    )
    # A file with a skew attempt is format version 2, which an older matrix refuses instead of misreading.
    assert {doc["format_version"] for doc in documents if any(c["roles"] for c in doc["cells"])} == {2}


def test_import_keeps_every_pair_apart_with_its_outcome_and_class(grid: Grid) -> None:
    result = grid.first_import
    assert result.returncode == 0, result.stderr
    assert f"new campaign 1 (key {KEY}): 4 attempts imported, 0 already present" in result.stdout
    assert _rows(grid.central) == grid.runner_rows
    assert skew_classes(grid.central) == grid.runner_classes
    (selection,) = grid.central.sql("SELECT selection FROM campaign")[0]
    assert sorted(json.loads(str(selection))["cells"]) == sorted(grid.planned.values())


def test_importing_again_changes_nothing(grid: Grid) -> None:
    before = grid.central.dump()
    again = grid.central.subprocess("import", *map(str, grid.files))
    assert again.returncode == 0, again.stderr
    assert "0 attempts imported, 4 already present" in again.stdout
    assert grid.central.dump() == before


def test_exports_carry_each_roles_version_and_class(grid: Grid) -> None:
    exported = json.loads(grid.central.subprocess("export", "json").stdout)
    (skew,) = exported["skew"]
    assert skew["case"] == SKEW_CASE
    by_pair = {(c["prefill"], c["decode"]): c for c in skew["cells"]}
    assert by_pair[HEALTHY]["class"] == "works" and by_pair[BROKEN]["class"] == grid.runner_classes[BROKEN]
    rows = list(csv.DictReader(io.StringIO(grid.central.subprocess("export", "csv").stdout)))
    pairs = {(r["prefill"], r["decode"]): r for r in rows if r["case"] == SKEW_CASE}
    assert pairs[BROKEN]["skew_class"] == grid.runner_classes[BROKEN] and pairs[BROKEN]["version"] == "0.1.0"
    assert pairs[HEALTHY]["skew_class"] == "works" and pairs[("0.1.0", "0.1.0")]["skew_class"] == ""
    junit = ET.fromstring(grid.central.subprocess("export", "junit").stdout)
    (suite,) = [s for s in junit.iter("testsuite") if s.get("name") == f"skew {SKEW_CASE}"]
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert sorted(cases) == [f"{SKEW_CASE}@reference[prefill=0.1.0,decode=0.2.0]",
                             f"{SKEW_CASE}@reference[prefill=0.2.0,decode=0.1.0]"]  # fmt: skip
    broken = cases[f"{SKEW_CASE}@reference[prefill=0.2.0,decode=0.1.0]"]
    if grid.runner_classes[BROKEN] in SKEW_FINDINGS:
        assert broken.find("failure") is not None
    assert cases[f"{SKEW_CASE}@reference[prefill=0.1.0,decode=0.2.0]"].find("failure") is None


def test_resume_of_a_shard_campaign_finds_its_skew_cells(grid: Grid) -> None:
    """The shard's campaign stored skew keys with a selection without --skew: they are planned again."""
    runner = next(r for r in grid.runners if any(k for _, k in _rows(r)))
    result = runner.subprocess("run", "--resume", "1", "--no-report", "-q", timeout=120)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    cells = len(_rows(runner))
    assert f"resuming campaign 1: 0 of {cells} cells to run" in result.stdout + result.stderr
