"""Smaller things users hit ([M12] item 6), each through the real CLI on a real database."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from matrix.output import print_table
from tests.helpers.campaigns import add_campaign
from tests.helpers.cli import DATA, Matrix


def test_runtime_add_makes_a_venv_runtime_that_provisioning_knows(seeded: Matrix) -> None:
    result = seeded("runtime", "add", "reference", "7.0", "--provider", "venv", "--pip", "six==1.16.0",
                    "--pip", "--no-deps idna==3.10", "--python", "3.11", "--component", "six=1.16.0")  # fmt: skip
    assert result.exit_code == 0, result.output
    ((provider,),) = seeded.sql("SELECT provider FROM runtime WHERE version = '7.0'")
    stored = provider if isinstance(provider, dict) else json.loads(str(provider))
    assert stored == {"kind": "venv", "steps": [["six==1.16.0"], ["--no-deps", "idna==3.10"]], "python": "3.11"}
    doctor = {r["runtime"]: r for r in json.loads(seeded("doctor", "--json").output)["runtimes"]}
    assert doctor["reference-7.0"]["status"] == "not provisioned"
    assert "matrix runtime provision --runtime reference=7.0" in json.dumps(doctor["reference-7.0"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--provider", "venv"], "a venv runtime needs its install steps: --pip"),
        (["--pip", "six"], "--pip and --python describe a venv runtime: add --provider venv"),
        (["--provider", "venv", "--pip", ""], "runtime reference 7.0"),
    ],
)
def test_runtime_add_venv_bad_input_is_exit_2(seeded: Matrix, args: list[str], message: str) -> None:
    before = seeded.dump()
    result = seeded("runtime", "add", "reference", "7.0", *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert seeded.dump() == before


def test_tables_print_brackets_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """doctor's install hints went through Rich markup, which ate `[ray]` and `[postgres]`."""
    print_table(("what", "hint"), [("ray extra", "not installed: pip install 'disagg-matrix[ray]' for --executor ray"),
                                   ("postgres extra", "pip install 'disagg-matrix[postgres]'")])  # fmt: skip
    out = capsys.readouterr().out
    assert "'disagg-matrix[ray]'" in out and "'disagg-matrix[postgres]'" in out


def test_report_writes_where_run_does_by_default(
    seeded: Matrix, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = seeded("report")
    assert result.exit_code == 0, result.output
    assert (seeded.home / "report" / "index.html").is_file()
    assert not (tmp_path / "report").exists()
    assert f"report: {seeded.home / 'report' / 'index.html'}" in result.output


def test_the_same_catalog_read_from_another_place_is_zero_changes(matrix: Matrix, tmp_path: Path) -> None:
    """An installed wheel's data, then an editable checkout's: only the cases' source_dir differs."""
    first, second = tmp_path / "wheel" / "data", tmp_path / "checkout" / "data"
    shutil.copytree(DATA, first)
    shutil.copytree(DATA, second)
    assert matrix("catalog", "sync", *map(str, sorted(first.glob("*.toml")))).exit_code == 0
    result = matrix("catalog", "sync", *map(str, sorted(second.glob("*.toml"))))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "0 changes"
    assert f"now read their launch files from {second.resolve()}" in result.output
    (source_dir,) = matrix.sql('SELECT DISTINCT source_dir FROM "case"')[0]
    assert source_dir == str(second.resolve())  # launch files resolve against the new place


def test_a_duplicate_case_names_both_files(matrix: Matrix, tmp_path: Path) -> None:
    extra = tmp_path / "mine.toml"
    extra.write_text('[[case]]\nname = "reference_disaggregated"\nbackend = "reference"\narm = "reference"\n'
                     'model = "tiny"\nmarkers = ["gpu_0"]\n')  # fmt: skip
    files = [*map(str, sorted(DATA.glob("*.toml"))), str(extra)]
    result = matrix("catalog", "sync", *files)
    assert result.exit_code == 2
    assert f"duplicate case reference_disaggregated: {extra} ([[case]] #1) defines it again after " in result.output
    assert str(DATA / "cases.toml") in result.output


def test_show_json_keeps_sub_second_timestamps_with_their_zone(seeded: Matrix) -> None:
    campaign = add_campaign(seeded, [("reference_disaggregated", 1, "passed")], status="finished")
    seeded.sql("UPDATE cell_run SET started_at = ?", "2026-01-02 03:04:05.123456")
    shown = json.loads(seeded("show", f"u{campaign}x0", "--json").output)
    assert shown["started_at"] == "2026-01-02T03:04:05.123456+00:00"
