"""CI fan-out round trip on real reference pairs: plan -> shards on separate runners -> import centrally.

Like a GitHub workflow: one database plans the matrix; each shard runs in its own fresh data directory
and database ("runner") as a real `matrix run --cell ... --results-out` process; a fresh central
database imports every file. Every planned cell must arrive exactly once with the outcome its runner
recorded, and importing again must leave the database byte-for-byte the same.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from matrix.cells import cell_id
from tests.helpers.cli import DATA, Matrix
from tests.helpers.fanout import assert_github_include_matrix

KEY = "github:org/repo/4242"
HEALTHY = [f"ref_copy_{i}" for i in range(1, 6)]
FAULTY = "ref_same_worker_id"  # fails validation: a shard with a failing cell still writes its file


def _catalog(directory: Path) -> list[str]:
    lines = []
    for name in [*HEALTHY, FAULTY]:
        faults = '["same-worker-id"]' if name == FAULTY else "[]"
        lines += [
            "[[case]]",
            f'name = "{name}"',
            'backend = "reference"\narm = "reference"\nmodel = "tiny"\nmarkers = ["gpu_0", "e2e", "pre_merge"]',
            f"startup_timeout_s = 20\nrequest_timeout_s = 10\nlaunch = {{ faults = {faults} }}",
            "",
        ]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cases.toml").write_text("\n".join(lines))
    files = [DATA / n for n in ("backends.toml", "markers.toml", "fixes.toml", "runtimes.toml", "gates.toml")]
    return [str(directory / "cases.toml"), *map(str, files)]


def _home(root: Path, name: str) -> Matrix:
    home = root / name
    home.mkdir(parents=True)
    return Matrix(home=home, db_path=home / "matrix.db")


def _rows(m: Matrix) -> dict[str, tuple[Any, ...]]:
    """cell key -> (uid, status, failure_kind, total_s, completion_tokens) of every attempt."""
    rows = m.sql(
        'SELECT "case".name, runtime.version, uid, status, failure_kind, total_s, completion_tokens '
        'FROM cell_run JOIN "case" ON case_id = "case".id JOIN runtime ON runtime_id = runtime.id ORDER BY uid'
    )
    out: dict[str, tuple[Any, ...]] = {}
    for case, version, *rest in rows:
        key = f"{case}@reference-{version}"
        assert key not in out, f"{key} has more than one attempt"
        out[key] = tuple(rest)
    return out


class Fanout:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.catalog = _catalog(root / "catalog")
        planner = _home(root, "planner")
        assert planner.subprocess("catalog", "sync", *self.catalog).returncode == 0
        plan = planner.subprocess("plan", "--backend", "reference", "--format", "github-matrix", "--max-jobs", "3")
        assert plan.returncode == 0, plan.stderr
        self.plan_stdout = plan.stdout
        self.matrix = json.loads(plan.stdout)
        listed = json.loads(planner("plan", "--json", "--backend", "reference").stdout)["cells"]
        self.planned = {c["id"]: c["cell"] for c in listed}
        self.files: list[Path] = []
        self.runner_rows: dict[str, tuple[Any, ...]] = {}
        self.exit_codes: list[int] = []
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
            timeout=180,
        )  # fmt: skip
        assert result.returncode in (0, 1), result.stdout + result.stderr
        self.exit_codes.append(result.returncode)
        assert out.is_file(), result.stdout + result.stderr
        self.runner_rows.update(_rows(runner))
        return out


@pytest.fixture(scope="module")
def fanout(tmp_path_factory: pytest.TempPathFactory) -> Fanout:
    return Fanout(tmp_path_factory.mktemp("fanout"))


def test_the_plan_is_a_valid_matrix_covering_every_cell_once(fanout: Fanout) -> None:
    entries = assert_github_include_matrix(fanout.matrix, max_jobs=3)
    assert len(entries) == 3  # 6 cells packed into 3 jobs
    ids = [i for e in entries for i in e["cells"].split(",")]
    assert sorted(ids) == sorted(fanout.planned) and len(ids) == 6
    assert {cell_id(key) for key in fanout.planned.values()} == set(fanout.planned)


def test_shards_ran_exactly_their_cells_and_a_failing_shard_still_wrote_its_file(fanout: Fanout) -> None:
    assert sorted(fanout.runner_rows) == sorted(fanout.planned.values())
    assert sorted(fanout.exit_codes) == [0, 0, 1]
    assert fanout.runner_rows[f"{FAULTY}@reference-0.1.0"][1:3] == ("failed", "validation")
    for case in HEALTHY:
        assert fanout.runner_rows[f"{case}@reference-0.1.0"][1] == "passed"


def test_import_merges_every_shard_into_one_campaign(fanout: Fanout) -> None:
    result = fanout.first_import
    assert result.returncode == 0, result.stderr
    assert "new campaign 1 (key github:org/repo/4242): 6 attempts imported, 0 already present" in result.stdout
    assert "3 file(s): 6 attempts imported, 0 already present" in result.stdout
    central = fanout.central
    assert central.sql("SELECT id, status, executor FROM campaign") == [(1, "finished", "import")]
    assert _rows(central) == fanout.runner_rows, "each planned cell once, with its runner's outcome"
    (selection,) = central.sql("SELECT selection FROM campaign")[0]
    stored = json.loads(str(selection))
    assert stored["campaign_key"] == KEY
    assert sorted(stored["cells"]) == sorted(fanout.planned.values())


def test_importing_again_changes_nothing(fanout: Fanout) -> None:
    before = fanout.central.dump()
    again = fanout.central.subprocess("import", *map(str, fanout.files))
    assert again.returncode == 0, again.stderr
    assert "3 file(s): 0 attempts imported, 6 already present" in again.stdout
    assert fanout.central.dump() == before


def test_show_report_gate_and_export_work_on_the_imported_campaign(fanout: Fanout) -> None:
    central = fanout.central
    show = central("show", f"{FAULTY}@reference-0.1.0")
    assert show.exit_code == 0, show.output
    assert "check failed: worker_ids_distinct" in show.output
    log_line = next(line for line in show.output.splitlines() if "log frontend:" in line)
    log = Path(log_line.split("log frontend:", 1)[1].strip())
    assert log.is_relative_to(central.home) and log.read_text().strip(), "the carried log tail is on disk here"
    report = central("report", "--out", str(central.home / "report"))
    assert report.exit_code == 0, report.output
    assert (central.home / "report" / "index.html").is_file()
    gate = central("gate", "reference", "0.1.0", "--policy", "pre_merge")
    assert gate.exit_code == 1, gate.output  # NO-GO: the imported failure counts
    assert f"{FAULTY}: failed (validation)" in gate.output and "required cells: 6 (5 passed)" in gate.output
    junit = central("export", "junit", "--campaign", "1")
    assert junit.exit_code == 0 and junit.stdout.count("<testcase") == 6


def test_history_from_the_import_drives_the_next_plan(fanout: Fanout) -> None:
    result = fanout.central("plan", "--backend", "reference", "--format", "github-matrix", "--max-jobs", "3")
    entries = json.loads(result.stdout)["include"]
    # Before any history the expected time is the timeouts (20 + 10 s per cell); now it is what the imported
    # attempts took (one attempt per case, so each case's median is its own time).
    took = {cell_id(key): row[3] for key, row in _rows(fanout.central).items()}
    assert [e["expected_s"] for e in entries] == [round(sum(took[i] for i in e["cells"].split(","))) for e in entries]
    assert 'expected_s":60' in fanout.plan_stdout


def _variant(fanout: Fanout, name: str, change: Any) -> Path:
    data = json.loads(fanout.files[0].read_text())
    change(data)
    path = fanout.root / "bad" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def _rename_case(data: dict[str, Any]) -> None:
    data["cells"][0]["case"] = "no_such_case"


def _bump_version(data: dict[str, Any]) -> None:
    data["format_version"] = 99


def _drop_status(data: dict[str, Any]) -> None:
    del data["cells"][0]["status"]


def _running(data: dict[str, Any]) -> None:
    data["cells"][0]["status"] = "running"


def _uid_path(data: dict[str, Any]) -> None:
    data["cells"][0]["uid"] = "../../../escaped"  # names the log directory on import: must not be a path


def _role_path(data: dict[str, Any]) -> None:
    data["cells"][0]["logs"] = {"../escaped": {"tail": "hostile", "bytes": 7}}


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("truncated", "not valid JSON"),
        ("unknown-case", "lacks what the shards ran: case 'no_such_case'"),
        ("format-version", "format_version 99 is not supported"),
        ("missing-field", "lacks 'status'"),
        ("unfinished", "status 'running' is not a finished status"),
        ("uid-path", "uid 1-64 letters, digits"),
        ("role-path", "is not a plain file name"),
    ],
)
def test_a_bad_file_exits_2_and_writes_nothing(fanout: Fanout, variant: str, message: str) -> None:
    if variant == "truncated":
        bad = fanout.root / "bad" / "truncated.json"
        bad.parent.mkdir(exist_ok=True)
        bad.write_text(fanout.files[0].read_text()[:500])
    else:
        change = {"unknown-case": _rename_case, "format-version": _bump_version, "missing-field": _drop_status,
                  "unfinished": _running, "uid-path": _uid_path, "role-path": _role_path}[variant]  # fmt: skip
        bad = _variant(fanout, f"{variant}.json", change)
    fresh = _home(fanout.root, f"fresh-{variant}")
    assert fresh("catalog", "sync", *fanout.catalog).exit_code == 0
    for m in (fanout.central, fresh):
        before = m.dump()
        # A good file next to the bad one is not imported either: all files are checked first.
        result = m("import", *map(str, fanout.files[1:]), str(bad))
        assert result.exit_code == 2, result.output
        assert message in result.output and str(bad) in result.output
        assert m.dump() == before
    assert not (fresh.home / "runs").exists(), "no log tail was written either"


def test_a_catalog_without_the_shards_runtime_says_to_sync(fanout: Fanout, tmp_path: Path) -> None:
    empty = _home(tmp_path, "empty")
    assert empty("catalog", "sync", str(DATA / "backends.toml")).exit_code == 0
    before = empty.dump()
    result = empty("import", str(fanout.files[0]))
    assert result.exit_code == 2
    assert "runtime reference=0.1.0" in result.output and "matrix catalog sync" in result.output
    assert empty.dump() == before


def test_a_rerun_shard_joins_the_campaign_as_the_next_attempt(fanout: Fanout) -> None:
    """A re-run of a shard (a fresh runner, same CI run) starts at attempt 1 again: it is renumbered."""
    central = _home(fanout.root, "central-rerun")
    assert central("catalog", "sync", *fanout.catalog).exit_code == 0
    assert central("import", *map(str, fanout.files)).exit_code == 0
    entry = next(e for e in fanout.matrix["include"] if cell_id(f"{FAULTY}@reference-0.1.0") in e["cells"])
    rerun = fanout.run_shard(entry, "runner-rerun")
    result = central("import", str(rerun))
    assert result.exit_code == 0, result.output
    assert "2 attempts imported (2 renumbered after attempts already there)" in result.output
    rows = central.sql(
        'SELECT "case".name, attempt FROM cell_run JOIN "case" ON case_id = "case".id WHERE campaign_id = 1 '
        'ORDER BY "case".name, attempt'
    )
    counts: dict[str, list[int]] = {}
    for name, attempt in rows:
        counts.setdefault(str(name), []).append(int(str(attempt)))
    rerun_cases = {fanout.planned[i].split("@")[0] for i in entry["cells"].split(",")}
    assert {name: a for name, a in counts.items() if name in rerun_cases} == {n: [1, 2] for n in rerun_cases}
    assert all(a == [1] for name, a in counts.items() if name not in rerun_cases)
    assert central.sql("SELECT count(*) FROM campaign") == [(1,)]


def test_an_unknown_cell_exits_2_and_leaves_the_runner_untouched(tmp_path: Path) -> None:
    runner = _home(tmp_path, "runner")
    assert runner("catalog", "sync", *_catalog(tmp_path / "catalog")).exit_code == 0
    before = runner.dump()
    out = tmp_path / "out.json"
    result = runner.subprocess("run", "--cell", f"{cell_id('ref_copy_1@reference-0.1.0')},deadbeef0000",
                               "--results-out", str(out))  # fmt: skip
    assert result.returncode == 2
    assert "deadbeef0000 is not a cell of this catalog" in result.stderr and "matrix plan --json" in result.stderr
    assert runner.dump() == before and not out.exists()


def test_a_results_file_copied_around_imports_like_the_original(fanout: Fanout, tmp_path: Path) -> None:
    central = _home(tmp_path, "copies")
    assert central("catalog", "sync", *fanout.catalog).exit_code == 0
    copy = tmp_path / "copy.json"
    shutil.copy(fanout.files[0], copy)
    result = central("import", str(fanout.files[0]), str(copy))
    assert result.exit_code == 0, result.output
    assert "2 attempts imported" in result.output
    assert central.sql("SELECT count(*) FROM cell_run") == [(2,)]


def _other_key(data: dict[str, Any]) -> None:
    data["campaign"]["key"] = "github:org/repo/9999"


def _other_message(data: dict[str, Any]) -> None:
    data["cells"][0]["message"] = "edited by hand"


def test_one_attempt_under_two_keys_or_with_two_outcomes_is_refused(fanout: Fanout) -> None:
    central = fanout.central
    before = central.dump()
    result = central("import", str(_variant(fanout, "other-key.json", _other_key)))
    assert result.exit_code == 2
    assert "is already in campaign 1 here, whose key is 'github:org/repo/4242'" in result.output
    edited = _variant(fanout, "other-message.json", _other_message)
    result = central("import", str(fanout.files[0]), str(edited))
    assert result.exit_code == 2 and "differs between" in result.output
    assert central.dump() == before


def test_results_out_in_an_unwritable_place_fails_before_running(tmp_path: Path) -> None:
    runner = _home(tmp_path, "runner")
    assert runner("catalog", "sync", *_catalog(tmp_path / "catalog")).exit_code == 0
    (tmp_path / "file").write_text("")
    before = runner.dump()
    result = runner("run", "--cell", "ref_copy_1@reference-0.1.0", "--results-out", str(tmp_path / "file" / "x.json"))
    assert result.exit_code == 2 and "--results-out" in result.output
    assert runner.dump() == before
