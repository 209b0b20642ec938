"""A skew cell's outcome class from its attempt's evidence, and `matrix skew CASE` over real rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from matrix.db.engine import create_db_engine, session_factory
from matrix.skew_outcome import classify, first_incompatibility, logged_refusal, refused_unexplained
from tests.helpers.cli import Matrix
from tests.helpers.skew import NIXL, grid_campaign


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
         [{"name": "http_status"}], {}, "error-answer",
         "no 200 answer, and nothing names an incompatibility: failed checks: http_status"),
        # What a reference pair whose prefill drops the KV transfer records (two http_status checks, the
        # unary and the streamed request): each check named once, and the check's own message quoted.
        ("failed", "validation", "failed checks: http_status",
         [{"name": "http_status", "message": "HTTP status is 502; expected 200; body 'KV transfer failed'"},
          {"name": "http_status", "message": "stream: HTTP status is 502"}], {},
         "error-answer", "no 200 answer, and nothing names an incompatibility: HTTP status is 502; expected 200; "
         "body 'KV transfer failed'"),
        # vLLM's own 5 s NIXL handshake timeout under load: an error answer, not a refusal and not a wrong answer.
        ("failed", "validation", "failed checks: http_status, kv_transfer\n--- error lines (decode.log) ---\n"
         "line 80: ERROR NIXL transfer failure: handshake_setup_failed",
         [{"name": "http_status", "message": "HTTP status is 500; expected 200; body 'Internal Server Error'"},
          {"name": "kv_transfer", "message": "no NIXL transfer"}], {}, "error-answer",
         "no 200 answer, and nothing names an incompatibility: HTTP status is 500; expected 200; body 'Internal "
         "Server Error'"),
        # No HTTP answer at all, every process still up.
        ("failed", "request", "the request failed: RemoteProtocolError: Server disconnected", [], {}, "error-answer",
         "no 200 answer, and nothing names an incompatibility: the request failed: RemoteProtocolError: Server "
         "disconnected"),
        ("failed", "validation", "failed checks: equivalent_to_aggregated; aggregated instance 99.7 s",
         [{"name": "equivalent_to_aggregated", "message": "0/8 prompts token-identical to aggregated, 8 real"}], {},
         "healthy-but-wrong", "answered, but equivalent_to_aggregated failed: 0/8 prompts token-identical to "
         "aggregated, 8 real"),
        ("failed", "startup", "prefill exited with -11 before ready", [], {"prefill": -11}, "crash",
         "prefill exited -11; prefill exited with -11 before ready"),
        ("failed", "request", "decode died mid-request (exit code 137)", [], {"decode": 137}, "crash",
         "decode exited 137; decode died mid-request (exit code 137)"),
        # The client saw a 500; decode's own log (its error lines, which the runner adds) names the refusal, and
        # a traceback's file name with a weaker word ("protocol") does not win over it.
        ("failed", "validation", "failed checks: http_status\n--- decode error lines ---\nline 9: File \"protocol.py\""
         f"\nline 10: RuntimeError: {NIXL}", [{"name": "http_status", "message": "HTTP status is 500"}], {},
         "clean-reject", f"line 10: RuntimeError: {NIXL}"),
        ("failed", "validation", "failed checks: http_status\n--- decode error lines ---\nline 3: ERROR out of memory",
         [{"name": "http_status", "message": "HTTP status is 500"}], {}, "error-answer",
         "no 200 answer, and nothing names an incompatibility: HTTP status is 500"),
        ("skipped", None, "runtime not provisioned", [], {}, "not-run", "no evidence: the attempt is skipped"),
        ("error", "config", "no such model dir", [], {}, "not-run",
         "matrix could not run the pair (config): no such model dir"),
    ],
)  # fmt: skip
def test_classes(status: str, kind: str | None, message: str, checks: list[dict[str, str]],
                 codes: dict[str, int], cls: str, reason: str) -> None:  # fmt: skip
    verdict = classify(status, kind, message, checks, codes)
    assert (verdict.cls, verdict.reason) == (cls, reason)


def test_skew_command_shows_the_grid_and_reasons(seeded: Matrix) -> None:
    grid_campaign(seeded)
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
    grid_campaign(seeded)
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
    grid_campaign(seeded)
    assert seeded("report", "--out", str(tmp_path)).exit_code == 0
    page = (tmp_path / "skew-dynamo_mocker_disaggregated.html").read_text(encoding="utf-8")
    cells = re.findall(r'<td class="skew skew-([a-z-]+)( diagonal)?">', page)
    by_class = {cls: sum(1 for c, _ in cells if c == cls) for cls in {c for c, _ in cells}}
    assert by_class == {"works": 3, "clean-reject": 1, "hang": 1, "not-run": 4}
    assert sum(1 for _, diagonal in cells if diagonal) == 3  # the diagonal is outlined, whatever its class
    # The legend names every class with its colour, so a release manager never has to guess one.
    for cls in ("works", "clean-reject", "hang", "error-answer", "healthy-but-wrong", "crash", "not-run"):
        assert f'<span class="swatch skew-{cls}">{cls}</span>' in page
    assert "NIXL compatibility hash mismatch" in page  # the reason, one click (an anchor) away
    assert 'href="skew-dynamo_mocker_disaggregated.html"' in (tmp_path / "index.html").read_text(encoding="utf-8")


def test_show_by_key_tells_a_pair_from_the_diagonal_of_decodes_runtime(seeded: Matrix) -> None:
    grid_campaign(seeded)
    diagonal = json.loads(seeded("show", "dynamo_mocker_disaggregated@dynamo-1.6.1", "--json").output)
    assert diagonal["status"] == "passed"
    key = "dynamo_mocker_disaggregated@dynamo[prefill=1.4.2,decode=1.6.1]"
    pair = json.loads(seeded("show", key, "--json").output)
    assert pair["status"] == "failed" and pair["cell"] == key


def test_the_first_line_of_a_log_that_says_incompatible_is_found_past_a_long_traceback(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    noise = "".join(f'ERROR [base_worker.py:1318]   File "protocol_{i}.py", line {i}\n' for i in range(400))
    note = "INFO Triton not installed or not compatible"  # not an error: every vLLM start logs it
    log.write_text(f"{note}\n{noise}ERROR [base_worker.py:1318] RuntimeError: {NIXL}\nINFO later mismatch\n")
    assert first_incompatibility(log) == f"ERROR [base_worker.py:1318] RuntimeError: {NIXL}"
    assert first_incompatibility(tmp_path / "missing.log") is None


def test_an_attempt_recorded_without_the_engines_words_is_explained_from_its_logs(tmp_path: Path) -> None:
    (tmp_path / "decode.log").write_text(f"INFO up\nERROR [base_worker.py:1042] RuntimeError: {NIXL}\n")
    (tmp_path / "prefill.log").write_text("INFO up\n")
    checks = [{"name": "http_status", "message": "HTTP status is 500"}]
    verdict = classify("failed", "validation", "failed checks: http_status", checks, {})
    assert refused_unexplained(verdict, checks)
    said = logged_refusal(str(tmp_path))
    assert said == f"--- decode says: ERROR [base_worker.py:1042] RuntimeError: {NIXL}"
    assert classify("failed", "validation", f"failed checks: http_status\n{said}", checks, {}).cls == "clean-reject"
    assert logged_refusal(str(tmp_path / "gone")) == "" and logged_refusal(None) == ""
