"""[M30] item 3: quarantine, over real reference campaigns.

A cell that passed and then fails (the same case, runtime and roles, within the window) is muted by
`matrix run --auto-quarantine`, its pass and its failure kept as evidence; a cell that only ever failed is
not. The gate lists a muted cell and does not block on it, while an unmuted failure still blocks. The
quarantine ends after N consecutive passes, and the entry and the exit stay on record with their reasons.
`matrix quarantine` refuses bad input with one line, exit 2 and the database unchanged.
"""

from __future__ import annotations

import datetime as dt
import json

import pytest

from tests.helpers import toggled_cells as toggled
from tests.helpers.cli import Matrix

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# `ref_q` is the cell that turns flaky (a planted missing usage object fails its `usage_object` check);
# `ref_broken` always fails the same way: failures without a pass are no flake evidence.
GATE = """
[[gate]]
name = "q_gate"
expression = "gpu_0"
"""


def _sync(m: Matrix, *, broken: bool) -> None:
    toggled.sync(m, toggled.case("ref_q", broken=broken), toggled.case("ref_broken", broken=True), GATE)


def _run(m: Matrix, *args: str, code: int) -> list[str]:
    result = m.subprocess("run", "--no-report", "-q", *args)
    assert result.returncode == code, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if line.startswith("quarantine: ")]


def _uids(m: Matrix, case: str) -> list[tuple[str, str]]:
    return [(str(uid), str(status)) for uid, status in m.sql(
        "SELECT cell_run.uid, cell_run.status FROM cell_run JOIN \"case\" ON \"case\".id = cell_run.case_id "
        "WHERE \"case\".name = ? ORDER BY cell_run.id", case)]  # fmt: skip


def _quarantines(m: Matrix) -> list[dict[str, object]]:
    result = m("quarantines", "--all", "--json")
    assert result.exit_code == 0, result.output
    found: list[dict[str, object]] = json.loads(result.output)["quarantines"]
    return found


def _gate(m: Matrix) -> tuple[int, dict[str, object]]:
    result = m("gate", "reference", "0.1.0", "--policy", "q_gate", "--json")
    return result.exit_code, json.loads(result.output)


@pytest.mark.all_databases
def test_flake_evidence_mutes_a_cell_and_clean_runs_release_it(matrix: Matrix) -> None:
    _sync(matrix, broken=False)
    assert _run(matrix, "--case", "ref_q", "--case", "ref_broken", code=1) == []  # without the flag: no entry
    _sync(matrix, broken=True)
    lines = _run(matrix, "--case", "ref_q", "--case", "ref_broken", "--auto-quarantine", code=1)
    (passed, _), (failed, status) = _uids(matrix, "ref_q")
    assert status == "failed"
    assert lines == [f"quarantine: ref_q@reference-0.1.0 entered (automatic, owner unowned): flaky: passed in "
                     f"{passed} (campaign 1) and failed in {failed} (campaign 2) within 7 day(s)"]  # fmt: skip
    (entry,) = _quarantines(matrix)  # ref_broken never passed: its failures are no flake evidence
    assert (entry["case"], entry["runtime"], entry["entry"], entry["owner"]) == (
        "ref_q",
        "reference-0.1.0",
        "automatic",
        "unowned",
    )
    assert entry["evidence"] == [passed, failed] and entry["clean_runs"] == 3 and entry["in_force"] is True

    # The gate: the muted cell is listed and does not block; the unmuted failure still does.
    code, gate = _gate(matrix)
    assert code == 1 and gate["verdict"] == "NO-GO" and gate["muted"] == ["ref_q"], gate
    reasons = {(r["kind"], r["case"], r["blocking"]) for r in gate["reasons"]}  # type: ignore[attr-defined]
    assert reasons == {("failed", "ref_q", False), ("muted", "ref_q", False), ("failed", "ref_broken", True)}
    cell = next(c for c in gate["cells"] if c["case"] == "ref_q")  # type: ignore[attr-defined]
    assert cell["quarantine"]["evidence"] == [passed, failed] and [m["kind"] for m in cell["muted"]] == ["failed"]

    # Muted by hand too, with its owner: the gate has nothing left to block on, and says it is lenient.
    muted = matrix("quarantine", "ref_broken", "--runtime", "reference=0.1.0", "--owner", "kv-team",
                   "--until", dt.datetime.now(dt.UTC).date().isoformat(), "--reason", "issue 42")  # fmt: skip
    assert muted.exit_code == 0 and "muted ref_broken@reference-0.1.0" in muted.output, muted.output
    code, gate = _gate(matrix)
    assert code == 0 and gate["verdict"] == "GO" and gate["muted"] == ["ref_broken", "ref_q"], gate
    assert "2 cell(s) muted by quarantine" in str(gate["caveat"])
    text = matrix("gate", "reference", "0.1.0", "--policy", "q_gate").output
    muted_line = (
        "muted (quarantined, not blocking): ref_broken (owner kv-team, manual); ref_q (owner unowned, automatic)"
    )
    assert muted_line in text

    # Two clean runs are not three: still muted. The third ends the quarantine, recorded with its runs.
    _sync(matrix, broken=False)
    assert _run(matrix, "--case", "ref_q", "--repeat", "2", "--auto-quarantine", code=0) == []
    assert _quarantines(matrix)[0]["exited_at"] is None
    lines = _run(matrix, "--case", "ref_q", "--auto-quarantine", code=0)
    clean_runs = [uid for uid, _ in _uids(matrix, "ref_q")[2:]]
    assert len(clean_runs) == 3
    assert lines == [f"quarantine: ref_q@reference-0.1.0 exited after 3 clean runs ({', '.join(clean_runs)})"]
    ended = next(q for q in _quarantines(matrix) if q["case"] == "ref_q")
    assert (ended["exit"], ended["exit_reason"], ended["exit_evidence"], ended["in_force"]) == (
        "clean-runs",
        "3 clean runs in a row after entry",
        clean_runs,
        False,
    )
    assert ended["evidence"] == [passed, failed]  # the entry stays on record
    code, gate = _gate(matrix)
    assert gate["muted"] == ["ref_broken"]

    # Released by hand: the exit is recorded with its reason; a second release has nothing to end.
    released = matrix("unquarantine", "ref_broken", "--reason", "fixed by issue 42")
    assert released.exit_code == 0 and "released ref_broken@reference-0.1.0: fixed by issue 42" in released.output
    manual = next(q for q in _quarantines(matrix) if q["case"] == "ref_broken")
    assert (manual["exit"], manual["exit_reason"], manual["owner"]) == ("manual", "fixed by issue 42", "kv-team")
    before = matrix.dump()
    again = matrix("unquarantine", "ref_broken", "--reason", "twice")
    assert again.exit_code == 2 and "ref_broken is not quarantined" in again.output and matrix.dump() == before
    code, gate = _gate(matrix)
    assert code == 1 and gate["muted"] == [], gate


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["nope", "--owner", "a", "--until", "2099-01-01", "--reason", "r"], "unknown case 'nope'"),
        (["ref_q", "--owner", "a", "--until", "2001-01-01", "--reason", "r"], "--until 2001-01-01 is in the past"),
        (["ref_q", "--owner", "a", "--until", "soon", "--reason", "r"], "--until 'soon' is not a date"),
        (["ref_q", "--owner", " ", "--until", "2099-01-01", "--reason", "r"], "--owner is empty"),
        (["ref_q", "--owner", "a\nb", "--until", "2099-01-01", "--reason", "r"], "--owner must be one line"),
        (["ref_q", "--runtime", "reference=9.9", "--owner", "a", "--until", "2099-01-01", "--reason", "r"],
         "no such runtime"),
        (["ref_q", "--runtime", "vllm", "--owner", "a", "--until", "2099-01-01", "--reason", "r"],
         "write BACKEND=VERSION"),
        (["ref_q", "--owner", "a", "--until", "2099-01-01"], "Missing option '--reason'"),
    ],
)  # fmt: skip
def test_bad_quarantine_input_is_one_line_exit_2_database_unchanged(
    matrix: Matrix, args: list[str], words: str
) -> None:
    _sync(matrix, broken=False)
    before = matrix.dump()
    result = matrix("quarantine", *args)
    assert result.exit_code == 2, result.output
    assert words in result.output, result.output
    assert matrix.dump() == before


def test_a_cell_is_quarantined_once_at_a_time(matrix: Matrix) -> None:
    _sync(matrix, broken=False)
    first = matrix("quarantine", "ref_q", "--owner", "a", "--until", "2099-01-01", "--reason", "r")
    assert first.exit_code == 0, first.output
    before = matrix.dump()
    second = matrix("quarantine", "ref_q", "--owner", "b", "--until", "2099-01-02", "--reason", "r")
    assert second.exit_code == 2 and "already quarantined" in second.output and matrix.dump() == before


def test_imported_shards_bring_flake_evidence_together(
    matrix: Matrix, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A pass here and a failure on another host's shard: the import sees the flake and mutes the cell."""
    _sync(matrix, broken=False)
    assert _run(matrix, "--case", "ref_q", code=0) == []
    shard = Matrix(home=tmp_path_factory.mktemp("shard"), db_path=tmp_path_factory.mktemp("shard-db") / "m.db")
    _sync(shard, broken=True)
    results = shard.home / "results.json"
    ran = shard.subprocess("run", "--case", "ref_q", "--no-report", "-q", "--results-out", str(results),
                           "--campaign-key", "q-shard", "--auto-quarantine")  # fmt: skip
    assert ran.returncode == 1 and "quarantine:" not in ran.stdout, ran.stdout  # the shard never saw the pass
    imported = matrix("import", str(results), "--auto-quarantine")
    assert imported.exit_code == 0, imported.output
    (passed, _), (failed, _) = _uids(matrix, "ref_q")
    assert (f"quarantine: ref_q@reference-0.1.0 entered (automatic, owner unowned): flaky: passed in {passed} "
            f"(campaign 1) and failed in {failed} (campaign 2)") in imported.output  # fmt: skip
    again = matrix("import", str(results), "--auto-quarantine")  # importing twice changes nothing
    assert again.exit_code == 0 and "quarantine:" not in again.output and len(_quarantines(matrix)) == 1
