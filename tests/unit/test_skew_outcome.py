"""A skew cell's outcome class from its attempt's evidence, and `matrix skew CASE` over real rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from matrix.campaign import RunOptions, _selected_cells
from matrix.db.engine import create_db_engine, session_factory, transaction
from matrix.plan import Selection
from matrix.skew_outcome import classify
from tests.conftest import Matrix

NIXL = ("NIXL compatibility hash mismatch. Local: 1a2b, Remote: 3c4d. Prefill and decode instances have "
        "incompatible configurations")  # fmt: skip


@pytest.mark.parametrize(
    ("status", "kind", "message", "checks", "codes", "cls", "reason"),
    [
        ("passed", None, "", [], {}, "works", "every check passed"),
        ("failed", "startup", f"decode exited with 1\nRuntimeError: {NIXL}", [], {"decode": 1}, "clean-reject",
         f"RuntimeError: {NIXL}"),
        ("failed", "request", f"HTTP 500: {NIXL}", [], {}, "clean-reject", f"HTTP 500: {NIXL}"),
        ("timeout", "request", "no answer within 60 s: decode waited on prefill's KV (WAITING_FOR_REMOTE_KVS)", [],
         {}, "hang", "no answer within 60 s: decode waited on prefill's KV (WAITING_FOR_REMOTE_KVS)"),
        ("failed", "validation", "completion is empty", [{"name": "completion_nonempty", "message": "empty"}], {},
         "healthy-but-wrong", "answered, but completion_nonempty failed: completion is empty"),
        # vLLM's decode answers 500 and logs the hash mismatch: the runner copies that line into the message.
        ("failed", "validation", f"failed checks: http_status, kv_transfer\n--- error lines (decode.log) ---\n"
         f"line 120: ERROR [base_worker.py:1175] RuntimeError: {NIXL}",
         [{"name": "http_status"}, {"name": "kv_transfer"}], {}, "clean-reject",
         f"line 120: ERROR [base_worker.py:1175] RuntimeError: {NIXL}"),
        # The same refusal without a line naming the incompatibility is not a clean one.
        ("failed", "validation", "failed checks: http_status\n--- error lines (decode.log) ---\nline 9: ERROR oops",
         [{"name": "http_status"}], {}, "healthy-but-wrong",
         "answered, but http_status failed: failed checks: http_status"),
        # What a reference pair whose prefill drops the KV transfer records (two http_status checks, the
        # unary and the streamed request): each check named once, and the check's own message quoted.
        ("failed", "validation", "failed checks: http_status",
         [{"name": "http_status", "message": "HTTP status is 502; expected 200; body 'KV transfer failed'"},
          {"name": "http_status", "message": "stream: HTTP status is 502"}], {},
         "healthy-but-wrong", "answered, but http_status failed: HTTP status is 502; expected 200; body 'KV transfer "
         "failed'"),
        ("failed", "startup", "prefill exited with -11 before ready", [], {"prefill": -11}, "crash",
         "prefill exited -11; prefill exited with -11 before ready"),
        ("failed", "request", "decode died mid-request (exit code 137)", [], {"decode": 137}, "crash",
         "decode exited 137; decode died mid-request (exit code 137)"),
        ("skipped", None, "runtime not provisioned", [], {}, "not-run", "no evidence: the attempt is skipped"),
        ("error", "config", "no such model dir", [], {}, "not-run",
         "matrix could not run the pair (config): no such model dir"),
    ],
)  # fmt: skip
def test_classes(status: str, kind: str | None, message: str, checks: list[dict[str, str]],
                 codes: dict[str, int], cls: str, reason: str) -> None:  # fmt: skip
    verdict = classify(status, kind, message, checks, codes)
    assert (verdict.cls, verdict.reason) == (cls, reason)


def _grid_campaign(m: Matrix) -> None:
    engine = create_db_engine(m.url)
    try:
        with transaction(session_factory(engine)) as session:
            selection = Selection(cases=("dynamo_mocker_disaggregated",), skew=True)
            _selected_cells(session, RunOptions(selection=selection), lambda _: None)
    finally:
        engine.dispose()
    m.sql("UPDATE cell_run SET status = 'passed' WHERE roles_key = ''")
    m.sql("UPDATE cell_run SET status = 'failed', failure_kind = 'startup', message = ?, exit_codes = ? "
          "WHERE roles_key = 'prefill=1.4.2,decode=1.6.1'", f"decode exited\n{NIXL}", '{"decode": 1}')  # fmt: skip
    m.sql("UPDATE cell_run SET status = 'timeout', failure_kind = 'request', message = 'no answer in 60 s' "
          "WHERE roles_key = 'prefill=1.6.1,decode=1.4.2'")  # fmt: skip


def test_skew_command_shows_the_grid_and_reasons(seeded: Matrix) -> None:
    _grid_campaign(seeded)
    result = seeded("skew", "dynamo_mocker_disaggregated", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["versions"] == ["1.4.2", "1.5.1", "1.6.1"]
    by_pair = {(c["prefill"], c["decode"]): c for c in data["cells"]}
    # Only finished attempts: the diagonal and two pairs; the four still pending pairs have no evidence yet.
    assert len(by_pair) == 5 and all(by_pair[(v, v)]["class"] == "works" for v in data["versions"])
    assert by_pair[("1.4.2", "1.6.1")]["class"] == "clean-reject" and NIXL in by_pair[("1.4.2", "1.6.1")]["reason"]
    assert by_pair[("1.6.1", "1.4.2")]["class"] == "hang"
    text = seeded("skew", "dynamo_mocker_disaggregated")
    assert text.exit_code == 0 and "rows prefill, columns decode" in text.output and "clean-reject" in text.output


def test_skew_of_an_unknown_case_is_exit_2(seeded: Matrix) -> None:
    result = seeded("skew", "no_such_case")
    assert result.exit_code == 2 and "unknown case 'no_such_case'" in result.output


def test_skew_attempts_stay_out_of_the_diagonal_views_and_count_as_cells(seeded: Matrix) -> None:
    _grid_campaign(seeded)
    (campaign,) = json.loads(seeded("campaigns", "list", "--json").output)
    assert campaign["cells"] == 9
    assert campaign["outcomes"] == {"failed": 1, "passed": 3, "pending": 4, "timeout": 1}
    from matrix.report.data import load_results

    engine = create_db_engine(seeded.url)
    try:
        with session_factory(engine)() as session:
            attempts = list(load_results(session).attempts())
    finally:
        engine.dispose()
    # The report's diagonal matrix sees the three diagonal attempts only (a failed pair is not decode's failure).
    assert sorted(a.status for a in attempts if a.status != "pending") == ["passed", "passed", "passed"]


def test_the_report_has_an_n_by_n_page_per_skew_case(seeded: Matrix, tmp_path: Path) -> None:
    _grid_campaign(seeded)
    assert seeded("report", "--out", str(tmp_path)).exit_code == 0
    page = (tmp_path / "skew-dynamo_mocker_disaggregated.html").read_text(encoding="utf-8")
    cells = re.findall(r'<td class="skew skew-([a-z-]+)( diagonal)?">', page)
    by_class = {cls: sum(1 for c, _ in cells if c == cls) for cls in {c for c, _ in cells}}
    assert by_class == {"works": 3, "clean-reject": 1, "hang": 1, "not-run": 4}
    assert sum(1 for _, diagonal in cells if diagonal) == 3  # the diagonal is outlined, whatever its class
    # The legend names every class with its colour, so a release manager never has to guess one.
    for cls in ("works", "clean-reject", "hang", "healthy-but-wrong", "crash", "not-run"):
        assert f'<span class="swatch skew-{cls}">{cls}</span>' in page
    assert "NIXL compatibility hash mismatch" in page  # the reason, one click (an anchor) away
    assert 'href="skew-dynamo_mocker_disaggregated.html"' in (tmp_path / "index.html").read_text(encoding="utf-8")


def test_show_by_key_tells_a_pair_from_the_diagonal_of_decodes_runtime(seeded: Matrix) -> None:
    _grid_campaign(seeded)
    diagonal = json.loads(seeded("show", "dynamo_mocker_disaggregated@dynamo-1.6.1", "--json").output)
    assert diagonal["status"] == "passed"
    key = "dynamo_mocker_disaggregated@dynamo[prefill=1.4.2,decode=1.6.1]"
    pair = json.loads(seeded("show", key, "--json").output)
    assert pair["status"] == "failed" and pair["cell"] == key
