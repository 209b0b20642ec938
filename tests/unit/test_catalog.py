"""`matrix catalog sync`, lists and hand edits, on real SQLite and PostgreSQL databases through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.catalogs import assert_refused, catalog_with
from tests.helpers.cli import DATA, Matrix

pytestmark = pytest.mark.all_databases


def test_sync_is_idempotent(matrix: Matrix) -> None:
    first = matrix("catalog", "sync")
    assert first.exit_code == 0
    assert "added  runtime  vllm 0.29.1rc0" in first.output
    second = matrix("catalog", "sync")
    assert second.exit_code == 0
    assert second.output.strip() == "0 changes"


def test_sync_reports_changes_and_retires_without_deleting(seeded: Matrix, tmp_path: Path) -> None:
    cases = (DATA / "cases.toml").read_text()
    edited = cases.replace("startup_timeout_s = 30\n", "startup_timeout_s = 31\n", 1)
    # Drop the mocker case entirely.
    edited = edited[: edited.index('[[case]]\nname = "dynamo_mocker_disaggregated"')]
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    for path in DATA.glob("*.toml"):
        (catalog / path.name).write_text(edited if path.name == "cases.toml" else path.read_text())
    result = seeded("catalog", "sync", *sorted(map(str, catalog.glob("*.toml"))))
    assert result.exit_code == 0, result.output
    assert "changed  case     reference_disaggregated (startup_timeout_s" in result.output
    assert "retired  case     dynamo_mocker_disaggregated" in result.output
    assert seeded.sql("SELECT retired FROM \"case\" WHERE name = 'dynamo_mocker_disaggregated'") == [(1,)]
    listed = json.loads(seeded("cases", "list", "--json").output)
    assert "dynamo_mocker_disaggregated" not in {c["name"] for c in listed}
    # Syncing the seed again restores it.
    restored = seeded("catalog", "sync")
    assert "restored  case     dynamo_mocker_disaggregated" in restored.output.replace("   restored", "restored")


def test_lists_as_table_and_json(seeded: Matrix) -> None:
    runtimes = json.loads(seeded("runtimes", "list", "--json").output)
    vllm = [r["version"] for r in runtimes if r["backend"] == "vllm"]
    # PEP 440 order
    assert vllm == ["0.26.0", "0.28.0", "0.29.0", "0.29.1rc0", "0.29.1rc1.dev347+gdee37d891", "0.30.0", "0.31.0",
                    "0.32.0", "0.33.0", "0.34.0"]
    dev = next(r for r in runtimes if r["version"] == "0.29.1rc1.dev347+gdee37d891")
    assert "vllm=0.29.0" in dev["components"] and "vllm-rs=0.29.1rc1.dev347+gdee37d891" in dev["components"]
    for kind in ("backends", "markers", "cases", "fixes", "gates"):
        result = seeded(kind, "list")
        assert result.exit_code == 0 and result.output.strip()
    fixes = json.loads(seeded("fixes", "list", "--json").output)
    assert fixes[1]["key"] == "vllm#54814" or any(f["key"] == "vllm#54814" for f in fixes)


def test_runtime_add_disable_enable(seeded: Matrix) -> None:
    result = seeded("runtime", "add", "vllm", "v0.35.0", "--component", "vllm-rs=0.35.0", "--component", "vllm=0.35.0")
    assert result.exit_code == 0, result.output
    assert "added runtime vllm 0.35.0 (v0.35.0, release)" in result.output
    plan = json.loads(seeded("plan", "--case", "vllm_disaggregated", "--json").output)
    assert "vllm_disaggregated@vllm-0.35.0" in {c["cell"] for c in plan["cells"]}
    # A hand-added runtime survives a catalog sync.
    assert seeded("catalog", "sync").output.strip() == "0 changes"
    assert seeded("runtime", "disable", "vllm", "0.35.0").exit_code == 0
    explained = json.loads(seeded("plan", "--case", "vllm_disaggregated", "--explain", "--json").output)
    assert {
        "case": "vllm_disaggregated",
        "runtime": "vllm-0.35.0",
        "reason": "runtime is disabled",
    } in explained["excluded"]
    assert seeded("runtime", "enable", "vllm", "0.35.0").exit_code == 0


def test_marker_add(seeded: Matrix) -> None:
    assert seeded("marker", "add", "canary", "--kind", "lifecycle", "--description", "canary runs").exit_code == 0
    assert "canary" in seeded("markers", "list").output
    plan = seeded("plan", "-m", "canary")
    assert plan.exit_code == 0 and "0 cells" in plan.output


# --- bad input: message, exit code 2, database unchanged ---------------------------------------------


_TRAFFIC_CASE = (
    '[[case]]\nname = "x"\nbackend = "reference"\narm = "reference"\nmodel = "m"\nlaunch = { equivalence = true }\n'
)
BAD_TOML = {
    "malformed": ("cases.toml", '[[case]]\nname = "x\n', ["malformed TOML", "cases.toml", "line 2"]),
    "unknown backend": (
        "extra.toml",
        '[[runtime]]\nbackend = "vlm"\nversion = "1.0"\n',
        ["unknown backend 'vlm'", "known backends"],
    ),
    "unknown marker": (
        "extra.toml",
        '[[case]]\nname = "x"\nbackend = "reference"\narm = "reference"\nmodel = "m"\nmarkers = ["pre_merg"]\n',
        ["unknown marker 'pre_merg'", "did you mean 'pre_merge'"],
    ),
    "unknown fix": (
        "extra.toml",
        '[[case]]\nname = "x"\nbackend = "reference"\narm = "reference"\nmodel = "m"\nrequires_fixes = ["vllm#1"]\n',
        ["unknown fix 'vllm#1'"],
    ),
    "unknown arm": (
        "extra.toml",
        '[[case]]\nname = "x"\nbackend = "reference"\narm = "magic"\nmodel = "m"\n',
        ["unknown arm 'magic'", "known arms: dynamo, reference, sglang_native, vllm_native"],
    ),
    "invalid version": (
        "extra.toml",
        '[[runtime]]\nbackend = "vllm"\nversion = "0.30-final-final"\n',
        ["invalid version '0.30-final-final'"],
    ),
    "invalid component version": (
        "extra.toml",
        '[[runtime]]\nbackend = "vllm"\nversion = "0.40.0"\ncomponents = { vllm-rs = "latest" }\n',
        ["component 'vllm-rs'", "invalid version 'latest'"],
    ),
    "duplicate case": (
        "extra.toml",
        '[[case]]\nname = "reference_disaggregated"\nbackend = "reference"\narm = "reference"\nmodel = "m"\n',
        ["duplicate case reference_disaggregated"],
    ),
    "duplicate runtime": (
        "extra.toml",
        '[[runtime]]\nbackend = "vllm"\nversion = "v0.30.0"\n',
        ["duplicate runtime vllm 0.30.0"],
    ),
    "unknown key": (
        "extra.toml",
        '[[case]]\nname = "x"\nbackend = "reference"\narm = "reference"\nmodle = "m"\n',
        ["missing required key 'model'"],
    ),
    "misspelt key": (
        "extra.toml",
        '[[case]]\nname = "x"\nbackend = "reference"\narm = "reference"\nmodel = "m"\nmakers = []\n',
        ["unknown key(s) 'makers'"],
    ),
    "invalid gate expression": (
        "extra.toml",
        '[[gate]]\nname = "g"\nexpression = "pre_merge and"\n',
        ["invalid marker expression 'pre_merge and'", "column 14"],
    ),
    "unknown section": ("extra.toml", '[[casse]]\nname = "x"\n', ["unknown section(s) 'casse'"]),
    "bad traffic value": (
        "extra.toml",
        _TRAFFIC_CASE + "traffic = { streams = 0 }\n",
        ["extra.toml: [[case]] 'x'", "traffic.streams must be an integer from 1 to 64, got 0"],
    ),
    "bad traffic stream mode": (
        "extra.toml",
        _TRAFFIC_CASE + "traffic = { stream = 8 }\n",
        ["extra.toml: [[case]] 'x'", "traffic.stream must be one of mixed, always, never, got 8"],
    ),
    "misspelt traffic key": (
        "extra.toml",
        _TRAFFIC_CASE + "traffic = { streems = 8 }\n",
        ["extra.toml: [[case]] 'x'", "traffic: unknown key(s) 'streems'", "known keys:"],
    ),
    "traffic without equivalence": (
        "extra.toml",
        _TRAFFIC_CASE.replace("launch = { equivalence = true }\n", "") + "traffic = { streams = 4 }\n",
        ["extra.toml: [[case]] 'x'", "traffic needs launch.equivalence", "add equivalence = true"],
    ),
}


@pytest.mark.parametrize("label", sorted(BAD_TOML))
def test_bad_catalog_is_refused_and_changes_nothing(seeded: Matrix, tmp_path: Path, label: str) -> None:
    name, text, needles = BAD_TOML[label]
    assert_refused(seeded, ["catalog", "sync", *catalog_with(tmp_path, name, text)], *needles)


def test_bad_catalog_on_an_empty_database_writes_no_catalog_rows(matrix: Matrix, tmp_path: Path) -> None:
    result = matrix(
        "catalog",
        "sync",
        *catalog_with(tmp_path, "extra.toml", '[[runtime]]\nbackend = "nope"\nversion = "1"\n'),
    )
    assert result.exit_code == 2
    assert matrix.sql("SELECT count(*) FROM backend") == [(0,)]


BAD_COMMANDS = {
    "unknown backend": (["plan", "--backend", "vlm"], ["unknown backend 'vlm'", "did you mean 'vllm'"]),
    "unknown case": (["plan", "--case", "vllm_disagg"], ["unknown case 'vllm_disagg'"]),
    "unknown marker in -m": (
        ["plan", "-m", "pre_merge and gpu1"],
        ["unknown marker 'gpu1'", "did you mean 'gpu_1'"],
    ),
    "invalid expression": (
        ["plan", "-m", "pre_merge and (gpu_1"],
        ["invalid marker expression", "column 21"],
    ),
    "invalid version": (["plan", "--since", "zero.two"], ["invalid version 'zero.two'"]),
    "unknown runtime": (["plan", "--runtime", "vllm=9.9.9"], ["unknown runtime vllm=9.9.9"]),
    "runtime of unknown backend": (["runtime", "add", "vlm", "1.0"], ["unknown backend 'vlm'"]),
    "duplicate runtime": (["runtime", "add", "vllm", "v0.30.0"], ["runtime vllm 0.30.0 already exists"]),
    "bad component": (
        ["runtime", "add", "vllm", "0.40.0", "--component", "vllm-rs"],
        ["invalid --component 'vllm-rs'"],
    ),
    "invalid runtime version": (["runtime", "add", "vllm", "banana"], ["invalid version 'banana'"]),
    "duplicate marker": (["marker", "add", "gpu_1"], ["marker 'gpu_1' already exists"]),
    "disable unknown runtime": (["runtime", "disable", "vllm", "7.0"], ["unknown runtime vllm 7.0"]),
    "show unknown cell": (["show", "nope"], ["no cell 'nope'"]),
    "run unknown marker": (["run", "-m", "nightlyy"], ["unknown marker 'nightlyy'"]),
}


@pytest.mark.parametrize("label", sorted(BAD_COMMANDS))
def test_bad_command_input_is_refused_and_changes_nothing(seeded: Matrix, label: str) -> None:
    args, needles = BAD_COMMANDS[label]
    assert_refused(seeded, args, *needles)


def test_unopenable_database_url(matrix: Matrix, tmp_path: Path) -> None:
    result = matrix("--db", f"sqlite:///{tmp_path}/no/such/dir/m.db", "plan")
    assert result.exit_code == 2
    assert "cannot open database" in result.output and "does not exist" in result.output
    result = matrix("--db", "postgresql://matrix:hunter2@127.0.0.1:1/matrix", "plan")
    assert result.exit_code == 2
    assert "hunter2" not in result.output


MY_RUNTIMES = """
[[runtime]]
backend = "reference"
version = "0.5.0"
provider = { kind = "builtin" }
"""


def _active_runtimes(m: Matrix) -> set[str]:
    return {f"{b}={v}" for b, v in m.sql(
        "SELECT backend.name, runtime.version FROM runtime JOIN backend ON backend.id = backend_id "
        "WHERE NOT runtime.retired")}  # fmt: skip


@pytest.mark.all_databases
def test_sync_retires_only_rows_from_the_files_it_is_given(seeded: Matrix, tmp_path: Path) -> None:
    """[M11] item 11: a user's file and the seed catalog never retire each other's rows; --prune does."""
    seed = _active_runtimes(seeded)
    mine = tmp_path / "my-runtimes.toml"
    mine.write_text(MY_RUNTIMES)
    result = seeded("catalog", "sync", str(mine))
    assert result.exit_code == 0, result.output
    assert "retired" not in result.output and "added  runtime  reference 0.5.0" in result.output
    assert _active_runtimes(seeded) == seed | {"reference=0.5.0"}
    again = seeded("catalog", "sync")  # the seed catalog alone: the user's runtime stays
    assert again.exit_code == 0 and again.output.strip() == "0 changes", again.output
    assert _active_runtimes(seeded) == seed | {"reference=0.5.0"}
    assert seeded.sql("SELECT source_file FROM runtime WHERE version = '0.5.0'") == [("my-runtimes.toml",)]
    # The file drops its entry: that row, and only that row, is retired.
    mine.write_text("[[runtime]]\nbackend = \"reference\"\nversion = \"0.6.0\"\nprovider = { kind = \"builtin\" }\n")
    result = seeded("catalog", "sync", str(mine))
    assert "retired  runtime  reference 0.5.0" in result.output and result.output.count("retired  ") == 1
    # A full prune is explicit: every runtime the file does not list goes.
    before = seeded.dump()
    dry = seeded("catalog", "sync", "--prune", "--dry-run", str(mine))
    assert dry.exit_code == 0 and dry.output.count("retired  runtime") == len(seed)
    assert seeded.dump() == before
    assert seeded("catalog", "sync", "--prune", str(mine)).exit_code == 0
    assert _active_runtimes(seeded) == {"reference=0.6.0"}
